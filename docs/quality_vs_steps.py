"""Draw docs/quality-vs-steps.png, the README's picture, from the measured results in the repository.

    python docs/quality_vs_steps.py [OUT.png]

Accuracy against average decoding steps on the bundled testbed model (300 held-out test items per task, generation
length 64, blocks or window of 16): the heuristic rows of `tracelock/testbed/model/eval-gen64-n300.json`
(`tracelock testbed-eval`) and the learned rows of `bench/results/testbed_method_d3d2eea_cpu.json`
(`tracelock eval`: Learn2PD and TraceLock, measured on the same items and model).
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEURISTICS = ROOT / "tracelock" / "testbed" / "model" / "eval-gen64-n300.json"
LEARNED = ROOT / "bench" / "results" / "testbed_method_d3d2eea_cpu.json"
# lines join the rows of one rule as it commits more per step; each entry: (label, [testbed-eval row labels])
LINES = [("confidence, 1 / 2 / 4 tokens per step", ["confidence 1/step", "confidence 2/step", "confidence 4/step"]),
         ("Fast-dLLM threshold 0.9 / 0.7 / 0.5", ["threshold 0.9", "threshold 0.7", "threshold 0.5"])]
POINTS = [("random order, 1 token per step", "random 1/step", "x"),
          ("oracle (commits what confidence 1/step ends with)", "oracle (of confidence 1/step)", "*")]
LEARNED_POINTS = [("Learn2PD", "l2p", "s"), ("TraceLock, window of 16 (400 training steps)", "tracelock", "D")]


def _rows(task: str) -> tuple[dict, dict]:
    """({label: (steps, accuracy %)} of the heuristics, the same of the learned policies) for one task at 64/16."""
    heuristics = {r["policy"]: (r["avg_steps"], 100 * r["accuracy"])
                  for r in json.loads(HEURISTICS.read_text())[f"{task} gen64 block16"]}
    learned = {r["policy"]: (r["avg_steps"], 100 * r["metric"])
               for r in json.loads(LEARNED.read_text())["eval"][task] if r["setting"] == "64/16"}
    return heuristics, learned


def draw(out: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.6, 3.9))
    for i, task in enumerate(("math", "code")):
        ax = fig.add_subplot(1, 2, i + 1)
        heuristics, learned = _rows(task)
        for label, rows in LINES:
            xs, ys = zip(*(heuristics[r] for r in rows))
            ax.plot(xs, ys, "o-", label=label)
        for label, row, marker in POINTS:
            ax.plot(*heuristics[row], marker, ms=9, ls="none", label=label)
        for label, row, marker in LEARNED_POINTS:
            ax.plot(*learned[row], marker, ms=7, ls="none", label=label)
        ax.set_title(f"testbed {task}: {'accuracy' if task == 'math' else 'pass@1'}, gen 64, blocks of 16")
        ax.set_xlabel("average decoding steps (backbone forwards) per item")
        ax.set_ylabel("% correct, 300 held-out items")
        ax.grid(alpha=0.3)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(out, dpi=100)
    return out


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "quality-vs-steps.png"))
