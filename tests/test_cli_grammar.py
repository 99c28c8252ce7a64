"""The CLI's one grammar: every --help shown without importing torch and with every default, deprecated spellings
that still work, --version, --threads, --quiet, and bad input that ends in one line instead of a traceback."""

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from tracelock.cli import build_parser, main
from tracelock.cli_options import split_tasks
from tracelock.cli_parser import HelpFormatter
from tracelock.cli_threads import physical_cores
from tracelock.policy_specs import POLICY_NAMES

PARSER = build_parser()
# `lm-eval` hands every argument, --help included, to lm-eval's own command line (tests/test_lm_eval_model.py)
PASSTHROUGH = {"lm-eval"}
COMMANDS = sorted(set(PARSER._subparsers._group_actions[0].choices) - PASSTHROUGH)
# `--help` must not load these: importing torch alone costs over 1 s on the 2-core AMD EPYC, where every command's help
# takes about 0.25 s without it. What the help costs in seconds is measured, not asserted (a slower or busier machine
# would fail a bound): bench/test_bench_cli.py, numbers in docs/benchmarks.md
HEAVY_MODULES = ("torch", "transformers", "triton", "tracelock._C")
# `python -m tracelock ARGS`, then the heavy modules it loaded, as the last line of stderr
HELP_PROBE = f"""
import json, runpy, sys
sys.argv = ["tracelock", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("tracelock", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
print("\\n" + json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules]), file=sys.stderr)
sys.exit(code)
"""


def _subparser(name):
    return PARSER._subparsers._group_actions[0].choices[name]


def run_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "tracelock", *args], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def test_building_the_parser_imports_no_torch():
    code = "import sys; from tracelock.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_imports_no_torch_and_shows_every_default(command):
    args = ["--help"] if command is None else [command, "--help"]
    done = subprocess.run([sys.executable, "-c", HELP_PROBE, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: tracelock {command or ''}".rstrip()), done.stdout[:200]
    loaded = json.loads(done.stderr.rstrip().rsplit("\n", 1)[-1])
    assert loaded == [], f"tracelock {' '.join(args)} imported {', '.join(loaded)}: the help would wait for them"
    if command is None:
        return
    formatter = HelpFormatter("tracelock")
    parser = _subparser(command)
    # one of a required group's options must be given: it has no default
    chosen = {id(a) for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}
    for action in parser._actions:
        if (not action.option_strings or action.required or id(action) in chosen or action.help == argparse.SUPPRESS
                or isinstance(action, argparse._StoreConstAction | argparse._HelpAction)):
            continue
        text = formatter._get_help_string(action) or ""
        assert "default" in text.lower(), f"tracelock {command} {action.option_strings[0]}: no default in {text!r}"
    assert "--threads" in done.stdout and "--quiet" in done.stdout


def test_version():
    from tracelock import __version__

    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"tracelock {__version__}"


def test_policy_names_match_the_registry():
    from tracelock.policies import POLICIES

    assert tuple(sorted(POLICIES)) == POLICY_NAMES


@pytest.mark.parametrize("command, old, new, dest", [
    ("demo", "--n", "--limit", "limit"),
    ("testbed-eval", "--n", "--limit", "limit"),
    ("collect", "--num", "--limit", "limit"),
    ("self-train", "--num", "--limit", "limit"),
    ("rl", "--num", "--limit", "limit"),
    ("testbed-probe", "--n", "--limit", "limit"),
    ("eval", "--task", "--tasks", "tasks"),
    ("generate", "--dtype", "--model-dtype", "model_dtype"),
    ("featurize", "--dtype", "--cache-dtype", "cache_dtype"),
])
def test_old_spellings_still_work_and_say_what_to_write(command, old, new, dest, capsys):
    value = {"--task": "testbed:code", "--dtype": "int8" if command == "featurize" else "bfloat16"}.get(old, "7")
    required = {"collect": ["--model", "m", "--prompts", "p", "--out", "o"],
                "self-train": ["--model", "m", "--controller", "c", "--cache", "k", "--prompts", "p", "--out", "o"],
                "rl": ["--model", "m", "--controller", "c", "--prompts", "p", "--out", "o"],
                "testbed-eval": ["--out", "o"],
                "eval": ["--model", "m", "--policies", "confidence", "--out", "o"],
                "generate": ["--model", "m", "--prompt", "p", "--policy", "confidence", "--gen-length", "8"],
                "featurize": ["--traces", "t", "--model", "m", "--encoder", "e", "--out", "o"]}.get(command, [])
    args = build_parser().parse_args([command, *required, old, value])
    assert str(getattr(args, dest)) == value
    assert f"{old} is deprecated, use {new}" in capsys.readouterr().err
    assert not re.search(rf"{old}(?![\w-])", _subparser(command).format_help())  # hidden from --help


def test_limit_must_be_positive(capsys):
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(["demo", "--limit", "0"])
    assert err.value.code == 2 and "argument --limit: 0 must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--n", "0"])
    assert "0 must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["testbed-eval"], ["generate", "--model", "testbed", "--prompt", "hi"],
                                  ["testbed-probe"]])
