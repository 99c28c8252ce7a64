"""The recipe table of a `bench/studies/testbed_recipe.sh` study: each controller variant's held-out AUROC / F0.5 (fixed
crop, the deployment's view) and its steps at the reference accuracy on the validation frontier, beside the baselines'.

    python bench/studies/recipe_table.py runs/recipe-llada
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tracelock.eval.frontier import steps_cell  # noqa: E402


def recipe_table(work: Path) -> str:
    result = json.loads((work / "frontier" / "frontier.json").read_text())
    if result["split"] != "validation":
        raise SystemExit(f"{work}/frontier is on the {result['split']} split; the recipe is chosen on validation")
    panels = [(task.split(":")[-1], setting, d) for task, s in result["tasks"].items() for setting, d in s.items()]
    head = " | ".join(f"steps at ref., {task} {setting}" for task, setting, _ in panels)
    lines = [f"| variant | AUROC | F0.5 | {head} |", "|---" * (3 + len(panels)) + "|",
             "| reference: " + ", ".join(f"{task} {100 * d['reference']['metric']:.1f}%" for task, _, d in panels)
             + " |" + " |" * (2 + len(panels))]
    curves = list(dict.fromkeys(c for _, _, d in panels for c in d["curves"]))
    for curve in curves:
        run = work / ("st/controller" if curve == "TL-ST" else "ctrl-" + curve.removeprefix("TL-"))
        metrics = json.loads((run / "metrics.json").read_text())["fixed_crop"] if curve.startswith("TL-") else None
        quality = f"{metrics['auroc']:.3f} | {metrics['f0_5']:.3f}" if metrics else "- | -"
        lines.append(f"| {curve} | {quality} | " + " | ".join(steps_cell(d, curve) for _, _, d in panels) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(recipe_table(Path(sys.argv[1])))
