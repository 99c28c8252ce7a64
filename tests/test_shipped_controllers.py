"""The trained TraceLock controllers shipped with the bundled models: they load by name, decode, and are what
`tracelock demo --tracelock` uses without training; `testbed-ship-controller` copies a finished run."""

import json
import subprocess
import sys

import pytest

import tracelock
from tracelock.models import loading
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.testbed import held_out
from tracelock.testbed.ship import CONTROLLER_FILES, sha256


@pytest.mark.parametrize("name", ["testbed", "testbed-dream"])
def test_each_bundled_model_ships_its_trained_controller(name):
    folder = loading.BUNDLED_CONTROLLERS[name]
    shipped = json.loads((folder / "shipped.json").read_text())
    assert shipped["best_safetensors_sha256"] == sha256(folder / "best.safetensors")
    assert shipped["metrics"] == json.loads((folder / "metrics.json").read_text())
    # a trained controller, not a placeholder: its held-out positions are ranked far better than chance
    assert shipped["metrics"]["fixed_crop"]["auroc"] > 0.8
    model, tok = tracelock.load_model(name), tracelock.load_tokenizer(name)
    policy = TraceLockPolicy(name, model=model)  # the fingerprints match the bundled backbone
    # they deploy with the commit rule chosen on validation: hold_end, the family's one-per-step score as fallback
    score = {"testbed": "confidence", "testbed-dream": "neg_entropy"}[name]
    assert shipped["commit_rule"] == {"hold_end": True, "fallback": score}
    assert (policy.hold_end, policy.fallback) == (True, score)
    ids = tok(held_out("math", "test", 1)[0].prompt, add_special_tokens=False)["input_ids"]
    tokens, stats = tracelock.fused_generate(model, [ids], policy=policy, gen_length=16, window=8)
    assert tokens.shape[1] == len(ids) + 16 and 1 <= stats.steps[0] <= 16


