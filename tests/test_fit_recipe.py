"""`tracelock fit`: the whole recipe on the bundled model at a tiny size: its stages and what each leaves, on-policy
rounds decoded by the gate, the choice on validation and the deployed gate; a rerun redoes nothing; bad input.
(Killed anywhere and resumed: tests/test_faults.py.)"""

import json
import re

import pytest

import tracelock
from tracelock.cli import main
from tracelock.policies import make_policy
from tracelock.policies.frechet import FrechetPolicy
from tracelock.recipe import base_rule, choose_gate

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--model", "testbed", "--prompts", "testbed:math", "--limit", "6", "--round-limit", "3", "--val-limit", "3",
        "--steps", "4", "--round-steps", "2", "--rounds", "1", "--base", "frechet:delta=0,0.9:hold_end=true",
        "--accept", "1,0.9", "--veto", "0,0.5", "--batch-size", "6", "--gen-length", "16", "--block", "8"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fit") / "run"
    assert main(["fit", *TINY, "--out", str(out)]) in (0, None)
    return out


def test_every_stage_leaves_its_folder_and_the_record_names_the_choice(run):
    record = json.loads((run / "fit.json").read_text())
    assert list(record["stages"]) == ["collect", "features", "round-0", "round-1", "validation"]
    assert set(record["choice"]) == {"round", "accept", "veto", "gap", "gaps", "intervals"}
    assert set(record["choice"]["gaps"]) == {f"{k}/{a}/{v}" for k in (0, 1) for a in (1.0, 0.9) for v in (0.0, 0.5)}
    for path in ("pool/traces/index.json", "pool/encoder/encoder.json", "pool/cache", "round-0/metrics.json",
                 "round-1/metrics.json", "onpolicy", "controller/best.safetensors", "controller/gate.json"):
        assert (run / path).exists(), path


def test_the_record_holds_each_stages_size_and_the_estimate_reads_decode_and_training_rates_apart(run, tmp_path):
    from tracelock.recipe import FitConfig, _Stages

    stages = json.loads((run / "fit.json").read_text())["stages"]
    # TINY: 6 pool items, 4 supervised steps, a round of 3 items and 2 steps, 3 validation items per decode
    assert (stages["collect"]["items"], stages["round-0"]["steps"]) == (6, 4)
    assert (stages["round-1"]["items"], stages["round-1"]["steps"]) == (3, 2)
    said = []
    est = _Stages(FitConfig(model="testbed", out=str(tmp_path)), said.append, rank=0)
    est.plan = {"collect": (200, 0), "round-0": (0, 2000), "validation": (7600, 0)}
    est.run("collect", "decode", lambda: None)
    assert said[-1] == "collect: decode"  # nothing measured yet: no estimate
    est.record["stages"]["collect"]["seconds"] = 30.0  # 0.15 s per item
    est.run("round-0", "train", lambda: None)
    assert said[-1] == "round-0: train"  # the training rate is not known yet
    est.record["stages"]["round-0"]["seconds"] = 400.0  # 0.2 s per step
    est.run("validation", "decode", lambda: None)
    assert said[-1] == "validation: decode (about 19 min left)"  # 7600 items at 0.15 s, not at the training's rate


def test_the_base_is_traced_without_holes_on_validation(run):
    """Midpoints of the base's knob (delta 0 and 0.9 listed) until its points lie at most 1.5 mean steps apart, so
    that a gate is not judged against the base's accuracy at the low end of a hole."""
    from tracelock.eval.items import folder_items
    from tracelock.recipe import BASE_DENSE_ROUNDS, BASE_STEP_GAP

    runs = run / "validation" / "testbed-math-validation" / "runs" / "16-8"
    base = {float(re.search(r"delta-([0-9.]+)$", p.name)[1]): folder_items(p) for p in runs.glob("frechet-*")}
    steps = {v: sum(r["steps"] for r in recs.values()) / len(recs) for v, recs in base.items()}
    order = sorted(steps, key=steps.get)
    widest = max(steps[b] - steps[a] for a, b in zip(order, order[1:]))
    assert {0.0, 0.9} <= set(base) and len(base) > 2
    assert widest <= BASE_STEP_GAP or len(base) >= 2 ** BASE_DENSE_ROUNDS, steps


