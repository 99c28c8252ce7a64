"""A knob traced without holes: the values a sweep still needs so that its consecutive points lie at most
``max_gap`` mean steps apart.

Accuracy at matched steps reads a curve as a step function of its points, so a stretch of steps between two points
counts as if the policy could not go there (the first hold-out's TraceLock curve jumped from 9.1 to 17.3 steps between
two knob values, where the rules it was judged against climb fastest). `tracelock frontier --max-step-gap G` decodes
the listed values, then a midpoint between every two neighbours (in order of mean steps) more than G apart, and again,
until none is left or a hole cannot be split: two whole-number values with no valid one between (``per_step``), or
two values equal at four significant digits.
"""

from __future__ import annotations

import math

SIGNIFICANT = 4  # digits of a new knob value: labels stay short, and a hole narrower than that is left as it is


def geometric(values) -> bool:
    """Whether a knob is split geometrically: every value positive and spanning a factor of 10 or more (the entropy
    budget 0.001-1, the factor rule's f 0.25-4), where an arithmetic midpoint would leave the low end bare."""
    values = [float(v) for v in values]
    return bool(values) and min(values) > 0 and max(values) >= 10 * min(values)


def midpoint(a, b, *, whole: bool, log: bool, valid=lambda v: True):
    """A value strictly between knob values ``a`` and ``b`` that ``valid`` takes, or None when there is none to try.
    A whole-number knob takes the valid whole number nearest the middle (a schedule rule's steps must divide into
    its blocks: ``per_step`` 3 of 16 tokens in two blocks is refused, 2 is not)."""
    lo, hi = sorted((a, b))
    if whole:
        middle = (lo + hi) / 2
        return next((v for v in sorted(range(lo + 1, hi), key=lambda v: (abs(v - middle), v)) if valid(v)), None)
    mid = math.sqrt(lo * hi) if log else (lo + hi) / 2
    mid = float(f"{mid:.{SIGNIFICANT}g}")
    return mid if lo < mid < hi and valid(mid) else None


def gaps(points: list) -> list:
    """[(steps gap, value, value)] between neighbours of ``points`` [(knob value, mean steps)] in order of steps."""
    ordered = sorted(points, key=lambda p: (p[1], p[0]))
    return [(s1 - s0, v0, v1) for (v0, s0), (v1, s1) in zip(ordered, ordered[1:])]


def largest_gap(points: list) -> float:
    """The widest stretch of mean steps between two consecutive points (0 for fewer than two)."""
    return max((g for g, _, _ in gaps(points)), default=0.0)


def values_to_add(points: list, max_gap: float, *, whole: bool, log: bool, valid=lambda v: True) -> list:
    """The knob values to decode next: a midpoint in every hole wider than ``max_gap``, none already among the
    points. An empty list: the curve has no hole left, or none that can be split."""
    known = {v for v, _ in points}
    new = []
    for gap, v0, v1 in gaps(points):
        if gap > max_gap:
            mid = midpoint(v0, v1, whole=whole, log=log, valid=valid)
            if mid is not None and mid not in known and mid not in new:
                new.append(mid)
    return new


def trace_densely(values, mean_steps, decode, max_gap: float, rounds: int, *, whole: bool, log: bool,
                  valid=lambda v: True) -> list:
    """``values`` and the midpoints added, ``rounds`` times at most, until no two points (``mean_steps(v)`` of the
    decoded value ``v``) lie more than ``max_gap`` mean steps apart; ``decode(new_values)`` decodes each round's."""
    values = list(values)
    for _ in range(rounds):
        new = values_to_add([(v, mean_steps(v)) for v in values], max_gap, whole=whole, log=log, valid=valid)
        if not new:
            break
        decode(new)
        values += new
    return values


def check_max_gap(max_gap) -> None:
    if max_gap is not None and (isinstance(max_gap, bool) or not isinstance(max_gap, int | float) or
                                not max_gap > 0):
        raise ValueError(f"--max-step-gap {max_gap!r} must be a number of mean steps > 0, e.g. 1.5")
