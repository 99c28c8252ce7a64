"""Draw docs/frontier.png and print the steps-at-reference table of the first, superseded test frontier (the first N
test items; docs/history.md), from its results in bench/results/ (`bench/studies/testbed_frontier.sh` on each bundled
model).

    python docs/frontier_results.py [OUT.png]

One panel per model, task and setting: accuracy against mean steps for every policy along its knob, Pareto points
ringed, the reference accuracy (one token per step, minus 1 point) dashed.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tracelock.eval.frontier import frontier_figure, steps_cell  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# (model label, frontier.json files: 64/16 and 64/32, then 128/32; 300 test items per task each)
MODELS = [("LLaDA-family", ["frontier-testbed-gen64.json", "frontier-testbed-gen128.json"]),
          ("Dream-family", ["frontier-testbed-dream-gen64.json", "frontier-testbed-dream-gen128.json"])]
CURVES = ["threshold", "l2p", "TraceLock", "TraceLock-ST"]  # the table's columns, after the reference rule
NAMES = {"threshold": "Fast-dLLM", "l2p": "Learn2PD", "confidence": "confidence", "entropy": "entropy"}

def merged() -> dict:
    """One frontier result whose tasks are "<model> <task>" over every file of MODELS."""
    out = {"tasks": {}}
    for label, files in MODELS:
        for name in files:
            result = json.loads((RESULTS / name).read_text())
            for task, settings in result["tasks"].items():
                for setting, d in settings.items():
                    d = dict(d, n=next(iter(d["curves"].values()))[0]["n"])
                    out["tasks"].setdefault(f"{label} {task.split(':')[-1]}", {})[setting] = d
    return out


def table(result: dict) -> str:
    lines = ["| model, task | setting | items | one per step | " + " | ".join(NAMES.get(c, c) for c in CURVES) + " |",
             "|---" * (4 + len(CURVES)) + "|"]
    for task, settings in result["tasks"].items():
        for setting, d in settings.items():
            ref = d["reference"]
            lines.append(f"| {task} | {setting} | {d['n']} | {100 * ref['metric']:.1f}% / {ref['avg_steps']:.0f} | "
                         + " | ".join(steps_cell(d, c, seconds_digits=2) for c in CURVES) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    result = merged()
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "frontier.png"
    out.write_bytes(frontier_figure(result))
    print(table(result))
