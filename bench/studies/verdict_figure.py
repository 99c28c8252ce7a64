"""The picture of a verdict folder's judged cells (those with a learned curve), from its frontier.json and
records.json, with the shipped commit rule's points of each cell beside them where the folder holds them
(variant-<task>-<setting>.json, `bench/studies/matched_runs.py --records`), and the threshold with the same end-of-text
hold where it holds that control (control-<task>-<setting>.json), and the fill up to the hold-out protocol's grid
where it holds that (envelope-<task>-<setting>.json: the shipped rule's other theta points, the held threshold's other
tau points, the factor and Fréchet rules with the hold):

    python bench/studies/verdict_figure.py bench/results/verdict-testbed-llada docs/verdict.png
"""

import json
import sys
from pathlib import Path

from tracelock.atomic import atomic_write
from tracelock.eval.frontier import frontier_figure
from tracelock.eval.matched import recompute_matched

SHIPPED = "TraceLock-ST, shipped rule"
HELD = "threshold, hold_end"
FILL = {"factor-": "factor, hold_end", "frechet-delta": "Fréchet, hold_end"}  # the fill's strongest rules, held


def policy(point: str) -> str:
    """A record point's policy slug (its name without the run's folder)."""
    return point.split("/", 1)[1]


def points_of(records: Path, keep) -> list:
    """The points of a records file whose name ``keep`` accepts, as frontier curve points (accuracy and mean steps
    over its items)."""
    rec, out = json.loads(records.read_text()), []
    for name, p in rec["points"].items():
        if keep(name):
            n = len(p["steps"])
            out.append(dict(avg_steps=sum(p["steps"]) / n, metric=p["correct"].count("1") / n, pareto=False))
    return out


folder, png = Path(sys.argv[1]), sys.argv[2]
result = recompute_matched(folder, resamples=10)  # only which cells are judged matters here
judged = {t: {s: d for s, d in cells.items() if d["matched"]} for t, cells in result["tasks"].items()}
for task, cells in judged.items():
    for setting, d in cells.items():
        cell = f"{task.split(':')[1]}-{setting.replace('/', '-')}"
        if (folder / f"variant-{cell}.json").exists():
            # the frontier's TraceLock-ST curve is the paper's rule (the verdict); the shipped rule's points join it
            d["curves"] = {(f"{k}, paper's rule" if k == "TraceLock-ST" else k): v for k, v in d["curves"].items()}
            d["curves"][SHIPPED] = points_of(folder / f"variant-{cell}.json",
                                             lambda name: policy(name).startswith("tracelock"))
        if (folder / f"control-{cell}.json").exists():  # the control: the threshold with the same end-of-text hold
            d["curves"][HELD] = points_of(folder / f"control-{cell}.json", lambda name: name.startswith("held"))
        fill = folder / f"envelope-{cell}.json"
        if fill.exists():
            d["curves"].setdefault(SHIPPED, []).extend(points_of(fill, lambda n: policy(n).startswith("tracelock")))
            d["curves"].setdefault(HELD, []).extend(
                points_of(fill, lambda n: policy(n).startswith("threshold") and policy(n).endswith("hold-end-true")))
            for prefix, label in FILL.items():  # Fréchet's plain held form: the family-wide one, on Dream too
                d["curves"][label] = points_of(fill, lambda n, p=prefix: policy(n).startswith(p)
                                               and policy(n).endswith("-hold-end-true") and "first-token" not in n)
figure = frontier_figure(dict(result, tasks={t: cells for t, cells in judged.items() if cells}))
atomic_write(png, lambda path: Path(path).write_bytes(figure))  # a killed run leaves the old picture whole