def test_the_rounds_decode_with_the_gate_of_the_round_before(run):
    from tracelock.traces.cache import FeatureCache
    from tracelock.traces.store import iter_traces

    traces = list(iter_traces(run / "round-1" / "traces"))
    assert traces and all(t.meta["policy"] == "gate" for t in traces)
    args = traces[0].meta["policy_args"]
    assert args["controller"] == str(run / "round-0") and args["base"] == "frechet" and args["veto"] == 0.5
    ids = [t["id"] for s in FeatureCache(run / "onpolicy").index["shards"] for t in s["traces"]]
    assert ids and all(i.startswith("round-1/") for i in ids)
    trained = json.loads((run / "round-1" / "state.json").read_text())["config"]
    assert trained["init"] == str(run / "round-0") and trained["mix_cache"] == str(run / "onpolicy")


def test_the_deployed_gate_is_the_choice_over_the_base_at_its_knobs_middle(run):
    choice = json.loads((run / "fit.json").read_text())["choice"]
    model = tracelock.load_model("testbed")
    gate = make_policy("gate", controller=str(run / "controller"), model=model)
    assert isinstance(gate.base, FrechetPolicy) and gate.base.delta == 0.9 and gate.base.hold_end
    assert (gate.accept, gate.veto) == (choice["accept"], choice["veto"])
    tokens, stats = tracelock.fused_generate(model, [[5, 9, 13]], policy=gate, gen_length=16, block=8)
    assert not (tokens == model.spec.mask_id).any() and stats.steps[0] >= 2


def _without_timings(obj):
    if isinstance(obj, dict):
        return {k: _without_timings(v) for k, v in obj.items() if not k.startswith("seconds")}
    return [_without_timings(v) for v in obj] if isinstance(obj, list) else obj


def _contents(folder):
    """Every file's bytes, a JSON file's as data without its timings."""
    return {p.relative_to(folder): _without_timings(json.loads(p.read_text())) if p.suffix == ".json"
            else p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_rerun_redoes_nothing(run):
    before = _contents(run)
    data = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.suffix in (".safetensors", ".npy", ".jsonl")}
    assert main(["fit", *TINY, "--out", str(run)]) in (0, None)
    assert _contents(run) == before
    # nothing decoded, featurized or trained again: the stores, caches, records and weights are the same files
    assert {p: p.stat().st_mtime_ns for p in data if "controller/" not in str(p)} == {
        p: t for p, t in data.items() if "controller/" not in str(p)}


def _records(correct, steps):
    return {f"i{j}": dict(correct=bool(c), steps=s) for j, (c, s) in enumerate(zip(correct, steps))}


def test_choose_gate_takes_the_candidate_furthest_above_the_base_and_else_no_correction():
    base = [(0.0, _records([1, 0, 0, 0], [10] * 4)), (0.9, _records([1, 1, 0, 0], [20] * 4))]
    above = [(0.0, _records([1, 1, 0, 0], [10] * 4)), (0.9, _records([1, 1, 1, 0], [20] * 4))]
    below = [(0.0, _records([0, 0, 0, 0], [10] * 4)), (0.9, _records([1, 0, 0, 0], [20] * 4))]
    outside = [(0.0, _records([1, 1, 1, 1], [40] * 4)), (0.9, _records([1, 1, 1, 1], [50] * 4))]
    got = choose_gate({"t": {"base": base, "0/1.0/0.0": base, "0/1.0/0.5": below, "1/0.9/0.0": above,
                        "1/1.0/0.5": outside}})
    assert (got["round"], got["accept"], got["veto"]) == (1, 0.9, 0.0) and got["gap"] == pytest.approx(0.25)
    assert got["gaps"]["1/1.0/0.5"] is None and got["gaps"]["0/1.0/0.0"] == 0.0
    low, high = got["intervals"]["t"]  # 4 items, one of them apart: a resample counts it 0 to 4 times
    assert 0.0 <= low <= 0.25 <= high <= 1.0
    got = choose_gate({"t": {"base": base, "0/1.0/0.5": below, "1/1.0/0.5": outside}})
    assert (got["round"], got["accept"], got["veto"], got["gap"]) == (0, 1.0, 0.0, 0.0)


