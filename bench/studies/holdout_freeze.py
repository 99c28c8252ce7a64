"""The second hold-out's protocol, built from validation records alone: the fitted gates against every training-free
rule of the package, plain and held, on a fresh test draw.

    python bench/studies/holdout_freeze.py --out bench/results/holdout2 --seed 8181 --margin 0.08  # protocol.json

Per family, task and setting (the protocol's points are per cell):

- the gate: every value of its knob that `gate_validation.py` decoded in the cell (traced there until its points lay
  at most 1.5 mean steps apart), its base in the cell's form, so its hold-out curve is as dense as its validation one;
- the envelope: every training-free curve of the validation cells (`rules_since.py`'s and the factor rule's), each
  pruned to the points that can be read at the gate's budgets: those whose validation mean steps lie at or below
  `REACH` times the gate's dearest point, and below the gate's cheapest point only the dearest one
  and the most accurate one (a step function reads a budget by the best point at or below it, so a cheaper point
  counts only where it is that best); of those, the points more than `MARGIN` below the validation envelope at their
  own steps go (they would have to gain that much on the test items to matter), but every curve keeps at least its
  point nearest the envelope (its cheapest where it only runs dearer than that reach), so every rule is in it, plain
  and held.

The cost is estimated from the validation runs' CPU time per item-step (`gate_validation.py` records it per cell) and
the points' mean steps; the protocol holds the estimate and the goal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate_validation as gv  # noqa: E402

SETTINGS = ("64/16", "64/32", "128/32", "128/64")
TASKS = ("math", "code")
REACH = 1.15  # envelope points up to this many times the gate's dearest validation point's mean steps
MARGIN = 0.10  # and at most this far (accuracy) below the validation envelope at their own steps
N_ITEMS = 300
MARGINS = (0.02, 0.03, 0.05, 0.08, 0.10)  # the margins whose estimates the protocol records beside its own


def _mean(values) -> float:
    return sum(values) / len(values)


def cell_points(family: str, task: str, setting: str) -> dict:
    """{curve: [(spec, mean steps, accuracy)]} of a validation cell, the gate's and every training-free curve."""
    from tracelock.eval.runner import parse_policies

    name = gv.cell_name(family, task, setting)
    out = {}
    for rec in (json.loads((gv.RULES / f"{name}.json").read_text()),
                json.loads((gv.RESULTS / f"{name}.json").read_text())):
        for curve, specs in rec["specs"].items():
            for spec in specs:
                p = rec["points"][f"{curve}/{parse_policies(spec)[0].slug}"]
                out.setdefault(curve, []).append((spec, _mean(p["steps"]), _mean([c == "1" for c in p["correct"]])))
    return out


def _per_item_step(family: str, gen: str) -> float:
    """CPU seconds per item-step of the family's validation decodes at this length (the mean over its cells that
    measured one)."""
    got = [json.loads(path.read_text())["cpu_per_item_step"] for path in gv.RESULTS.glob(f"{family}-*-{gen}-*.json")]
    got = [x for x in got if x is not None]
    return sum(got) / len(got)


def envelope_at(curves: dict):
    """The training-free curves' step function: at s steps, the best validation accuracy of their points at or below
    s (0 below all of them)."""
    pts = [(steps, acc) for curve, ps in curves.items() if curve != "gate" for _, steps, acc in ps]

    def at(s: float) -> float:
        return max((acc for steps, acc in pts if steps <= s), default=0.0)

    return at


def prune(points: list, lo: float, hi: float, envelope, margin: float) -> list:
    """The specs of one training-free curve kept for the hold-out (see the module docstring): those a step function
    can read at the gate's budgets [lo, hi], less those more than ``margin`` below the envelope at their own steps;
    the curve's nearest point to the envelope where that leaves none, and its cheapest point where none is in reach
    (every rule stays in the envelope)."""
    reach = [p for p in points if lo <= p[1] <= REACH * hi]
    below = [p for p in points if p[1] < lo]
    if below:
        reach += [max(below, key=lambda p: p[1]), max(below, key=lambda p: (p[2], -p[1]))]
    reach = list(dict.fromkeys(reach))
    if not reach:  # a curve that only runs dearer than the gate's reach: its cheapest point, so the rule is in it
        return [min(points, key=lambda p: p[1])[0]]
    near = [p for p in reach if envelope(p[1]) - p[2] <= margin + 1e-9]
    return [p[0] for p in near] or [min(reach, key=lambda p: envelope(p[1]) - p[2])[0]]


