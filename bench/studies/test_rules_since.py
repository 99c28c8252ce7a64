"""bench/studies/rules_since.py (the rules since Fast-dLLM against the existing training-free rules, validation) on
constructed records, and on the committed ones: `read` gives the committed summary and docs/frontier.md's tables."""

import json

import numpy as np
import rules_since as rs  # bench/studies/ is on sys.path (its conftest.py)


def _cell(folder, leads: float, lags: float):
    """A cell of 400 items: the threshold (50% in 10 steps, 70% in 20), credit ``leads`` points above it at the same
    steps, eb ``lags`` points below it."""
    rng = np.random.default_rng(0)
    ids = [f"math:validation:{i}" for i in range(400)]

    def point(acc, steps):
        return dict(correct="".join("1" if x else "0" for x in rng.random(400) < acc), steps=[steps] * 400)

    specs = {"credit": ["credit:tau=0.5", "credit:tau=0.9"], "eb": ["eb:gamma=1.0", "eb:gamma=0.01"],
             "threshold": ["threshold:tau=0.5", "threshold:tau=0.9"]}
    points = {"credit/credit-tau-0.5": point(0.5 + leads, 10), "credit/credit-tau-0.9": point(0.7 + leads, 20),
              "eb/eb-gamma-1.0": point(0.5 - lags, 10), "eb/eb-gamma-0.01": point(0.7 - lags, 20),
              "threshold/threshold-tau-0.5": point(0.5, 10), "threshold/threshold-tau-0.9": point(0.7, 20)}
    folder.mkdir(exist_ok=True)
    (folder / "llada-math-64-16.json").write_text(json.dumps(dict(
        model="testbed", task="testbed:math@validation", setting="64/16", n=400, seed=rs.SEED, specs=specs, ids=ids,
        points=points)))
    return folder


def test_a_clear_lead_leads_and_a_clear_lag_loses(tmp_path):
    result = rs.read(_cell(tmp_path / "cells", 0.2, 0.2), resamples=200)
    cell = result["cells"]["llada math 64/16"]
    assert cell["common_range"] == [10.0, 20.0]
    assert cell["leader"]["curve"] == "credit" and cell["leader"]["runner_up"] == "threshold"
    assert cell["leader"]["verdict"] == "leads" and cell["best_existing"] == "threshold"
    assert cell["new"]["credit"]["vs_existing"]["verdict"] == "win"
    assert cell["new"]["eb"]["vs_existing"]["verdict"] == "loss"
    # a pair read both ways is the same gap with its sign turned
    assert cell["new"]["credit"]["vs_new"]["eb"]["gap"] == -cell["new"]["eb"]["vs_new"]["credit"]["gap"] > 0.3
    assert cell["new"]["credit"]["vs_new"]["eb"]["verdict"] == "win"


def test_a_level_rule_ties(tmp_path):
    """Credit decodes as the threshold does, item for item: the leader's margin over the runner-up is zero."""
    path = _cell(tmp_path / "cells", 0.0, 0.2) / "llada-math-64-16.json"
    rec = json.loads(path.read_text())
    for tau in ("0.5", "0.9"):
        rec["points"][f"credit/credit-tau-{tau}"] = rec["points"][f"threshold/threshold-tau-{tau}"]
    path.write_text(json.dumps(rec))
    cell = rs.read(path.parent, resamples=200)["cells"]["llada math 64/16"]
    assert {cell["leader"]["curve"], cell["leader"]["runner_up"]} == {"credit", "threshold"}
    assert cell["leader"]["margin"] == 0 and cell["leader"]["verdict"] == "tie"
    assert cell["new"]["credit"]["vs_existing"] == dict(gap=0.0, interval=[0.0, 0.0], verdict="tie")
    assert cell["new"]["eb"]["vs_existing"]["verdict"] == "loss"


