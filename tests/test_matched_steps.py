"""The matched-steps verdict on constructed records whose answer is known by hand."""

import numpy as np
import pytest

from tracelock.eval.matched import Curve, gap_at_matched_steps, matched_table, steps_to_accuracy, verdict

N = 200


def curve(name, points, n=N, shift=0):
    """A curve whose point i has accuracy acc_i (the first acc_i * n items correct, rotated by ``shift``) and every
    item at steps_i."""
    correct = [np.roll(np.arange(n) < round(acc * n), shift) for acc, _ in points]
    steps = [np.full(n, s) for _, s in points]
    return Curve(name, np.array(correct, dtype=float), np.array(steps, dtype=float))


def test_a_copy_of_the_heuristic_ties_exactly():
    h = curve("threshold", [(0.5, 10), (0.6, 20), (0.7, 30)])
    v = verdict(curve("tracelock", [(0.5, 10), (0.6, 20), (0.7, 30)]), [h], resamples=200)
    assert v["gap"] == 0 and v["gap_interval"] == (0, 0)
    assert v["steps_to_target"] == 30 == v["heuristic_steps_to_target"]


def test_ten_points_better_at_every_budget():
    h = curve("threshold", [(0.5, 10), (0.6, 20), (0.7, 30)])
    p = curve("tracelock", [(0.6, 10), (0.7, 20), (0.8, 30)])
    assert gap_at_matched_steps(p, [h]) == pytest.approx(0.1)
    v = verdict(p, [h], resamples=300)
    assert v["gap"] == pytest.approx(0.1)
    lo, hi = v["gap_interval"]
    assert 0 < lo < 0.1 < hi and v["gap_above_zero"] == 1.0
    # the heuristics' best is 0.7, target 0.69: the policy gets there at 20 steps, the heuristic at 30
    assert v["target"] == pytest.approx(0.69) and v["steps_to_target"] == 20 and v["heuristic_steps_to_target"] == 30


def test_the_strongest_heuristic_is_the_best_at_each_budget():
    # one heuristic is strong when cheap, the other when dear; the policy equals their envelope
    cheap = curve("confidence", [(0.6, 10), (0.6, 30)])
    dear = curve("threshold", [(0.4, 10), (0.8, 20)])
    p = curve("tracelock", [(0.6, 10), (0.8, 20), (0.8, 30)])
    assert gap_at_matched_steps(p, [cheap, dear]) == pytest.approx(0.0)
    # against the cheap rule alone the policy is equal over [10, 20) and 0.2 better over [20, 30]: mean 0.1
    assert gap_at_matched_steps(p, [cheap]) == pytest.approx(0.1)


def test_step_function_reading_and_unreached_targets():
    h = curve("threshold", [(0.8, 40)])
    p = curve("tracelock", [(0.5, 10), (0.3, 20), (0.6, 50)])
    # over [40, 50]: policy best-at-or-below is 0.5 on [40, 50), the heuristic 0.8
    assert gap_at_matched_steps(p, [h]) == pytest.approx(0.5 - 0.8)
    assert steps_to_accuracy(p, 0.79) == float("inf")
    v = verdict(p, [h], resamples=100)
    assert v["steps_to_target"] is None and v["reached_share"] == 0 and v["steps_to_target_interval"] == (None, None)
    assert v["gap_interval"][1] < 0


def test_disjoint_step_ranges_have_no_gap():
    h = curve("threshold", [(0.5, 10), (0.6, 20)])
    p = curve("tracelock", [(0.9, 30), (0.9, 40)])
    assert gap_at_matched_steps(p, [h]) is None


def test_bootstrap_is_paired():
    # the policy is right exactly where the heuristic is, plus 10 items: every resample sees a positive gap, which
    # unpaired resampling of two independent 50% curves would not guarantee
    h = curve("threshold", [(0.5, 10), (0.5, 20)])
    p = curve("tracelock", [(0.55, 10), (0.55, 20)])
    v = verdict(p, [h], resamples=500)
    assert v["gap_interval"][0] > 0 and v["gap_above_zero"] == 1.0


def test_a_difference_within_noise_straddles_zero():
    h = curve("threshold", [(0.5, 10), (0.5, 20)])
    # the same accuracy on a disjoint half of the items: about as often better as worse in a resample
    p = curve("tracelock", [(0.5, 10), (0.5, 20)], shift=N // 2)
    lo, hi = verdict(p, [h], resamples=500)["gap_interval"]
    assert lo < 0 < hi


def test_table_compares_every_learned_curve_with_the_heuristics():
    curves = {"threshold": curve("threshold", [(0.5, 10)]), "confidence": curve("confidence", [(0.4, 10)]),
              "tracelock:theta": curve("tracelock", [(0.6, 10)]), "l2p": curve("l2p", [(0.5, 10)])}
    table = matched_table(curves, {"threshold", "confidence"}, resamples=50)
    assert set(table) == {"tracelock:theta", "l2p"}
    assert table["tracelock:theta"]["gap"] == pytest.approx(0.1) and table["l2p"]["gap"] == pytest.approx(0.0)


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="same items"):
        verdict(curve("p", [(0.5, 10)], n=10), [curve("h", [(0.5, 10)], n=20)])
    with pytest.raises(ValueError, match=r"\[points, items\]"):
        Curve("p", [1, 0], [3, 3])