def test_an_output_file_that_is_a_folder_is_refused_before_the_work(argv, tmp_path, capsys):
    """A folder as a file --out failed only when the results were written, with a bare [Errno 21]."""
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args([*argv, "--out", str(tmp_path)])
    assert err.value.code == 2
    assert f"argument --out: {tmp_path} is a folder; pass a file path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--out", ""])
    assert "argument --out: an empty path" in capsys.readouterr().err


def test_task_lists():
    assert split_tasks("testbed:math,code") == ["testbed:math", "testbed:code"]
    assert split_tasks("math, testbed:code@validation") == ["testbed:math", "testbed:code@validation"]
    assert split_tasks("gsm8k:data/test.jsonl,humaneval") == ["gsm8k:data/test.jsonl", "humaneval"]
    with pytest.raises(ValueError, match="names no task"):
        split_tasks(" , ")
    from tracelock.recording.collect import load_items

    spelled = [it.id for it in load_items("testbed:math,testbed:code", 2)]
    assert spelled == [it.id for it in load_items("testbed:math,code", 2)]
    with pytest.raises(ValueError, match="several splits"):
        load_items("testbed:math@test,testbed:code@validation", 2)


def test_demo_tasks_are_checked(capsys, monkeypatch):
    monkeypatch.setenv("TRACELOCK_QUIET", "0")  # main sets it for --quiet; undone after the test
    assert main(["demo", "--tasks", "testbed:poetry", "--quiet"]) == 2
    assert "'testbed:poetry' is not a testbed task" in capsys.readouterr().err