def build(margin: float) -> dict:
    families, cost = {}, {}
    for family in ("llada", "dream"):
        fam = dict(model=gv.MODELS[family], points={})
        for task in TASKS:
            fam["points"][task] = {}
            for s in SETTINGS:
                curves = cell_points(family, task, s)
                gate = curves["gate"]
                lo, hi, env = min(p[1] for p in gate), max(p[1] for p in gate), envelope_at(curves)
                keep = {p[0] for p in gate}
                for curve, pts in curves.items():
                    if curve != "gate":
                        keep.update(prune(pts, lo, hi, env, margin))
                specs = [spec for pts in curves.values() for spec, _, _ in pts if spec in keep]
                fam["points"][task][s] = specs
                steps = {spec: st for pts in curves.values() for spec, st, _ in pts}
                cost[f"{family} {task} {s}"] = round(
                    N_ITEMS * _per_item_step(family, s.split("/")[0]) * sum(steps[spec] for spec in specs))
        families[family] = fam
    return dict(families=families, cost=cost)


def protocol(seed: int, margin: float) -> dict:
    built = build(margin)
    total = sum(built["cost"].values())
    return {
        "what": "the second hold-out: TraceLock's fitted gates (one per family and task, `tracelock fit`'s choice on "
                "validation) against the envelope of every training-free rule of the package, plain and held, on "
                "test items no earlier run read",
        "frozen_before_decoding": True,
        "seed": seed,
        "margin": margin,
        "items": "bench/results/holdout2/items.json",
        "draw": f"python bench/studies/holdout.py --protocol bench/results/holdout2 draw --n {N_ITEMS} --seed {seed} "
                "--pool 4000 --exclude bench/results/holdout/items.json: 300 items per task from the first 4000 "
                "distinct test problems, none of the first 500, of the seed-0/1/2026 draws or of the first "
                "hold-out (only 125 such items are left among the first 2000, so most come from places "
                "2000-3999, later distinct problems and so harder than the validation mix: both sides decode the "
                "same items, so the comparison is paired, but accuracies do not compare with validation's)",
        "settings": list(SETTINGS),
        "tasks": list(TASKS),
        "how_chosen": "every point from validation records only (bench/results/rules-since-validation/ and "
                      "bench/results/gate-validation/: 100 validation items per task, seed 1213): the gate at every "
                      "knob value traced there without holes (at most 1.5 mean steps apart), its base in the cell's "
                      "better form on validation (with or without the end hold); each "
                      "training-free curve pruned to the points a step function can read at the gate's budgets "
                      f"(mean steps up to {REACH} times the gate's dearest point; below its cheapest, the dearest "
                      f"and the most accurate point), less those more than {margin} below the validation envelope "
                      "at their own steps, each curve keeping at least its point nearest the envelope (its cheapest "
                      "where it only runs dearer than that reach; so every "
                      "rule is in it, plain and held), by bench/studies/holdout_freeze.py. The margin was set on the "
                      "estimates alone (margin_estimates_cpu_hours): the widest that leaves about a fifth of the "
                      "compute limit for the harder items' longer decodes. Nothing here read a test item.",
        "families": built["families"],
        "decode": "python bench/studies/holdout.py --protocol bench/results/holdout2 run --family F --task T "
                  "--setting G/W --work DIR (no KV cache, greedy, fp32, one torch thread per process, CPU), then "
                  "python bench/studies/holdout.py --protocol bench/results/holdout2 records ...",
        "reading": "step function on both sides: a curve's accuracy at s steps is its best point at or below s "
                   "(tracelock.eval.matched.gap_at_matched_steps), for the gate and for the envelope alike",
        "analysis": "python bench/studies/verdict_envelope.py bench/results/holdout2-testbed-llada "
                    "bench/results/holdout2-testbed-dream --learned gate --resamples 2000: the 'strongest' "
                    "comparison (the gate against the envelope of every training-free curve in the records, plain "
                    "and held), gap at matched steps with 90% paired bootstrap intervals (one item resample per "
                    "task shared by its cells), plain verdicts (interval above / below zero) and Holm's (two-sided "
                    "bootstrap p, family-wise 0.10 over the 16 cells), pooled mean gap over the 16 cells with its "
                    "interval",
        "goal": "the gate ahead of the envelope beyond noise (the 90% interval above zero) in at least 8 of the 16 "
                "cells, behind (the interval below zero) in none, and the pooled gap's interval above zero. "
                "Reported whatever it says, once.",
        "compute": f"estimated {total / 3600:.1f} CPU-hours at one thread per process (validation CPU time per "
                   "item-step times the points' validation mean steps times 300 items; the items are harder, so "
                   "answers may run longer): at most 25",
        "cost_cpu_seconds": built["cost"],
        "margin_estimates_cpu_hours": {str(m): round(sum(build(m)["cost"].values()) / 3600, 1) for m in MARGINS},
    }


def main(argv=None) -> int:
    from tracelock.atomic import atomic_write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the protocol folder (bench/results/holdout2)")
    p.add_argument("--seed", type=int, required=True, help="the item draw's seed, written into the protocol")
    p.add_argument("--margin", type=float, default=MARGIN,
                   help=f"drop envelope points this far below the validation envelope (default {MARGIN})")
    args = p.parse_args(argv)
    result = protocol(args.seed, args.margin)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "protocol.json", result)
    for family, fam in result["families"].items():
        for task, gens in fam["points"].items():
            print(family, task, {g: len(v) for g, v in gens.items()})
    print(result["compute"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