def test_choose_gate_passes_over_a_gate_that_pins_the_knob_to_one_budget():
    base = [(0.0, _records([1, 0, 0, 0], [10] * 4)), (0.9, _records([1, 1, 0, 0], [20] * 4))]
    pinned = [(0.0, _records([1, 1, 1, 1], [14] * 4)), (0.9, _records([1, 1, 1, 1], [15] * 4))]  # 1 of 10 steps
    spans = [(0.0, _records([1, 1, 0, 0], [12] * 4)), (0.9, _records([1, 1, 0, 0], [18] * 4))]  # 6 of 10
    got = choose_gate({"t": {"base": base, "0/0.8/0.8": pinned, "1/0.9/0.5": spans}})
    assert got["gaps"]["0/0.8/0.8"] is None and (got["round"], got["accept"], got["veto"]) == (1, 0.9, 0.5)
    assert choose_gate({"t": {"base": base, "0/0.8/0.8": pinned}}, min_cover=0.05)["veto"] == 0.8


@pytest.mark.parametrize("args, match", [
    (["--base", "frechet:delta=0.5"], r"--base 'frechet:delta=0.5' must be one rule with its knob's values listed"),
    (["--prompts", "prompts.jsonl"], r"has no validation split: pass --tasks"),
    (["--accept", "1.5"], r"--accept '1.5': every value must lie in \[0.0, 1.0\]"),
    (["--alpha", "1"], r"--alpha 1.0 must lie in \(0, 1\)"),
    (["--veto", "0,1"], r"--veto 0.0,1.0 in \[0, 1\)"),
])
def test_bad_input_names_the_option(tmp_path, capsys, args, match):
    try:
        rc = main(["fit", "--model", "testbed", "--out", str(tmp_path / "o"), *args])
    except SystemExit as err:  # argparse's own checks
        rc = err.code
    assert rc == 2 and re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "o" / "pool").exists()  # refused before any stage ran


def test_base_rule_reads_the_listed_knob():
    assert base_rule("frechet:delta=0,0.5,0.9:hold_end=true") == ("frechet", {"hold_end": True}, "delta",
                                                                  [0, 0.5, 0.9])
    assert base_rule("credit:tau=0.8,0.9:first_token=true") == ("credit", {"first_token": True}, "tau", [0.8, 0.9])


def test_under_torchrun_each_rank_decodes_its_share_and_the_pool_is_one_processs(run, tmp_path):
    """Two ranks (gloo): the collections and validation split by rank, training DDP; the pool's traces are those of
    the one-process run (DDP's sums round differently, so the controllers and what they decode may differ)."""
    import os
    import subprocess
    import sys

    from faults import compare_store

    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tracelock", "fit", *TINY, "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert compare_store(run / "pool" / "traces", out / "pool" / "traces") == dict(records=6, lost=0, duplicated=0,
                                                                                   torn=0, differ=0)
    for store in ("pool/traces", "round-1/traces"):
        assert json.loads((out / store / "summary.json").read_text())["world_size"] == 2
        assert sorted(p.name for p in (out / store).glob("done-rank*.json")) == ["done-rank0.json", "done-rank1.json"]
    assert sorted(p.name for p in (out / "validation").rglob("items-rank*.jsonl"))[:2] == ["items-rank0.jsonl",
                                                                                           "items-rank0.jsonl"]
    assert any((out / "validation").rglob("items-rank1.jsonl")) and (out / "controller" / "gate.json").is_file()