def test_threads_flag_env_and_default():
    assert run_cli("env", "--threads", "1").stdout.count("threads: 1\n") == 1
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-m", "tracelock", "env"], capture_output=True, text=True, timeout=120,
                          env=env)
    # the physical cores, or on a machine busy at the start the cores its load leaves free, said on stderr
    busy = re.search(r"using (\d+) torch threads? instead of (\d+)", done.stderr)
    if busy:
        assert int(busy[2]) == physical_cores() and f"threads: {busy[1]}\n" in done.stdout
    else:
        assert f"threads: {physical_cores()}\n" in done.stdout
    done = subprocess.run([sys.executable, "-m", "tracelock", "env"], capture_output=True, text=True, timeout=120,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert "threads: 1\n" in done.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error of a CPU-only machine")
def test_cuda_on_a_cpu_only_torch_is_one_line():
    done = run_cli("generate", "--model", "testbed", "--prompt", "hi", "--policy", "confidence", "--gen-length", "8",
                   "--device", "cuda")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error: device='cuda' but this torch" in done.stderr and "--device cpu" in done.stderr


def test_bad_policy_values_are_one_line_and_quiet_is_quiet(tmp_path):
    done = run_cli("generate", "--model", "testbed", "--prompt", "hi", "--policy", "threshold:tau=abc",
                   "--gen-length", "8")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "tau='abc' is not a number" in done.stderr
    done = run_cli("generate", "--model", "testbed", "--prompt", "hi", "--policy", "tracelock", "--gen-length", "8")
    assert done.returncode == 2 and "policy 'tracelock' needs controller" in done.stderr
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Zoe has 9 books."}\n{"prompt": "Ben has 2 pens."}\n')
    # one thread set: a busy machine's notice (which --quiet does not hide) has nothing to say
    done = run_cli("generate", "--model", "testbed", "--prompts", str(prompts), "--policy", "threshold:tau=0.9",
                   "--policy-arg", "tau=0.7", "--gen-length", "16", "--block", "8", "--quiet",
                   env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stderr == ""
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 2 and rows[0]["settings"]["policy_args"] == {"tau": 0.7}
    loud = run_cli("generate", "--model", "testbed", "--prompts", str(prompts), "--policy", "threshold",
                   "--gen-length", "16", "--block", "8")
    assert "generate: 100%" in loud.stderr and [json.loads(line) for line in loud.stdout.splitlines()]


@pytest.mark.parametrize("family, folder", [("llada", "model"), ("dream", "model-dream")])
def test_testbed_train_defaults_are_the_shipped_recipe(family, folder):
    import dataclasses
    from pathlib import Path

    from tracelock.cli import testbed_train_config
    from tracelock.testbed.train_config import BackboneTrainConfig

    info = Path(__import__("tracelock").__file__).parent / "testbed" / folder / "testbed.json"
    # a setting the shipped run's record predates took its default then
    defaults = {f.name: f.default for f in dataclasses.fields(BackboneTrainConfig) if f.name != "out"}
    shipped = {**defaults, **json.loads(info.read_text())["config"]}
    cfg = testbed_train_config(build_parser().parse_args(["testbed-train", "--out", "run", "--family", family]))
    machine = {"out", "device", "workers", "threads", "save_every", "compile", "probe_every", "probe_items"}
    recipe = {k: v for k, v in vars(cfg).items() if k not in machine}
    assert recipe == {k: tuple(v) if isinstance(v, list) else v for k, v in shipped.items() if k not in machine}


def test_eval_with_several_tasks_writes_a_run_folder_each(tmp_path):
    done = run_cli("eval", "--model", "testbed", "--tasks", "testbed:math,code", "--policies", "threshold:tau=0.9",
                   "--settings", "16/8", "--limit", "2", "--workers", "1", "--out", str(tmp_path / "run"), "--quiet")
    assert done.returncode == 0, done.stderr
    for task in ("math", "code"):
        summary = json.loads((tmp_path / "run" / f"testbed-{task}" / "summary.json").read_text())
        assert [(r["policy"], r["n"]) for r in summary["rows"]] == [("threshold:tau=0.9", 2)]
        assert f"testbed:{task}: " in done.stdout and str(tmp_path / "run" / f"testbed-{task}") in done.stdout


def test_the_rules_since_fastdllm_in_the_grammar():
    from tracelock.policy_specs import expand_policy_list, parse_policy_spec, policy_and_args
    from tracelock.text import did_you_mean

    # none (or JSON's null) is None: an optional argument left unset; a name or path stays a string
    assert parse_policy_spec("hierarchy:tau=none") == ("hierarchy", {"tau": None})
    assert parse_policy_spec("hierarchy:tau=null:low=0.3") == ("hierarchy", {"tau": None, "low": 0.3})
    assert parse_policy_spec("pc:background=testbed:lambd=0.25:alpha=10") == (
        "pc", {"background": "testbed", "lambd": 0.25, "alpha": 10})
    assert parse_policy_spec("klass:tau=0.9:kl=0.01:form=dream") == ("klass", {"tau": 0.9, "kl": 0.01, "form": "dream"})
    assert policy_and_args("credit", ["tau=0.8", "alpha=0"]) == ("credit", {"tau": 0.8, "alpha": 0})
    assert [label for label, _, _ in expand_policy_list("hierarchy:tau=0.9,none:low=0.3,eb:gamma=0.01,0.1")] == [
        "hierarchy:tau=0.9:low=0.3", "hierarchy:tau=none:low=0.3", "eb:gamma=0.01", "eb:gamma=0.1"]
    with pytest.raises(ValueError, match="unknown policy 'klas'.*did you mean 'klass'"):
        parse_policy_spec("klas:tau=0.9")
    with pytest.raises(ValueError, match="'hierachy' is not a policy.*did you mean 'hierarchy'"):
        expand_policy_list("credit,hierachy")
    assert did_you_mean("persistence", ["tau", "drift", "persist", "steps"]) == "; did you mean 'persist'?"


@pytest.mark.parametrize("argv, says", [
    (["--policy", "klass:tau=2"], "policy 'klass': tau=2 must lie in (0, 1]"),
    (["--policy", "klass:kll=0.1"], "policy 'klass' takes no argument kll; its arguments are: tau, kl, "),
    (["--policy", "credit:alpah=0.5"], "did you mean 'alpha'?"),
    (["--policy", "credit", "--policy-arg", "beta=2"], "policy 'credit': beta=2 must lie in [0, 1]"),
    (["--policy", "hierarchy:tau=nope"], "tau='nope' is not a number"),
    (["--policy", "less:drift=1"], "policy 'less': drift=1 must lie in [0, ln 2"),
    (["--policy", "eb:gamma=-1"], "policy 'eb': gamma=-1 must be a finite number >= 0"),
    (["--policy", "pc"], "policy 'pc' needs background (a PC-Sampler token-frequency table, or a bundled model's "
                         "name): pass policy_args={'background': ...} (on the command line: pc:background=...)"),
    (["--policy", "pc:background=nofile.json"], "background='nofile.json': no such file"),
    (["--policy", "klss"], "unknown policy 'klss'; known policies: confidence, credit, eb, "),
    (["--policy", "credit", "--window", "16"], "--policy credit keeps a memory per slot of a block, which a sliding "
                                               "window moves: use --block N (semi-AR blocks) or neither (the whole "
                                               "answer), not --window 16"),
    (["--policy", "klass", "--block", "8", "--temperature", "0.5"], "--policy klass decodes greedily, as its authors' "
                                                                    "code is checked here: drop --temperature 0.5"),
])
def test_bad_knobs_of_the_rules_since_fastdllm_are_one_line(argv, says, capsys):
    """Checked before the model loads, in the command line's words."""
    code = main(["generate", "--model", "testbed", "--prompt", "hi", "--gen-length", "16", "--quiet", *argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("tracelock generate: error: ") and says in err


def test_the_rules_since_fastdllm_decode_from_the_command_line(capsys):
    for spec in ("hierarchy:tau=none", "pc:background=testbed:per_step=2", "credit:tau=0.9:alpha=0.7",
                 "klass:kl=0.01"):
        assert main(["generate", "--model", "testbed", "--prompt", "Zoe has 9 books.", "--gen-length", "16",
                     "--block", "8", "--policy", spec, "--quiet"]) == 0
        record = json.loads(capsys.readouterr().out)
        assert record["settings"]["policy"] == spec.split(":")[0] and record["steps"] >= 1
    assert record["settings"]["policy_args"] == {"kl": 0.01}
