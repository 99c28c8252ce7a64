"""`tracelock frontier`: a sweep end to end on a micro testbed model, resume after a kill, interpolation, bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tracelock.eval.frontier import pareto, parse_sweep, run_frontier, steps_at_accuracy, value_at_steps
from tracelock.eval.runner import Setting
from tracelock.testbed.train import BackboneTrainConfig, train_backbone


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier") / "model"
    train_backbone(BackboneTrainConfig(out=str(out), steps=4, batch_size=4, d_model=32, n_layers=4, n_heads=2, mlp=64,
                                       vocab_size=400, tokenizer_corpus=300, save_every=4), progress=False)
    return out


SWEEPS = ["threshold:tau=0.5,0.9", "confidence:per_step=2,4"]
ARGS = dict(tasks=["testbed:math"], settings=[Setting(16, 8)], limit=3, batch_size=3)


def test_a_sweep_end_to_end(micro, tmp_path):
    result = run_frontier(micro, sweeps=[parse_sweep(s) for s in SWEEPS], out=tmp_path, **ARGS)
    d = result["tasks"]["testbed:math"]["16/8"]
    assert d["reference"]["policy"] == "confidence:per_step=1" and result["family"] == "llada"
    assert set(d["curves"]) == {"confidence", "threshold"}
    assert [p["value"] for p in d["curves"]["confidence"]] == [1, 2, 4]
    # per_step k is k tokens per step: 16 positions in 16 / 8 / 4 steps
    assert [p["avg_steps"] for p in d["curves"]["confidence"]] == [16, 8, 4]
    assert d["target"] == pytest.approx(d["reference"]["metric"] - 0.01)
    assert all(p["seconds_per_item"] > 0 and p["n"] == 3 and isinstance(p["pareto"], bool)
               for c in d["curves"].values() for p in c)
    assert d["steps_at_reference"]["confidence"] == 16 or d["steps_at_reference"]["confidence"] < 16
    assert d["seconds_per_item_at_reference"]["confidence"] > 0  # the confidence curve reaches it at the latest at 16
    assert d["reached_at_cheapest_point"]["confidence"] == (d["steps_at_reference"]["confidence"] == 4)
    for name in ("frontier.json", "frontier.csv", "frontier.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "frontier.json").read_text()) == result
    assert result["machine"]["torch_threads"] >= 1 and result["machine"]["cpus"] >= 1
    rows = (tmp_path / "frontier.csv").read_text().splitlines()
    assert len(rows) == 1 + 5 and rows[0].startswith("task,setting,curve,label")
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    # per-item records beside it: the ids once, a 0/1 string and the steps of every point, paired by id
    records = json.loads((tmp_path / "records.json").read_text())["testbed:math"]["16/8"]
    assert len(records["ids"]) == 3 and len(records["points"]) == 5
    assert all(len(r["correct"]) == 3 and set(r["correct"]) <= set("01") and len(r["steps"]) == 3
               for r in records["points"].values())
    assert records["points"]["confidence:per_step=4"]["steps"] == [4, 4, 4]
    assert d["matched"] == {}  # heuristics only: nothing to judge


def test_resume_after_a_kill_gives_the_uninterrupted_result(micro, tmp_path):
    def command(out):
        return [sys.executable, "-m", "tracelock", "frontier", "--model", str(micro), "--tasks", "testbed:math",
                "--settings", "16/8", "--limit", "3", "--batch-size", "3", "--out", str(out),
                *[a for s in SWEEPS for a in ("--sweep", s)]]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    whole = tmp_path / "whole"
    subprocess.run(command(whole), check=True, env=env, capture_output=True)
    cut = tmp_path / "cut"
    proc = subprocess.Popen(command(cut), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # killed once the first two points are on disk, in the middle of the sweep
    deadline = time.monotonic() + 120
    while len(list(cut.glob("**/items-rank0.jsonl"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "frontier.json").exists()
    subprocess.run(command(cut), check=True, env=env, capture_output=True)

    def without_seconds(folder):
        result = json.loads((folder / "frontier.json").read_text())
        d = result["tasks"]["testbed:math"]["16/8"]
        for c in d["curves"].values():
            for p in c:
                p.pop("seconds_per_item")
        d.pop("seconds_per_item_at_reference")  # timings differ between runs; everything else must not
        for key in ("model", "command"):
            result.pop(key)
        return result

    assert without_seconds(cut) == without_seconds(whole)


def test_one_setting_per_call_adds_up_to_one_frontier(micro, tmp_path):
    """A long sweep split into calls (one setting each, same draw) leaves one frontier.json with every cell; a call
    judged otherwise (another tolerance; another draw of items is refused by the run folders) starts over."""
    sweeps = [parse_sweep("confidence:per_step=2")]
    args = dict(ARGS, settings=[Setting(16, 8)])
    first = run_frontier(micro, sweeps=sweeps, out=tmp_path, **args)["tasks"]["testbed:math"]["16/8"]
    both = run_frontier(micro, sweeps=sweeps, out=tmp_path, **dict(args, settings=[Setting(16, 4)]))
    assert set(both["tasks"]["testbed:math"]) == {"16/8", "16/4"} and both["seed"] == 0
    assert both["tasks"]["testbed:math"]["16/8"] == first
    assert set(json.loads((tmp_path / "records.json").read_text())["testbed:math"]) == {"16/8", "16/4"}
    assert json.loads((tmp_path / "frontier.json").read_text()) == both
    other = run_frontier(micro, sweeps=sweeps, out=tmp_path, tolerance=0.02, **args)
    assert set(other["tasks"]["testbed:math"]) == {"16/8"}
    assert set(json.loads((tmp_path / "records.json").read_text())["testbed:math"]) == {"16/8"}


def test_every_cell_names_the_machine_that_decoded_it(micro, tmp_path):
    """Cells added up from calls on two machines (the CPU's cells, then a GPU's) each keep their own machine; a file
    written before cells had one gives its cells the file's machine."""
    sweeps = [parse_sweep("confidence:per_step=2")]
    args = dict(ARGS, settings=[Setting(16, 8)])
    run_frontier(micro, sweeps=sweeps, out=tmp_path, **args)
    path = tmp_path / "frontier.json"
    old = json.loads(path.read_text())
    assert old["tasks"]["testbed:math"]["16/8"]["machine"] == old["machine"]
    del old["tasks"]["testbed:math"]["16/8"]["machine"]  # the older format, from another machine
    old["machine"] = dict(old["machine"], processor="another CPU")
    path.write_text(json.dumps(old))
    both = run_frontier(micro, sweeps=sweeps, out=tmp_path, **dict(args, settings=[Setting(16, 4)]))
    assert both["tasks"]["testbed:math"]["16/8"]["machine"]["processor"] == "another CPU"
    assert both["tasks"]["testbed:math"]["16/4"]["machine"] == both["machine"] != old["machine"]


