"""bench/studies/holdout_freeze.py (the second hold-out's grid from validation records) and
bench/studies/gate_validation.py's reading, on constructed records."""

import json

import holdout  # bench/studies/ is on sys.path (its conftest.py)
import holdout_freeze as hf
import numpy as np


def test_prune_keeps_what_a_step_function_can_read_at_the_gates_budgets_near_the_envelope():
    points = [("a", 4.0, 0.50), ("b", 6.0, 0.30), ("c", 8.0, 0.40), ("d", 10.0, 0.55), ("e", 20.0, 0.7),
              ("f", 22.9, 0.71), ("g", 23.1, 0.72), ("h", 40.0, 0.8)]
    # the gate spans 9-20 steps: everything in it, up to 1.15 x 20 = 23 above it, and below 9 the dearest (c) and
    # the most accurate (a) point
    flat = lambda s: 0.0  # noqa: E731 (no envelope: nothing is below it)
    assert sorted(hf.prune(points, 9.0, 20.0, flat, 0.1)) == ["a", "c", "d", "e", "f"]
    # a curve that only runs dearer keeps its cheapest point: every rule is in the envelope
    assert hf.prune([("x", 30.0, 0.9), ("y", 26.0, 0.8)], 9.0, 20.0, flat, 0.1) == ["y"]
    # against an envelope at 0.7 from 5 steps on: e and f lie within 0.1 of it, and a below where it starts
    high = lambda s: 0.7 if s >= 5 else 0.0  # noqa: E731
    assert sorted(hf.prune(points, 9.0, 20.0, high, 0.1)) == ["a", "e", "f"]
    # a curve far below everywhere keeps its nearest point, so every rule stays in the envelope
    assert hf.prune([("p", 10.0, 0.1), ("q", 12.0, 0.3)], 9.0, 20.0, high, 0.1) == ["q"]


def test_a_protocol_may_name_its_points_per_task():
    per_task = {"families": {"llada": {"points": {"math": {"64": ["eb:gamma=0.1"]}, "code": {"64": ["eb:gamma=1"]}}}}}
    assert holdout.cell_specs(per_task, "llada", "64/32", "code") == ["eb:gamma=1"]
    per_cell = {"families": {"llada": {"points": {"code": {"64/16": ["eb:gamma=1"], "64/32": ["eb:gamma=2"]}}}}}
    assert holdout.cell_specs(per_cell, "llada", "64/32", "code") == ["eb:gamma=2"]
    shared = {"families": {"llada": {"points": {"64": ["threshold:tau=0.9"]}}}}
    assert holdout.cell_specs(shared, "llada", "64/16", "math") == ["threshold:tau=0.9"]


def _records(path, setting, points, ids):
    path.write_text(json.dumps(dict(setting=setting, ids=ids, specs={}, points={
        label: dict(correct="".join("1" if c else "0" for c in correct), steps=steps)
        for label, (correct, steps) in points.items()})))


def test_gate_validation_reads_each_gate_against_every_training_free_curve(tmp_path):
    """A gate 10 points above the best rule at every budget wins its cell; the rules' and the gate's records of a
    cell are joined on the same items."""
    import gate_validation as gv

    rng = np.random.default_rng(0)
    ids = [f"math:validation:{i}" for i in range(300)]

    def point(acc, steps):
        return (list(rng.random(300) < acc), [steps] * 300)

    rules, gates = tmp_path / "rules", tmp_path / "gates"
    rules.mkdir(), gates.mkdir()
    _records(rules / "llada-math-64-16.json", "64/16", {
        "threshold/threshold-tau-0.5": point(0.5, 10), "threshold/threshold-tau-0.9": point(0.6, 20),
        "eb-hold-end/eb-gamma-0.1-hold-end-true": point(0.55, 15)}, ids)
    _records(gates / "llada-math-64-16.json", "64/16", {
        "gate/gate-controller-testbed-llada-math-base-gamma-1.0": point(0.6, 10),
        "gate/gate-controller-testbed-llada-math-base-gamma-0.1": point(0.7, 20),
        "factor/factor-f-1.0": point(0.4, 12)}, ids)
    cells = gv.cells_of(gates, rules)
    assert set(cells[("llada", "math", "64/16")]["points"]) == {
        "64-16/threshold-tau-0.5", "64-16/threshold-tau-0.9", "64-16/eb-gamma-0.1-hold-end-true",
        "64-16/gate-controller-testbed-llada-math-base-gamma-1.0",
        "64-16/gate-controller-testbed-llada-math-base-gamma-0.1", "64-16/factor-f-1.0"}
    import verdict_envelope as ve

    result = ve.analyse_cells(cells, resamples=200, learned="gate", comparisons=("strongest",))
    row = result["comparisons"]["strongest"]["cells"]["llada math 64/16"]
    assert sorted(row["members"]) == ["eb-hold-end-true", "factor", "threshold"]
    assert row["verdict"] == "win" and 0.05 < row["gap"] < 0.15


RULES = ("confidence", "threshold", "factor", "frechet", "credit", "hierarchy", "klass", "less", "eb", "pc")


def test_the_second_frozen_protocol_is_rebuilt_from_the_validation_records_and_holds_every_rule():
    """bench/results/holdout2/protocol.json is what holdout_freeze.py builds from the committed validation records at
    its seed and margin; in every cell it holds one gate curve and every training-free curve of the validation cell
    (each rule of the package's envelope, plain and held), and the runner accepts its specs."""
    import verdict_envelope as ve

    from tracelock.eval.runner import check_policies, parse_policies, parse_settings

    committed = json.loads((hf.ROOT / "bench" / "results" / "holdout2" / "protocol.json").read_text())
    assert committed == json.loads(json.dumps(hf.protocol(committed["seed"], committed["margin"])))
    for family in ("llada", "dream"):
        for task in hf.TASKS:
            for setting in hf.SETTINGS:
                specs = [p for s in holdout.cell_specs(committed, family, setting, task) for p in parse_policies(s)]
                check_policies(specs, parse_settings(setting), "auto")
                curves = {ve.curve_of(f"x/{p.slug}") for p in specs}
                assert sum(ve.kind_of(c) == "gate" for c in curves) == 1, (family, task, setting)
                validation = hf.cell_points(family, task, setting)
                rules = [c for c in validation if c != "gate"]
                # each rule plain and held (on Dream also Fast-dLLM's Dream form of threshold and frechet)
                assert {c.removesuffix("-hold-end") for c in rules} >= set(RULES)
                assert {c for c in rules if not c.endswith("-hold-end")} == {
                    c.removesuffix("-hold-end") for c in rules}
                named = set(holdout.cell_specs(committed, family, setting, task))
                missing = [c for c in rules if not any(spec in named for spec, _, _ in validation[c])]
                assert not missing, (family, task, setting, missing)