def test_a_curve_ending_below_the_others_start_is_read_at_its_best():
    from tracelock.eval.matched import Curve

    curves = {"a": Curve("a", [[1, 0], [1, 1]], [[4, 4], [8, 8]]), "b": Curve("b", [[0, 0], [1, 1]], [[10, 10],
                                                                                                       [30, 30]]),
              "c": Curve("c", [[0, 1], [1, 1]], [[12, 12], [20, 20]])}
    assert rs.common_range(curves) == (12.0, 20.0)
    assert rs.mean_accuracy(curves["a"], 12.0, 20.0) == 1.0  # its best point, 8 steps
    assert rs.mean_accuracy(curves["c"], 12.0, 20.0) == 0.5  # 50% from 12 steps on; 100% only at 20
    # c starts where a has ended: no range in common at matched steps; past a's end, c is 0.5 below a's best
    assert rs.gap_at_matched_steps(curves["c"], [curves["a"]]) is None
    assert rs.gap_past_the_end(curves["c"], [curves["a"]]) == -0.5
    assert rs.gap_past_the_end(curves["a"], [curves["c"]]) is None  # c has no point at or below 4 steps


def test_every_cells_specs_build():
    from tracelock.eval.runner import check_policies, parse_policies, parse_settings

    for family in rs.FAMILIES:
        for setting in ("64/16", "64/32", "128/32", "128/64"):
            specs = rs.specs(family, int(setting.split("/")[0]))
            assert {rs.kind_of(c) for c in specs} == {"new", "existing"}
            policies = [p for c in specs.values() for p in parse_policies(",".join(c))]
            assert len({p.slug for p in policies}) == sum(map(len, specs.values()))
            check_policies(policies, parse_settings(setting), "auto")


def test_the_committed_summary_is_recomputed_from_the_records():
    """`python bench/studies/rules_since.py read` on the committed records writes the committed summary, and
    docs/frontier.md's section holds its tables."""
    committed = json.loads((rs.RESULTS / "summary.json").read_text())
    got = rs.read(rs.RESULTS, resamples=committed["resamples"])
    assert json.loads(json.dumps(got)) == committed
    docs = (rs.ROOT / "docs" / "frontier.md").read_text()
    for line in rs.format_docs(committed).splitlines():
        assert line in docs, line


def test_a_grown_grid_decodes_only_its_new_points_and_keeps_the_committed_ones(tmp_path):
    path = _cell(tmp_path / "cells", 0.1, 0.1) / "llada-math-64-16.json"
    before = json.loads(path.read_text())
    ids, committed = rs._committed(path, 400)
    assert ids == before["ids"] and committed == before["points"]
    grown = dict(before["specs"], **{"credit-hold-end": ["credit:tau=0.5:hold_end=true"]})
    # the fresh point holds the same items in another order, plus one the committed points lack
    fresh_ids = list(reversed(before["ids"])) + ["math:validation:400"]
    fresh = dict(ids=fresh_ids, points={"credit-hold-end/credit-tau-0.5-hold-end-true": dict(
        correct="1" * 400 + "0", steps=list(range(401)))})
    rec = rs._merge(ids, committed, fresh, grown)
    assert rec["ids"] == before["ids"]
    assert list(rec["points"])[-1] == "credit-hold-end/credit-tau-0.5-hold-end-true"
    assert rec["points"]["credit-hold-end/credit-tau-0.5-hold-end-true"]["steps"] == list(range(399, -1, -1))
    assert {k: v for k, v in rec["points"].items() if k in before["points"]} == before["points"]
    # a fresh point that misses a committed item is another draw: refused
    fresh["ids"] = fresh_ids[1:]
    fresh["points"]["credit-hold-end/credit-tau-0.5-hold-end-true"] = dict(correct="1" * 400, steps=[0] * 400)
    import pytest

    with pytest.raises(SystemExit, match="different draw"):
        rs._merge(ids, committed, fresh, grown)
    with pytest.raises(SystemExit, match="--n 400"):
        rs._committed(path, 100)
