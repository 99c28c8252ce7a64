"""What a new user trips on in the first hour, one test per point: a missing extra named before anything runs, an op
implementation that cannot run here, one policy grammar, a busy machine, bad input refused before the model loads or
a point decodes, errors that name the fix, and what `generate` writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracelock
from tracelock import cli
from tracelock.cli_common import threads_for_load
from tracelock.models.spec import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
CLI = str(Path(sys.executable).parent / "tracelock")
ZOE = "Zoe has 9 books. She finds 4 more books. How many books does Zoe have now?"


def run_cli(*args, env=None):
    """The real command in a subprocess: (returncode, stdout, stderr)."""
    done = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return done.returncode, done.stdout, done.stderr


def main_in_process(argv, capsys):
    """`tracelock ARGV` in this process: (returncode, stderr)."""
    code = cli.main(argv)
    return code, capsys.readouterr().err


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib as a fresh install without the [report] extra sees it: importing it fails."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


@pytest.mark.parametrize("argv", [
    ["frontier", "--model", "testbed", "--tasks", "testbed:math", "--limit", "2", "--sweep", "threshold:tau=0.9"],
    ["report", "RUN"],
    ["rl", "--model", "testbed", "--controller", "testbed", "--prompts", "testbed:math", "--out", "OUT"],
], ids=["frontier", "report", "rl"])
def test_a_command_that_draws_names_the_report_extra_before_it_decodes(argv, no_matplotlib, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = argv + (["--out", str(tmp_path / "front")] if argv[0] == "frontier" else [])
    code, err = main_in_process(argv, capsys)
    assert code == 2 and "Traceback" not in err
    assert 'pip install "tracelock[report]"' in err and '-e ".[report]"' in err and "matplotlib" in err
    assert not any(tmp_path.iterdir()), "nothing is decoded or written before the check"


def test_the_readme_names_the_report_extra():
    assert '".[report]"' in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_an_impl_that_cannot_run_on_the_cpu_is_one_line_naming_it(impl, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([CLI, "generate", "--model", "testbed", "--prompt", "hi", "--policy", "threshold",
                           "--gen-length", "16", "--impl", impl], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and f"impl={impl!r} cannot run here" in line and "impl='torch'" in line
    if impl == "cuda":
        assert "impl='triton'" not in line


def test_fused_generate_checks_the_impl_before_decoding():
    model = tracelock.load_model("testbed")
    with pytest.raises(ValueError, match="impl='cuda' cannot run here: its ops run on a CUDA device"):
        tracelock.fused_generate(model, [[5, 6, 7]], policy="threshold", gen_length=16, impl="cuda")


def test_per_step_is_one_grammar_in_python_and_on_the_command_line(tmp_path):
    model, tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    ids = tok(ZOE)["input_ids"]
    spelled, _ = tracelock.fused_generate(model, [ids], policy="confidence", policy_args={"steps": 32},
                                          gen_length=64, block=16)
    per_step, stats = tracelock.fused_generate(model, [ids], policy="confidence", policy_args={"per_step": 2},
                                               gen_length=64, block=16)
    assert torch.equal(per_step, spelled) and stats.steps == [32]
    with pytest.raises(ValueError, match="per_step=3 does not divide gen_length=64"):
        tracelock.fused_generate(model, [ids], policy="confidence", policy_args={"per_step": 3}, gen_length=64)
    with pytest.raises(ValueError, match="not both"):
        tracelock.fused_generate(model, [ids], policy="confidence", policy_args={"per_step": 2, "steps": 32},
                                 gen_length=64)
    # the spec `frontier --help` shows is what `generate` takes
    code, out, err = run_cli("generate", "--model", "testbed", "--prompt", ZOE, "--policy", "confidence:per_step=2",
                             "--gen-length", "64", "--block", "16")
    assert code == 0, err
    assert json.loads(out)["steps"] == 32
    assert "confidence:per_step=1,2,4" in run_cli("frontier", "--help")[1].replace("\n", " ").replace("  ", " ")


def test_eval_takes_per_step_too(tmp_path):
    from tracelock.eval.runner import parse_policies, parse_settings, run_eval

    rows = run_eval("testbed", "testbed:math", parse_policies("confidence:per_step=2"), parse_settings("64/16"),
                    tmp_path / "run", n=2, batch_size=2, workers=1)
    assert rows[0]["avg_steps"] == 32


@pytest.mark.parametrize("threads,default,load,want,says", [
    (None, 2, 0.1, 2, None),                      # idle: the default
    (None, 2, 1.7, 1, "using 1 torch thread instead of 2"),  # busy: fewer threads, said
    (None, 16, 4.2, 12, "using 12 torch threads instead of 16"),
    (2, 2, 3.0, 2, "--threads 2 on a busy machine"),  # asked for: kept, and called out
    (1, 2, 3.0, 1, None),
])
def test_a_busy_machine_gets_fewer_threads_and_a_word(threads, default, load, want, says):
    n, notice = threads_for_load(threads, default, max(default, 2), load)
    assert n == want
    assert (notice is None) if says is None else (says in notice)


def test_the_busy_machine_notice_is_not_hidden_by_quiet(capsys, monkeypatch):
    from tracelock.cli_common import apply_runtime_options
    from tracelock.progress import QUIET_ENV

    # what it sets for this process is put back afterwards: the quiet switch, the thread variables, torch's threads
    for name in (QUIET_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, os.environ.get(name, "1" if name != QUIET_ENV else "0"))
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    threads = torch.get_num_threads()
    try:
        apply_runtime_options(type("Args", (), dict(quiet=True, threads=2, command="demo"))())
    finally:
        torch.set_num_threads(threads)
    assert "--threads 2 on a busy machine" in capsys.readouterr().err


def test_a_machine_that_becomes_busy_midway_is_called_out_once(monkeypatch, capsys):
    from tracelock import progress

    monkeypatch.setattr(progress, "_load_noticed", False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv(progress.QUIET_ENV, "1")
    assert progress.notice_oversubscription(load=2.3, cores=2) is None  # this command's own two threads
    assert "became busy (load average 3.4 on 2 cores)" in progress.notice_oversubscription(load=3.4, cores=2)
    assert progress.notice_oversubscription(load=9.0, cores=2) is None  # said once
    assert "--threads 1" in capsys.readouterr().err
    monkeypatch.setattr(progress, "_load_noticed", False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert progress.notice_oversubscription(load=9.0, cores=2) is None  # one thread has nothing to give up


@pytest.fixture
def weightless(tmp_path):
    """A checkpoint folder whose weights are missing: a command that reads it fails, so an error about anything else
    was raised before the model loaded."""
    from tracelock.models import write_tiny_checkpoint

    folder = Path(write_tiny_checkpoint(tmp_path / "tiny", family="llada"))
    (folder / "model.safetensors").unlink()
    return folder


@pytest.mark.parametrize("policy,says", [("threshold:tau=2", "tau=2 must lie in (0, 1]"),
                                         ("beam", "unknown policy 'beam'"),
                                         ("confidence:steps=30", "steps=30 is not a multiple of num_regions=4")])
def test_generate_refuses_a_bad_policy_before_the_model_loads(weightless, policy, says):
    code, _, err = run_cli("generate", "--model", str(weightless), "--prompt", "hi", "--policy", policy,
                           "--gen-length", "64", "--block", "16")
    assert code == 2 and says in err and "holds no weights" not in err


def test_frontier_refuses_a_bad_point_before_any_point_decodes(tmp_path, capsys):
    out = tmp_path / "front"
    code, err = main_in_process(["frontier", "--model", "testbed", "--tasks", "testbed:math", "--limit", "2",
                                 "--settings", "64/16,128/32", "--sweep", "threshold:tau=0.7,0.9",
                                 "--sweep", "threshold:tau=0.5,2:curve=late", "--out", str(out)], capsys)
    assert code == 2 and "threshold:tau=2:curve=late at 64/16: tau=2 must lie in (0, 1]" in err
    assert not out.exists()


def test_frontier_says_sweep_is_required(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["frontier", "--model", "testbed", "--tasks", "testbed:math", "--out", "x"])
    assert exit_.value.code == 2 and "the following arguments are required: --sweep" in capsys.readouterr().err
    usage = " ".join(run_cli("frontier", "--help")[1].split("\n\n")[0].split())
    assert "--sweep NAME[" in usage and "[--sweep" not in usage


def test_a_misspelt_model_name_lists_the_bundled_ones(capsys):
    code, err = main_in_process(["generate", "--model", "testbed-drem", "--prompt", "hi", "--policy", "threshold",
                                 "--gen-length", "16"], capsys)
    assert code == 2 and "did you mean 'testbed-dream'?" in err and "testbed, testbed-llada, testbed-dream" in err
    with pytest.raises(CheckpointError, match="model 'testbd' does not exist: did you mean 'testbed'"):
        tracelock.load_tokenizer("testbd")


def test_a_block_that_does_not_tile_suggests_the_nearest_fixes(capsys):
    code, err = main_in_process(["generate", "--model", "testbed", "--prompt", "hi", "--policy", "threshold",
                                 "--gen-length", "60", "--block", "16"], capsys)
    assert code == 2
    assert "--block 12 or 15 or 20 (divisors of 60), --gen-length 64 (a multiple of 16), or --window 16" in err


def test_generate_json_ends_the_answer_before_its_end_token():
    model = tracelock.load_model("testbed")
    code, out, err = run_cli("generate", "--model", "testbed", "--prompt", ZOE, "--policy", "threshold:tau=0.9",
                             "--gen-length", "64", "--block", "16")
    assert code == 0, err
    record = json.loads(out)
    assert record["text"].endswith("#### 13") and 0 < len(record["token_ids"]) < 64
    assert not set(record["token_ids"]) & set(model.spec.end_ids)
    tok = tracelock.load_tokenizer("testbed")
    assert tok.decode(record["token_ids"], skip_special_tokens=True) == record["text"]


def test_the_readme_command_table_lists_every_command():
    table = (ROOT / "README.md").read_text().split("## The command line at a glance")[1].split("\n\n")[1]
    listed = {name for line in table.splitlines()[2:] for name in line.split("|")[1].replace("`", "").split(", ")}
    commands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert {n.strip() for n in listed} == commands
