"""TraceLock's next chance, on validation: the shipped controller and its RL refinements (`tracelock rl`, with and
without a price per step) against Fast-dLLM's threshold with the end-of-text hold, at matched steps.

Reads `tracelock eval` run folders (every point on the same items), pairs the points by item id, and writes the
per-item records and each controller's gap to the held threshold (90% paired bootstrap interval) as JSON:

    python bench/studies/rl_step_cost.py RUN_BASE RUN_RL --out bench/results/rl-step-cost-validation.json
"""

import argparse
import json
import sys
from pathlib import Path

from tracelock.atomic import atomic_write_json
from tracelock.eval.matched import Curve, verdict

HELD = "threshold-tau-{}-hold-end-true"


def read_points(folders: list) -> tuple[list, dict]:
    """(item ids, {point slug: (correct [N] 0/1, steps [N])}) of every point of the run folders' 64/16 runs."""
    ids, points = None, {}
    for folder in folders:
        for run in sorted((Path(folder) / "runs").glob("*/*")):
            rows = sorted((json.loads(line) for line in (run / "items-rank0.jsonl").read_text().splitlines()),
                          key=lambda r: r["id"])
            got = [r["id"] for r in rows]
            if ids is not None and got != ids:
                raise SystemExit(f"{run} holds other items than the first run; the points must share their items")
            ids = got
            points[run.name] = ([int(r["correct"]) for r in rows], [r["steps"] for r in rows])
    return ids, points


def curve(name: str, points: dict, match) -> Curve:
    chosen = sorted(k for k in points if match(k))
    return Curve(name, [points[k][0] for k in chosen], [points[k][1] for k in chosen], chosen)


def analyse(folders: list, resamples: int) -> dict:
    ids, points = read_points(folders)
    held = curve("held threshold", points, lambda k: k.startswith("threshold") and "hold-end-true" in k)
    learned = {
        "shipped": lambda k: k.startswith("tracelock-theta-"),
        "rl, no step price": lambda k: "rl59-math-b0-c0-theta" in k,
        "rl, step price 0.25": lambda k: "rl59-math-b0-c0.25-theta" in k,
    }
    rows = {}
    for name, match in learned.items():
        c = curve(name, points, match)
        steps, acc = c.points()
        v = verdict(c, [held], resamples=resamples)
        rows[name] = dict(points={label: [round(float(a), 4), round(float(s), 2)]
                                  for label, a, s in zip(c.labels, acc, steps)},
                          gap=v["gap"], gap_interval=v["gap_interval"], gap_above_zero=v["gap_above_zero"])
    steps, acc = held.points()
    return dict(items=ids, held_threshold={label: [round(float(a), 4), round(float(s), 2)]
                                           for label, a, s in zip(held.labels, acc, steps)},
                against_held_threshold=rows,
                records={k: dict(correct="".join(map(str, c)), steps=s) for k, (c, s) in sorted(points.items())})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="tracelock eval run folders (the same items in each)")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    args = p.parse_args(argv)
    result = analyse(args.folders, args.resamples)
    for name, row in result["against_held_threshold"].items():
        if row["gap"] is None:
            print(f"{name}: no step range shared with the held threshold; points (accuracy, steps) {row['points']}")
            continue
        lo, hi = row["gap_interval"]
        print(f"{name}: gap {100 * row['gap']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] points; "
              f"points (accuracy, steps) {row['points']}")
    print("held threshold:", result["held_threshold"])
    if args.out:
        atomic_write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