def test_the_verdict_is_recomputed_from_the_records_alone(micro, tmp_path):
    """A learned curve (here Learn2PD's rule stood in by a titled copy of the threshold's records) is judged against
    the heuristics from records.json, as `python -m tracelock.eval.matched` does."""
    from tracelock.eval.matched import format_matched, recompute_matched

    run_frontier(micro, sweeps=[parse_sweep(s) for s in SWEEPS], out=tmp_path, **ARGS)
    frontier, records = (json.loads((tmp_path / f).read_text()) for f in ("frontier.json", "records.json"))
    d, r = frontier["tasks"]["testbed:math"]["16/8"], records["testbed:math"]["16/8"]
    copy = [dict(p, label=p["label"].replace("threshold", "l2p")) for p in d["curves"]["threshold"]]
    d["curves"]["l2p"] = copy
    for p in copy:
        r["points"][p["label"]] = r["points"][p["label"].replace("l2p", "threshold")]
    (tmp_path / "frontier.json").write_text(json.dumps(frontier))
    (tmp_path / "records.json").write_text(json.dumps(records))
    v = recompute_matched(tmp_path, resamples=50)["tasks"]["testbed:math"]["16/8"]["matched"]
    assert set(v) == {"l2p"}
    # a copy of one heuristic is never above the envelope of all of them
    assert v["l2p"]["gap"] is not None and v["l2p"]["gap"] <= 1e-12
    out = subprocess.run([sys.executable, "-m", "tracelock.eval.matched", str(tmp_path), str(tmp_path),
                          "--resamples", "50"],
                         capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.stdout.count("| testbed:math | 16/8 | l2p |") == 2 and out.stdout.count(f"({tmp_path})") == 2
    assert format_matched({"tolerance": 0.01, "tasks": {"t": {"s": {"matched": v}}}}).count("| t | s | l2p |") == 1


def test_steps_at_accuracy_interpolates_between_sweep_points():
    points = [(8, 0.60), (16, 0.80), (32, 0.85), (64, 0.86)]
    assert steps_at_accuracy(points, 0.70) == pytest.approx(12.0)
    assert steps_at_accuracy(points, 0.80) == pytest.approx(16.0)
    assert steps_at_accuracy(points, 0.845) == pytest.approx(16 + 16 * 0.045 / 0.05)
    assert steps_at_accuracy(points, 0.50) == 8.0  # the cheapest point already reaches it
    assert steps_at_accuracy(points, 0.90) is None  # never reached
    # the order of the sweep does not matter, and the first crossing counts (a curve may dip later)
    assert steps_at_accuracy([(64, 0.86), (8, 0.6), (32, 0.7), (16, 0.8)], 0.75) == pytest.approx(14.0)
    assert pareto([(8, 0.6), (16, 0.8), (32, 0.7), (16, 0.8)]) == [True, True, False, True]


def test_seconds_per_item_are_read_off_the_curve_at_the_steps_at_reference():
    seconds = [(32, 0.4), (8, 0.1), (16, 0.2)]
    assert value_at_steps(seconds, 12.0) == pytest.approx(0.15)
    assert value_at_steps(seconds, 16) == pytest.approx(0.2) and value_at_steps(seconds, 8) == pytest.approx(0.1)
    assert value_at_steps(seconds, None) is None and value_at_steps(seconds, 40) is None


@pytest.mark.parametrize("sweep, match", [
    ("nonesuch:tau=0.5,0.9", "'nonesuch' is not a policy"),
    ("threshold:theta=0.5,0.9", "threshold has no knob or argument 'theta'; choose from"),
    ("threshold:tau=a,b", "'a' is not a number"),
    ("threshold:tau=0.5,0.9:first_token=0.1,0.2", "sweeps two knobs"),
    ("threshold:tau", "must look like key=value"),
    ("confidence:per_step=0.5,1", "per_step .* whole numbers"),
    ("topk", "topk has no default knob"),
])
def test_bad_sweeps_are_refused(sweep, match):
    with pytest.raises(ValueError, match=match):
        parse_sweep(sweep)


def test_a_bare_name_takes_its_default_grid_and_one_value_is_one_point():
    assert parse_sweep("threshold").values == (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
    one = parse_sweep("threshold:tau=0.9:cache=dual")
    assert (one.knob, one.values, one.fixed) == ("tau", (0.9,), {"cache": "dual"})
    assert one.points(Setting(64, 16))[0].args == {"tau": 0.9, "cache": "dual"}
    assert parse_sweep("confidence:per_step=1,4").points(Setting(64, 16))[1].args == {"steps": 16}
    named = parse_sweep("tracelock:theta=0.5,0.9:controller=runs/a:curve=TraceLock-A")
    assert named.curve == "TraceLock-A" and named.fixed == {"controller": "runs/a"}
    point = named.points(Setting(64, 16))[1]
    assert point.args == {"theta": 0.9, "controller": "runs/a"} and point.label.endswith(":curve=TraceLock-A")


def test_the_rules_since_fastdllm_sweep_their_knob():
    # credit, klass, less: their threshold; hierarchy: low (tau none); eb: the entropy budget; pc: tokens per step
    defaults = {name: (parse_sweep(name).knob, parse_sweep(name).values)
                for name in ("credit", "klass", "less", "hierarchy", "eb")}
    assert {name: knob for name, (knob, _) in defaults.items()} == {
        "credit": "tau", "klass": "tau", "less": "tau", "hierarchy": "low", "eb": "gamma"}
    assert defaults["eb"][1][0] == 0.001 and defaults["eb"][1][-1] == 1.0
    assert all(0 < v <= 1 for name in ("credit", "klass", "less") for v in defaults[name][1])
    assert all(0 <= v < 1 for v in defaults["hierarchy"][1])
    pc = parse_sweep("pc:background=testbed")
    assert (pc.knob, pc.values, pc.fixed) == ("per_step", (1, 2, 4, 8), {"background": "testbed"})
    assert pc.points(Setting(64, 16))[2].args == {"steps": 16, "background": "testbed"}
    # the other knobs fixed, the default one swept; none is None; a rule with steps takes per_step as a fixed one
    assert parse_sweep("hierarchy:tau=0.5,0.9:low=0.3").points(Setting(64, 16))[1].args == {"tau": 0.9, "low": 0.3}
    assert parse_sweep("hierarchy:low=0.2,0.4:tau=none").points(Setting(64, 16))[0].args == {"low": 0.2, "tau": None}
    klass = parse_sweep("klass:tau=0.7,0.9:kl=0.001:form=dream:per_step=2")
    assert klass.points(Setting(64, 16))[0].args == {"tau": 0.7, "kl": 0.001, "form": "dream", "per_step": 2}
    with pytest.raises(ValueError, match="credit has no knob or argument 'alpah'; .*did you mean 'alpha'"):
        parse_sweep("credit:alpah=0.5,0.7")
    with pytest.raises(ValueError, match="eb has no knob or argument 'per_step'"):
        parse_sweep("eb:per_step=1,2")


def test_a_sweep_of_the_rules_since_fastdllm(micro, tmp_path):
    sweeps = [parse_sweep(s) for s in ("credit:tau=0.5,0.9", "klass:tau=0.9:kl=0.01",
                                       "pc:background=testbed:per_step=2,4", "eb:gamma=0.001,1.0")]
    result = run_frontier(micro, sweeps=sweeps, out=tmp_path, **ARGS)
    d = result["tasks"]["testbed:math"]["16/8"]
    assert set(d["curves"]) == {"confidence", "credit", "klass:kl=0.01", "pc:background=testbed", "eb"}
    # per_step k: k tokens per step
    assert [p["avg_steps"] for p in d["curves"]["pc:background=testbed"]] == [8, 4]
    assert all(1 <= p["avg_steps"] <= 16 and p["n"] == 3 for c in d["curves"].values() for p in c)
    # a bad knob or a window fails before anything decodes, naming the point
    with pytest.raises(ValueError, match=r"klass:tau=2 at 16/8: tau=2 must lie in \(0, 1\]"):
        run_frontier(micro, sweeps=[parse_sweep("klass:tau=2")], out=tmp_path / "bad", **ARGS)
    with pytest.raises(ValueError, match=r"credit:tau=0.9:schedule=window at 16/8: policy 'credit' keeps a memory per "
                                         r"slot of a block, which a sliding window moves"):
        run_frontier(micro, sweeps=[parse_sweep("credit:tau=0.9:schedule=window")], out=tmp_path / "bad", **ARGS)


def test_bad_runs_are_refused(micro, tmp_path):
    sweeps = [parse_sweep("threshold:tau=0.9")]
    with pytest.raises(ValueError, match="the sweep is empty"):
        run_frontier(micro, sweeps=[], out=tmp_path, **ARGS)
    with pytest.raises(ValueError, match="--split 'train' does not exist"):
        run_frontier(micro, sweeps=sweeps, out=tmp_path, split="train", **ARGS)
    with pytest.raises(ValueError, match="only testbed tasks have a validation split"):
        run_frontier(micro, sweeps=sweeps, out=tmp_path, split="validation",
                     **{**ARGS, "tasks": ["gsm8k:/nonexistent.jsonl"]})
    with pytest.raises(ValueError, match="give the split with --split"):
        run_frontier(micro, sweeps=sweeps, out=tmp_path, **{**ARGS, "tasks": ["testbed:math@validation"]})
    cli = subprocess.run([sys.executable, "-m", "tracelock", "frontier", "--model", str(micro), "--tasks",
                          "testbed:math", "--limit", "2", "--out", str(tmp_path / "x"), "--sweep", "nonesuch"],
                         capture_output=True, text=True)
    assert cli.returncode == 2 and "'nonesuch' is not a policy" in cli.stderr and "Traceback" not in cli.stderr


def test_max_step_gap_traces_a_knob_until_no_hole_can_be_split(micro, tmp_path):
    # confidence at 16 tokens in two blocks: per_step k is 16 // k steps, which must be even. 1 and 8 (16 and 2 steps)
    # get 4 (4 steps), then 2 (8 steps); 3 would be 5 steps: 2 to 4 stays a hole of 4 steps, 1 to 2 one of 8 (no whole
    # number between); 4 to 8 is 2 steps apart
    result = run_frontier(micro, sweeps=[parse_sweep("confidence:per_step=1,8")], out=tmp_path, max_step_gap=3,
                          **ARGS)
    d = result["tasks"]["testbed:math"]["16/8"]
    assert [(p["value"], p["avg_steps"]) for p in d["curves"]["confidence"]] == [
        (1, 16), (2, 8), (4, 4), (8, 2)]
    assert d["largest_step_gap"] == {"confidence": 8} and d["max_step_gap"] == 3
    assert len(json.loads((tmp_path / "records.json").read_text())["testbed:math"]["16/8"]["points"]) == 4
    with pytest.raises(ValueError, match="--max-step-gap 0 must be a number of mean steps > 0"):
        run_frontier(micro, sweeps=[parse_sweep("confidence:per_step=1,8")], out=tmp_path, max_step_gap=0, **ARGS)


def test_a_hole_is_split_at_its_midpoint_in_the_knob():
    from tracelock.eval.dense import geometric, largest_gap, midpoint, values_to_add

    assert midpoint(0.5, 0.9, whole=False, log=False) == 0.7
    assert midpoint(0.001, 1.0, whole=False, log=True) == 0.03162  # four significant digits
    assert midpoint(2, 4, whole=True, log=False) == 3 and midpoint(1, 2, whole=True, log=False) is None
    assert midpoint(1, 8, whole=True, log=False, valid=lambda v: v % 2 == 0) == 4
    assert midpoint(2, 8, whole=True, log=False, valid=lambda v: v != 5) == 4  # the nearest valid, low side first
    assert midpoint(0.7, 0.70001, whole=False, log=False) is None  # equal at four digits: left as it is
    assert geometric([0.001, 0.1, 1.0]) and not geometric([0.5, 0.99]) and not geometric([0.0, 1.0])
    # neighbours in order of steps, whatever the knob's direction (eb's budget: more gamma, fewer steps)
    points = [(0.01, 27.0), (0.1, 20.0), (1.0, 13.0), (0.3, 17.5)]
    assert largest_gap(points) == 7.0 and largest_gap(points[:1]) == 0.0
    assert values_to_add(points, 3.0, whole=False, log=True) == [0.5477, 0.03162]
    assert values_to_add(points, 7.0, whole=False, log=True) == []


def test_trace_densely_decodes_midpoints_until_no_hole_is_left():
    from tracelock.eval.dense import trace_densely

    steps = lambda v: 30.0 - 10.0 * v  # noqa: E731 (a knob whose steps fall linearly from 30 to 20)
    decoded = []
    got = trace_densely([0.0, 1.0], steps, decoded.append, 3.0, 6, whole=False, log=False)
    assert decoded == [[0.5], [0.75, 0.25]] and sorted(got) == [0.0, 0.25, 0.5, 0.75, 1.0]  # holes in order of steps
    assert trace_densely([0.0, 1.0], steps, decoded.append, 3.0, 1, whole=False, log=False) == [0.0, 1.0, 0.5]


def test_the_gate_is_traced_along_its_bases_knob(tmp_path):
    """The fitted gate's knob is its base rule's (``base_gamma`` for the entropy bound): a sweep lists it, and
    --max-step-gap splits its holes geometrically (gamma spans a factor of 10 and more)."""
    sweep = "gate:base_gamma=0.001,10:controller=testbed:base=eb:veto=0.5"
    result = run_frontier("testbed", sweeps=[parse_sweep(sweep)], out=tmp_path, max_step_gap=2,
                          tasks=["testbed:math"], settings=[Setting(16, 8)], limit=3, batch_size=3)
    points = result["tasks"]["testbed:math"]["16/8"]["curves"]["gate:controller=testbed:base=eb:veto=0.5"]
    values = [p["value"] for p in points]
    assert values[0] == 0.001 and values[-1] == 10 and 0.1 in values  # 0.1: the geometric midpoint of the two
    steps = [p["avg_steps"] for p in points]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]