def test_demo_tracelock_uses_the_shipped_controller_without_training(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tracelock", "demo", "--tracelock", "--limit", "2", "--tasks", "math",
                           "--gen-length", "16", "--block", "8", "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "| TraceLock (window 8) |" in proc.stdout
    assert "controller ready" not in proc.stdout and not (tmp_path / "work").exists()


def test_demo_tracelock_on_another_model_names_the_fix(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tracelock", "demo", "--tracelock", "--model",
                           str(loading.BUNDLED["testbed"]), "--limit", "1"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--controller DIR" in proc.stderr and "--train-controller" in proc.stderr


def test_a_missing_bundled_controller_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(loading.BUNDLED_CONTROLLERS, "testbed", tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="missing from this install.*tracelock train"):
        TraceLockPolicy("testbed", model=tracelock.load_model("testbed"))


def test_ship_controller_copies_a_finished_run_and_refuses_an_unfinished_one(tmp_path):
    run, dest = tmp_path / "run", tmp_path / "dest"
    run.mkdir()
    source = loading.BUNDLED_CONTROLLERS["testbed"]
    for name in CONTROLLER_FILES[:-1]:  # no metrics.json yet: training has not finished
        (run / name).write_bytes((source / name).read_bytes())
    cmd = [sys.executable, "-m", "tracelock", "testbed-ship-controller", str(run), "--dest", str(dest),
           "--command", "tracelock train ...", "--machine", "this CPU"]
    unfinished = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert unfinished.returncode != 0 and "lacks metrics.json" in unfinished.stderr
    assert "Traceback" not in unfinished.stderr and not dest.exists()
    (run / "metrics.json").write_bytes((source / "metrics.json").read_bytes())
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all((dest / name).read_bytes() == (run / name).read_bytes() for name in CONTROLLER_FILES)
    info = json.loads((dest / "shipped.json").read_text())
    assert info["command"] == "tracelock train ..." and info["machine"] == "this CPU"
    assert TraceLockPolicy(dest, model=tracelock.load_model("testbed")) is not None

    # a new commit rule, in place: best.json and shipped.json say it, the weights stay
    again = [sys.executable, "-m", "tracelock", "testbed-ship-controller", str(dest), "--dest", str(dest),
             "--command", "tracelock train ...; then --commit-rule paper", "--machine", "this CPU",
             "--commit-rule", "paper"]
    done = subprocess.run(again, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads((dest / "best.json").read_text())["commit_rule"] == {}
    info = json.loads((dest / "shipped.json").read_text())
    assert info["commit_rule"] == {} and info["command"].endswith("--commit-rule paper")
    assert (dest / "best.safetensors").read_bytes() == (source / "best.safetensors").read_bytes()
    policy = TraceLockPolicy(dest, model=tracelock.load_model("testbed"))
    assert (policy.hold_end, policy.fallback) == (False, "score")


def test_a_ship_error_names_the_subcommand_not_the_recorded_command(tmp_path):
    # --command is text for the record; an error line must still read `tracelock testbed-ship-controller: ...`
    proc = subprocess.run([sys.executable, "-m", "tracelock", "testbed-ship-controller", str(tmp_path / "none"),
                           "--dest", str(tmp_path / "dest"), "--command", "MY RECIPE", "--machine", "here"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stderr.startswith("tracelock testbed-ship-controller: error:"), proc.stderr


def test_a_fit_controller_ships_with_its_gate(tmp_path):
    """`tracelock fit`'s OUT/controller holds a gate.json; shipped, the folder deploys as that gate by name alone."""
    from tracelock.policies.gate import GatePolicy
    from tracelock.testbed.ship import ship_controller

    run, dest = tmp_path / "controller", tmp_path / "dest"
    run.mkdir()
    source = loading.BUNDLED_CONTROLLERS["testbed"]
    for name in CONTROLLER_FILES:
        (run / name).write_bytes((source / name).read_bytes())
    gate = dict(base="eb", base_args={"gamma": 0.1, "hold_end": True}, accept=0.9, veto=0.5, knob="base_gamma")
    (run / "gate.json").write_text(json.dumps(gate))
    info = ship_controller(run, dest, command="tracelock fit ...", machine="this CPU")
    assert info["gate"] == gate and json.loads((dest / "gate.json").read_text()) == gate
    policy = GatePolicy(dest, model=tracelock.load_model("testbed"))
    assert (policy.base.name, policy.base.gamma, policy.base.hold_end) == ("eb", 0.1, True)
    assert (policy.accept, policy.veto) == (0.9, 0.5)


@pytest.mark.parametrize("name", sorted(loading.BUNDLED_GATES))
def test_each_bundled_gate_deploys_by_name(name):
    """The gates `tracelock fit` chose per bundled model and task family ship with their gate.json and deploy as
    `gate:controller=<name>`, their base's knob free to move along the curve."""
    from tracelock.policies.gate import GatePolicy

    folder = loading.BUNDLED_GATES[name]
    shipped = json.loads((folder / "shipped.json").read_text())
    gate = json.loads((folder / "gate.json").read_text())
    assert shipped["best_safetensors_sha256"] == sha256(folder / "best.safetensors") and shipped["gate"] == gate
    assert gate["knob"] == "base_gamma" and gate["base"] == "eb"
    assert shipped["command"].startswith("tracelock fit --model testbed")
    family = name.split("-")[1]
    model_name = "testbed" if family == "llada" else "testbed-dream"
    model, tok = tracelock.load_model(model_name), tracelock.load_tokenizer(model_name)
    policy = GatePolicy(name, model=model, base_gamma=0.3)
    assert (policy.base.name, policy.base.gamma, policy.accept, policy.veto) == ("eb", 0.3, gate["accept"],
                                                                                 gate["veto"])
    assert policy.base.first_token == (family == "dream")
    ids = tok(held_out("math", "test", 1)[0].prompt, add_special_tokens=False)["input_ids"]
    tokens, stats = tracelock.fused_generate(model, [ids], policy=policy, gen_length=16, block=8)
    assert tokens.shape[1] == len(ids) + 16 and 1 <= stats.steps[0] <= 16
