"""Accuracy at matched steps: does a policy beat the strongest heuristic, with a paired interval over items.

A curve is a policy's points (one per knob value), each with a per-item record (correct, steps) on the same items.
Read a curve as a step function of the step budget s: ``acc(s)`` = the best accuracy among its points whose mean
steps are at most s (undefined below its cheapest point). The strongest heuristic ``H(s)`` is, at each s, the best of
the heuristic curves. Two numbers per policy:

- **gap**: the mean of ``acc(s) - H(s)`` over the step range both cover, from the later of the two cheapest points
  to the earlier of the two dearest (an integral of step functions, exact);
- **steps to target**: the fewest mean steps at which ``acc(s)`` reaches the strongest heuristic's best accuracy
  minus ``tolerance`` (1 point), None where it never does.

Intervals: a paired bootstrap over items. Each resample draws item ids with replacement once and recomputes every
point of every curve on it (accuracy and mean steps), so both sides of a comparison see the same items; the interval
is the 5th to 95th percentile (90%). A resample where a curve never reaches the target counts as infinite steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

__all__ = ["HEURISTICS", "Curve", "format_matched", "gap_at_matched_steps", "matched_from_records", "matched_table",
           "recompute_matched", "steps_to_accuracy", "verdict"]

# the rules that need no training: the families' schedule rules, Fast-dLLM's (both forms), Fast-dLLM++'s and those
# published since (CreditDecoding, dInfer's hierarchy, KLASS, LESS, the entropy bound, PC-Sampler)
HEURISTICS = ("confidence", "entropy", "maskgit_plus", "topk_margin", "random", "origin", "topk", "threshold",
              "factor", "frechet", "credit", "hierarchy", "klass", "less", "eb", "pc")


class Curve:
    """One policy's points on shared items: ``correct`` [P, N] 0/1 and ``steps`` [P, N] per point and item."""

    def __init__(self, name: str, correct, steps, labels=None):
        self.name = name
        self.correct = np.asarray(correct, dtype=np.float64)
        self.steps = np.asarray(steps, dtype=np.float64)
        if self.correct.ndim != 2 or self.correct.shape != self.steps.shape or self.correct.shape[0] == 0:
            raise ValueError(f"curve {name!r}: correct and steps must both be [points, items] with >= 1 point; "
                             f"got {self.correct.shape} and {self.steps.shape}")
        self.labels = list(labels) if labels is not None else [str(i) for i in range(self.correct.shape[0])]

    @property
    def n_items(self) -> int:
        return self.correct.shape[1]

    def points(self, weights=None) -> tuple[np.ndarray, np.ndarray]:
        """(mean steps [P], accuracy [P]) on the items, each item counted ``weights`` times (a resample)."""
        if weights is None:
            return self.steps.mean(1), self.correct.mean(1)
        total = weights.sum()
        return self.steps @ weights / total, self.correct @ weights / total


def _best_at_or_below(steps: np.ndarray, acc: np.ndarray, s: np.ndarray) -> np.ndarray:
    """acc(s) of the step-function reading; nan below the cheapest point."""
    order = np.argsort(steps, kind="stable")
    xs, best = steps[order], np.maximum.accumulate(acc[order])
    i = np.searchsorted(xs, s, side="right") - 1
    return np.where(i >= 0, best[np.clip(i, 0, None)], np.nan)


def _envelope(curves: list, s: np.ndarray, weights=None) -> np.ndarray:
    """max over ``curves`` of acc(s), nan where none is defined."""
    values = np.stack([_best_at_or_below(*c.points(weights), s) for c in curves])
    return np.where(np.isnan(values).all(0), np.nan, np.nanmax(np.where(np.isnan(values), -np.inf, values), 0))


def gap_at_matched_steps(policy: Curve, heuristics: list, weights=None) -> float | None:
    """Mean of acc(s) - H(s) over the step range both cover; None when the ranges do not overlap."""
    p_steps, _ = policy.points(weights)
    h_steps = np.concatenate([c.points(weights)[0] for c in heuristics])
    lo, hi = max(p_steps.min(), h_steps.min()), min(p_steps.max(), h_steps.max())
    if hi < lo:
        return None
    if hi == lo:  # one shared budget: the difference there
        s = np.array([lo])
        return float((_best_at_or_below(*policy.points(weights), s) - _envelope(heuristics, s, weights))[0])
    # both are constant between consecutive breakpoints: evaluate each piece at its left end
    cuts = np.unique(np.concatenate([p_steps, h_steps, [lo, hi]]))
    cuts = cuts[(cuts >= lo) & (cuts <= hi)]
    left, width = cuts[:-1], np.diff(cuts)
    diff = _best_at_or_below(*policy.points(weights), left) - _envelope(heuristics, left, weights)
    return float((diff * width).sum() / (hi - lo))


def steps_to_accuracy(curve: Curve, target: float, weights=None) -> float:
    """The fewest mean steps among the curve's points that reach ``target``; inf when none does."""
    steps, acc = curve.points(weights)
    hit = acc >= target - 1e-12
    return float(steps[hit].min()) if hit.any() else math.inf


def _interval(values: list) -> tuple:
    """The 5th and 95th percentiles of the defined values (nearest rank, so an infinite "never reached" stays
    infinite rather than turning nan); an infinite bound is None."""
    defined = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if defined.size == 0:
        return None, None
    return tuple(None if math.isinf(b) else float(b) for b in np.percentile(defined, [5, 95], method="nearest"))


def verdict(policy: Curve, heuristics: list, *, tolerance: float = 0.01, resamples: int = 1000, seed: int = 0) -> dict:
    """The policy against the strongest heuristic: gap at matched steps and steps to the heuristics' best accuracy
    minus ``tolerance``, each with its 90% paired bootstrap interval (``resamples`` draws of the items)."""
    n = policy.n_items
    if any(c.n_items != n for c in heuristics):
        raise ValueError("every curve must be measured on the same items (pair the records by item id first)")
    if not heuristics:
        raise ValueError("no heuristic curve to compare with")

    def measure(weights=None):
        target = max(c.points(weights)[1].max() for c in heuristics) - tolerance
        return (gap_at_matched_steps(policy, heuristics, weights), steps_to_accuracy(policy, target, weights),
                min(steps_to_accuracy(c, target, weights) for c in heuristics))

    gap, steps, h_steps = measure()
    rng = np.random.default_rng(seed)
    draws = [measure(rng.multinomial(n, np.full(n, 1 / n)).astype(np.float64)) for _ in range(resamples)]
    gaps = [d[0] for d in draws]
    return dict(gap=gap, gap_interval=_interval(gaps),
                gap_above_zero=sum(g is not None and g > 0 for g in gaps) / resamples,
                target=max(c.points()[1].max() for c in heuristics) - tolerance,
                steps_to_target=None if math.isinf(steps) else steps,
                steps_to_target_interval=_interval([d[1] for d in draws]),
                heuristic_steps_to_target=None if math.isinf(h_steps) else h_steps,
                reached_share=sum(not math.isinf(d[1]) for d in draws) / resamples, n=n)


def matched_table(curves: dict, heuristic: set, *, tolerance: float = 0.01, resamples: int = 1000,
                  seed: int = 0) -> dict:
    """`verdict` of every curve of ``curves`` (name -> `Curve`) not named in ``heuristic``, against all that are."""
    base = [c for name, c in curves.items() if name in heuristic]
    return {name: verdict(c, base, tolerance=tolerance, resamples=resamples, seed=seed)
            for name, c in curves.items() if name not in heuristic}


def matched_from_records(records: dict, curves: dict, *, tolerance: float = 0.01, resamples: int = 1000) -> dict:
    """`matched_table` of one setting: every learned curve against the strongest heuristic,
    from the points' per-item ``records`` (`tracelock.eval.frontier.setting_records`) and the curves' point labels."""
    built, heuristic = {}, set()
    for name, points in curves.items():
        labels = [p["label"] for p in points if p["label"] in records["points"]]
        if labels:
            built[name] = Curve(name, [[c == "1" for c in records["points"][lb]["correct"]] for lb in labels],
                                [records["points"][lb]["steps"] for lb in labels], labels)
            if labels[0].split(":")[0] in HEURISTICS:  # a point's label starts with its policy's name
                heuristic.add(name)
    return matched_table(built, heuristic, tolerance=tolerance, resamples=resamples)


def _interval_cell(value, interval, scale=1.0, digits=1, sign=False) -> str:
    if value is None:
        return "n/a"
    fmt = f"{{:{'+' if sign else ''}.{digits}f}}"
    lo, hi = (fmt.format(b * scale) if b is not None else "never" for b in interval)
    return f"{fmt.format(value * scale)} [{lo}, {hi}]"


def format_matched(result: dict) -> str:
    """The verdict table: every learned curve against the strongest heuristic, gap at matched steps (points) and
    steps to the heuristics' best accuracy minus the tolerance, each with its 90% paired bootstrap interval."""
    lines = ["accuracy gap at matched steps against the strongest heuristic (points, 90% paired bootstrap interval); "
             "steps to the heuristics' best accuracy minus "
             f"{100 * result['tolerance']:g} point, the policy's and (last column) the heuristics' own",
             "", "| task | setting | curve | gap at matched steps | P(gap > 0) | target | steps to target | "
                 "heuristics |", "|---|---|---|---|---|---|---|---|"]
    for task, settings in result["tasks"].items():
        for setting, d in settings.items():
            for curve, v in d.get("matched", {}).items():
                heur = "not reached" if v["heuristic_steps_to_target"] is None else \
                    f"{v['heuristic_steps_to_target']:.1f}"
                steps = ("not reached" if v["steps_to_target"] is None else
                         _interval_cell(v["steps_to_target"], v["steps_to_target_interval"]))
                lines.append(f"| {task} | {setting} | {curve} | "
                             f"{_interval_cell(v['gap'], v['gap_interval'], 100, sign=True)} | "
                             f"{v['gap_above_zero']:.2f} | {100 * v['target']:.1f}% | {steps} | {heur} |")
    return "\n".join(lines)


def recompute_matched(folder, *, resamples: int = 1000) -> dict:
    """frontier.json of ``folder`` with its verdict recomputed from the records beside it (records.json)."""
    folder = Path(folder)
    result = json.loads((folder / "frontier.json").read_text())
    records = json.loads((folder / "records.json").read_text())
    for task, settings in result["tasks"].items():
        for setting, d in settings.items():
            d["matched"] = matched_from_records(records[task][setting], d["curves"], tolerance=result["tolerance"],
                                                resamples=resamples)
    return result


def main(argv=None) -> int:
    """``python -m tracelock.eval.matched FOLDER [FOLDER ...]``: the verdict table of each frontier folder
    (frontier.json and records.json), recomputed from its per-item records."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tracelock.eval.matched", description=main.__doc__)
    p.add_argument("folders", nargs="+", metavar="FOLDER",
                   help="a `tracelock frontier --out` folder, or one with its frontier.json and records.json")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (default: 1000)")
    args = p.parse_args(argv)
    for i, folder in enumerate(args.folders):
        result = recompute_matched(folder, resamples=args.resamples)
        if i:
            print()
        print(f"## {result['model']} ({folder})\n")
        print(format_matched(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
