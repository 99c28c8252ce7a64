"""What a new user trips on in the first hour, one test per point: a missing extra named before anything runs, an op
implementation that cannot run here, one policy grammar, a busy machine, bad input refused before the model loads or
a point decodes, errors that name the fix, and what `generate` writes."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracelock
from tracelock import cli
from tracelock.cli_threads import threads_for_load
from tracelock.models.spec import CheckpointError
from tracelock.policy_specs import policy_and_args

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


@pytest.mark.parametrize(("quiet", "command", "said"), [(True, "demo", False), (False, "demo", True),
                                                        (False, "env", False), (False, "report", False)])
def test_the_busy_machine_notice_is_said_once_not_with_quiet_nor_for_commands_that_decode_nothing(
        capsys, monkeypatch, quiet, command, said):
    from tracelock import cli_threads
    from tracelock.cli_threads import NOTICE_ENV, apply_runtime_options
    from tracelock.progress import QUIET_ENV

    # what it sets for this process is put back afterwards: the quiet switch, the thread variables, torch's threads
    for name in (QUIET_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, os.environ.get(name, "1" if name != QUIET_ENV else "0"))
    monkeypatch.delenv(NOTICE_ENV, raising=False)
    monkeypatch.setattr(cli_threads, "machine_load", lambda cores: 64.0)  # a machine busy now
    threads = torch.get_num_threads()
    try:
        for _ in range(2):  # twice in one run (a process it starts): said once
            apply_runtime_options(type("Args", (), dict(quiet=quiet, threads=2, command=command))())
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().err.count("--threads 2 on a busy machine") == int(said)


def test_a_machine_that_becomes_busy_midway_is_called_out_once(monkeypatch, capsys):
    from tracelock import progress

    monkeypatch.setattr(progress, "_load_noticed", False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("TRACELOCK_LOAD_NOTICED", raising=False)
    monkeypatch.setenv(progress.QUIET_ENV, "1")
    assert progress.notice_oversubscription(load=3.4, cores=2) is None  # --quiet: silent
    monkeypatch.setenv(progress.QUIET_ENV, "0")
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
    assert exit_.value.code == 2 and "the following arguments are required: --sweep (or --policies SPEC,SPEC)" in \
        capsys.readouterr().err
    usage = " ".join(run_cli("frontier", "--help")[1].split("\n\n")[0].split())
    assert "[--sweep NAME[" in usage and "[--policies SPEC,SPEC]" in usage


def test_a_misspelt_model_name_lists_the_bundled_ones(capsys):
    code, err = main_in_process(["generate", "--model", "testbed-drem", "--prompt", "hi", "--policy", "threshold",
                                 "--gen-length", "16"], capsys)
    assert code == 2 and "did you mean 'testbed-dream'?" in err and "testbed, testbed-llada, testbed-dream" in err
    with pytest.raises(CheckpointError, match="model 'testbd' does not exist: did you mean 'testbed'"):
        tracelock.load_tokenizer("testbd")


def test_a_block_that_does_not_tile_suggests_the_nearest_fixes(capsys):
    code, err = cli_error(["generate", "--model", "testbed", "--prompt", "hi", "--policy", "threshold",
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


# ---- one grammar for every command, a Python API as careful as the CLI (and a safe echo of bad values, size
# bounds and leftovers)

_spec = importlib.util.spec_from_file_location("fuzzing", Path(__file__).with_name("fuzzing.py"))
fuzzing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzzing)
GEN = ["generate", "--model", "testbed", "--prompt", "hi", "--policy", "threshold"]


def cli_error(argv, capsys):
    """`tracelock ARGV` in this process, argparse's errors included: (exit status, stderr)."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def _commands():
    return cli.build_parser()._subparsers._group_actions[0]


@pytest.mark.parametrize("argv, says", [
    (GEN + ["--gen-length", "64", "--settings", "64/16"], "--settings 64/16 and --gen-length / --block: give the "
                                                          "setting once"),
    (GEN + ["--gen-length", "64", "--schedule", "window"], "spells the schedule --block W or --window W"),
    (["demo", "--settings", "64/16,128/32"], "this command runs one setting (--settings GEN/WIDTH, or --gen-length N "
                                             "--block W)"),
    (["serve", "--model", "testbed", "--settings", "64/16,128/32"], "one server runs one block width (--block W)"),
    (GEN + ["--gen-length", "8", "--policies", "threshold,confidence"], "decodes with one policy: --policy SPEC"),
])
def test_another_commands_option_is_named_in_this_ones_spelling(argv, says, capsys):
    code, err = cli_error(argv, capsys)
    assert code == 2 and says in err
    assert err.count("\n") == 1 and "usage:" not in err  # one line, as every other error


@pytest.mark.parametrize("command, required", [
    ("eval", ["--model", "testbed", "--tasks", "testbed:math", "--policies", "confidence", "--out", "o"]),
    ("frontier", ["--model", "testbed", "--tasks", "testbed:math", "--sweep", "threshold", "--out", "o"]),
    ("testbed-eval", ["--out", "o.json"]),
])
def test_the_commands_that_compare_settings_take_one_in_every_commands_spelling(command, required, capsys):
    def parse(*more):
        return cli.build_parser().parse_args([command, *required, *more])

    one, spelled = parse("--gen-length", "64", "--window", "16"), parse("--settings", "64/16", "--schedule", "window")
    assert (one.settings, one.schedule) == (spelled.settings, spelled.schedule) == ("64/16", "window")
    assert (parse("--gen-length", "64", "--block", "16").schedule, parse().schedule) == (
        "block", "block" if command == "testbed-eval" else "auto")
    for more, says in ((["--gen-length", "64"], "one setting is --gen-length N with --block W or --window W"),
                       (["--settings", "64/16", "--block", "16"], "not both"),
                       (["--schedule", "window", "--gen-length", "64", "--block", "16"], "drop --schedule")):
        code, err = cli_error([command, *required, *more], capsys)
        assert code == 2 and says in err


def test_one_list_grammar_for_policies_sweeps_and_the_server(capsys):
    from tracelock.eval.frontier import parse_sweep
    from tracelock.eval.runner import Setting, parse_policies
    from tracelock.serve.cli import serve_config

    policies = parse_policies("confidence,threshold:tau=0.9,0.5:hold_end=true,oracle")
    assert [p.label for p in policies] == ["confidence", "threshold:tau=0.9:hold_end=true",
                                           "threshold:tau=0.5:hold_end=true", "oracle"]
    # a sweep's points are what --policies runs for the same text
    points = parse_sweep("threshold:tau=0.9,0.5:hold_end=true").points(Setting(64, 16))
    assert [(p.name, p.args) for p in points] == [(p.name, p.args) for p in policies[1:3]]
    with pytest.raises(ValueError, match="'confidnce' is not a policy.*did you mean 'confidence'"):
        parse_policies("threshold:tau=0.9,confidnce")
    # one policy where the option is singular, the fix named
    with pytest.raises(ValueError, match="--policy takes one policy; 'threshold:tau=0.9,0.5' is 2: threshold:tau=0.9, "
                                         "threshold:tau=0.5 .*--policies"):
        policy_and_args("threshold:tau=0.9,0.5", [])
    # serve: --policies, and --policy as scripts have it (one spec; a list is the deprecated spelling)
    served = serve_config(cli.build_parser().parse_args(["serve", "--model", "testbed", "--policies",
                                                         "threshold:tau=0.9,confidence:per_step=2"]), 512)
    assert [p.label for p in served.policies] == ["threshold:tau=0.9", "confidence:per_step=2"]
    assert served.policies[1].policy_args(48) == {"steps": 24}  # per_step resolved per request's gen_length
    capsys.readouterr()
    old = serve_config(cli.build_parser().parse_args(["serve", "--model", "testbed", "--policy",
                                                      "threshold:tau=0.9,confidence"]), 512)
    assert [p.label for p in old.policies] == ["threshold:tau=0.9", "confidence"]
    assert "--policy with several policies is deprecated, use --policies" in capsys.readouterr().err
    one = serve_config(cli.build_parser().parse_args(["serve", "--model", "testbed", "--policy", "confidence"]), 512)
    assert [p.label for p in one.policies] == ["confidence"] and capsys.readouterr().err == ""
    with pytest.raises(ValueError, match=r"--policies confidence:per_step=3: .*give steps=N"):
        serve_config(cli.build_parser().parse_args(["serve", "--model", "testbed", "--block", "16", "--policies",
                                                    "confidence:per_step=3"]), 512)


def test_a_shared_option_is_described_in_the_same_words_everywhere():
    from tracelock.cli_options import OPTIONS, option_help

    seen = {}
    for command, parser in _commands().choices.items():
        for action in parser._actions:
            for option in set(action.option_strings) & set(OPTIONS):
                assert (action.help or "").startswith(option_help(option)), \
                    f"tracelock {command} {option}: {action.help!r} is not the shared help"
                seen.setdefault(option, set()).add(command)
    every = len(_commands().choices) - 1  # but lm-eval, whose options are lm-eval's
    assert set(seen) == set(OPTIONS) and len(seen["--model"]) >= 14 and len(seen["--threads"]) == every
    model = OPTIONS["--model"]
    assert "GSAI-ML/LLaDA-8B-Instruct" in model and "testbed-llada" in model and "testbed-dream" in model


def test_the_top_level_help_lists_the_commands_as_the_readme_groups_them():
    table = (ROOT / "README.md").read_text().split("## The command line at a glance")[1].split("\n\n")[1]
    readme = [n.strip() for line in table.splitlines()[2:] for n in line.split("|")[1].replace("`", "").split(", ")]
    listed = [a.dest for a in _commands()._choices_actions]
    # the README's order, tiny-checkpoint and env (a row of their own at the end) included
    assert [n for n in listed if n in readme] == [n for n in readme if n in listed]
    text = cli.build_parser().format_help()
    assert "``" not in text and "(default: $OMP_NUM_THREADS if set" in text


@pytest.fixture
def thread_rule(monkeypatch):
    """The API's thread rule afresh on a machine whose every core is busy with other work; torch's thread count put
    back afterwards."""
    from tracelock import api, cli_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(api, "_threads_checked", False)
    monkeypatch.setattr(cli_threads, "machine_load", lambda cores: float(cores))
    threads = torch.get_num_threads()
    yield api
    torch.set_num_threads(threads)


def test_the_api_lowers_torchs_default_threads_on_a_busy_machine_and_says_so_once(thread_rule, capsys):
    from tracelock.cli_threads import physical_cores

    cores = physical_cores()
    torch.set_num_threads(cores)  # torch's default: the count nobody chose
    model = tracelock.load_model("testbed")
    tracelock.fused_generate(model, [[5, 6, 7]], policy="threshold", gen_length=8)
    tracelock.reference_generate(model, [[5, 6, 7]], policy="threshold", gen_length=8)
    err = capsys.readouterr().err
    if cores > 1:
        assert err.count("\n") == 1 and f"using 1 torch thread instead of {cores}" in err
        assert "torch.set_num_threads(N) sets the count" in err and torch.get_num_threads() == 1
    else:
        assert err == ""


def test_the_api_keeps_a_chosen_thread_count_and_calls_it_out(thread_rule, capsys):
    from tracelock.cli_threads import physical_cores

    chosen = physical_cores() + 1
    torch.set_num_threads(chosen)
    assert f"torch.set_num_threads({chosen}) on a busy machine" in thread_rule.apply_thread_rule()
    assert torch.get_num_threads() == chosen and thread_rule.apply_thread_rule() is None  # said once
    assert "torch.set_num_threads(1) may well be faster" in capsys.readouterr().err


def test_the_api_leaves_the_threads_of_omp_num_threads_alone(thread_rule, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert thread_rule.apply_thread_rule() is None and capsys.readouterr().err == ""


def test_a_run_that_just_ended_does_not_cost_the_next_one_its_threads(monkeypatch):
    from tracelock import cli_threads

    def stat(busy, idle):
        return "cpu  9 9 9 9\n" + "".join(f"cpu{i} {busy} 0 0 {idle} 0 0 0 0\n" for i in range(2))

    assert cli_threads.busy_cores(stat(100, 100), stat(102, 198), {0, 1}, 2) == pytest.approx(0.04)
    assert cli_threads.busy_cores(stat(100, 100), stat(200, 100), {0, 1}, 2) == pytest.approx(2.0)
    # the 1-minute average still holds the run that just ended; the CPUs, sampled now, are idle: the sample wins
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 0.4))
    monkeypatch.setattr(cli_threads, "busy_cores", lambda *args: 0.1)
    assert cli_threads.machine_load(2) == 0.1 and threads_for_load(None, 2, 2, cli_threads.machine_load(2)) == (2, None)
    monkeypatch.setattr(cli_threads, "busy_cores", lambda *args: 1.9)  # busy now too: the rule applies
    assert threads_for_load(None, 2, 2, cli_threads.machine_load(2))[0] == 1


def test_python_near_misses_name_the_fix():
    model, tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    for generate in (tracelock.fused_generate, tracelock.reference_generate):
        with pytest.raises(ValueError, match=r"is the command line's spec; in Python .* policy='threshold', "
                                             r"policy_args=\{'tau': 0.9\}"):
            generate(model, [[5, 6]], policy="threshold:tau=0.9", gen_length=8)
    with pytest.raises(ValueError, match="unknown policy 'thresold'.*did you mean 'threshold'"):
        tracelock.fused_generate(model, [[5, 6]], policy="thresold", gen_length=8)
    with pytest.raises(TypeError, match="takes no argument taux; .*did you mean 'tau'"):
        tracelock.fused_generate(model, [[5, 6]], policy="threshold", policy_args={"taux": 0.9}, gen_length=8)
    with pytest.raises(ValueError, match=r"policy 'threshold': tau=1.5 must lie in \(0, 1\]"):
        tracelock.fused_generate(model, [[5, 6]], policy="threshold", policy_args={"tau": 1.5}, gen_length=8)
    with pytest.raises(TypeError, match=r"a tokenizer's whole output; pass its token ids.*\[enc\['input_ids'\]\]"):
        tracelock.fused_generate(model, tok("hi"), policy="threshold", gen_length=8)


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_thread_count_is_one_line(value, capsys):
    code, err = cli_error(["demo", "--threads", value], capsys)
    assert code == 2 and err.startswith("tracelock demo: error: argument --threads: ") and err.count("\n") == 1


@pytest.mark.parametrize("argv, says", [
    (["generate", "--model", "testbed", "--prompts", "none.jsonl", "--policy", "threshold", "--gen-length", "8"],
     "argument --prompts: 'none.jsonl': no such file"),
    (GEN + ["--gen-length", "8", "--model-dtype", "float16"],
     "--model-dtype float16 runs on CUDA only (--device cuda); on the CPU pass --model-dtype float32 or bfloat16"),
    (GEN[:-1] + ["threshold:tau=1.5", "--gen-length", "8"], "policy 'threshold': tau=1.5 must lie in (0, 1]"),
])
def test_rough_edges_say_the_option_and_the_fix(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli_error(argv, capsys)
    assert code == 2 and says in err and "Errno" not in err and "torch." not in err


@pytest.mark.parametrize("argv, meant", [
    (["genrate"], "generate"),
    (GEN + ["--gen-length", "8", "--cache", "dul"], "dual"),
    (GEN + ["--gen-length", "8", "--model-dtype", "bfloat"], "bfloat16"),
    (GEN[:-1] + ["thresold", "--gen-length", "8"], "threshold"),
    (GEN[:-1] + ["threshold:taux=0.9", "--gen-length", "8"], "tau"),
    (GEN + ["--gen-length", "8", "--gen-lenght", "8"], "--gen-length"),
    (["eval", "--model", "testbed", "--tasks", "gsm8:x.jsonl", "--policies", "confidence", "--out", "o"], "gsm8k"),
    (["eval", "--model", "testbed", "--tasks", "testbed:math", "--policies", "confidnce", "--out", "o"], "confidence"),
    (["eval", "--model", "testbed", "--tasks", "testbed:math@valdation", "--policies", "confidence", "--out", "o"],
     "validation"),
    (["eval", "--model", "testbed", "--tasks", "testbed:math", "--policies", "threshold:schedule=windw", "--out",
      "o"], "window"),
    (["demo", "--tasks", "testbed:mth"], "math"),
    (["demo", "--model", "testbed-drem"], "testbed-dream"),
])
def test_every_closed_set_of_names_says_which_was_meant(argv, meant, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli_error(argv, capsys)
    assert code == 2 and f"did you mean {meant!r}?" in err and err.count("\n") == 1, err
    from tracelock.eval.frontier import parse_sweep

    with pytest.raises(ValueError, match="did you mean 'tau'"):
        parse_sweep("threshold:tua=0.5,0.9")


def test_a_warning_is_one_note_once_and_quiet_hides_it(capsys, monkeypatch):
    import warnings

    from tracelock.progress import QUIET_ENV

    monkeypatch.setenv(QUIET_ENV, "0")
    for quiet, expected in ((False, "tracelock demo: note: partial sandbox: network isolation \\x1b[2J\n"), (True, "")):
        monkeypatch.setenv(QUIET_ENV, "1" if quiet else "0")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with cli._warnings_as_notes("demo"):
                for _ in range(2):
                    warnings.warn("partial sandbox: network isolation \x1b[2J", RuntimeWarning, stacklevel=1)
        assert capsys.readouterr().err == expected


def test_the_demo_prints_no_source_line_of_a_warning():
    """The sandbox's one warning (where the machine allows only a partial sandbox) was a RuntimeWarning with its
    source path and code line in every demo, --quiet or not."""
    code, _, err = run_cli("demo", "--tasks", "testbed:code", "--limit", "1", "--batch-size", "1")
    assert code == 0, err
    assert "RuntimeWarning" not in err and "sandbox.py" not in err and "warnings.warn" not in err
    code, _, err = run_cli("demo", "--tasks", "testbed:code", "--limit", "1", "--batch-size", "1", "--quiet")
    assert code == 0 and "partial sandbox" not in err


@pytest.mark.parametrize("argv", [
    GEN + ["--gen-length", "8", "--cache", "du\ral"],  # argparse's own error
    GEN[:-1] + ["thre\x1b[2Jshold", "--gen-length", "8"],  # tracelock's
    ["eval", "--model", "testbed", "--tasks", "testbed:math", "--policies", "confidence,0\x1b[2J", "--out", "o"],
    ["generate", "--model", "test\u202ebed", "--prompt", "hi", "--policy", "threshold", "--gen-length", "8"],
    ["demo", "--tasks", "testbed:\x1b]0;pwned\x07"],
])
def test_an_error_escapes_the_control_characters_of_the_value_it_names(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli_error(argv, capsys)
    assert code == 2 and err.count("\n") == 1
    fuzzing.assert_safe_echo(err)
    assert any(escape in err for escape in ("\\r", "\\x1b", "\\u202e")), err


@pytest.mark.parametrize("argv, says", [
    (["demo", "--limit", "1000000000"], "1000000000 is more than 10,000,000"),
    (["demo", "--gen-length", "1000000"], "pass at most 65536"),
    (["demo", "--limit", "50000"], "holds fewer than 20,000 distinct problems"),
    (GEN + ["--gen-length", "600"], "--gen-length 600: a generation length of 600 leaves no room for a prompt in the "
                                    "512 positions of --model testbed"),
    (GEN + ["--gen-length", "8", "--batch-size", "100000000"], "pass at most 65536"),
    (["eval", "--model", "testbed", "--tasks", "testbed:math", "--policies", "confidence", "--out", "o",
      "--settings", "100000/16"], "must look like GEN/WIDTH with both in 1..65536"),
    (["testbed-eval", "--out", "o.json", "--workers", "100000"], "pass at most"),
    (["train", "--cache", "c", "--out", "o", "--width", "10000000"], "pass at most 65536"),
    (["rl", "--model", "testbed", "--controller", "testbed", "--prompts", "testbed:math", "--out", "o",
      "--group-size", "100000"], "pass at most 256"),
    (["fit-encoder", "--traces", "t", "--model", "testbed", "--out", "o", "--max-positions", "100000000"],
     "pass at most 10000000"),
    (["collect", "--model", "testbed", "--prompts", "testbed:math", "--out", "o", "--shard-size", "100000000"],
     "pass at most 65536"),
    (["tiny-checkpoint", "--out", "o", "--shards", "100000"], "pass at most 64"),
    (["paper-tables", "--model", "testbed", "--controller", "testbed", "--out", "o", "--gen-lengths", "64,1000000"],
     "--gen-lengths 1000000: a generation length of 1000000 leaves no room"),
    (["report", "RUN", "--items", "1000000"], "pass at most 100"),
    (GEN + ["--gen-length", "8", "--seed", "99999999999999999999"], "past a 64-bit seed"),
    (["testbed-train", "--out", "o", "--workers", "100000"], "(processes); pass at most"),
])
def test_every_size_option_is_bounded_before_work_starts(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = cli_error(argv, capsys)
    assert code == 2 and says in err, err
    assert not any(tmp_path.iterdir()), "nothing is written before the check"


def test_sizes_bounded_by_the_machine_or_the_model_are_checked_before_it_loads():
    from tracelock.features_cli import check_max_positions
    from tracelock.serve.cli import serve_config
    from tracelock.tasks import held_out

    with pytest.raises(ValueError, match=r"--max-positions 1000000 holds .* more than half of this machine's 1 GiB"):
        check_max_positions("testbed", 1_000_000, memory=1 << 30)
    check_max_positions("testbed", 8192, memory=1 << 30)
    with pytest.raises(ValueError, match="holds fewer than 200,000 distinct problems"):
        held_out("math", "train", 10**9)  # at once, not after minutes of drawing
    for option, value, says in (("--max-batch", "1000000000", "--max-batch 1000000000 is more than 65,536"),
                                ("--max-tokens", "512", "--max-tokens 512 leaves no room for a prompt"),
                                ("--max-waiting", "10000000000", "is more than 10,000,000")):
        with pytest.raises(ValueError, match=says):
            serve_config(cli.build_parser().parse_args(["serve", "--model", "testbed", option, value]), 512)


def test_collect_checks_its_policy_before_the_model_loads(weightless, tmp_path, capsys):
    out = tmp_path / "traces"
    code, err = cli_error(["collect", "--model", str(weightless), "--prompts", "testbed:math", "--limit", "2",
                           "--out", str(out), "--policy", "threshold:tau=2"], capsys)
    assert code == 2 and "tau=2 must lie in (0, 1]" in err and "holds no weights" not in err
    assert not out.exists()
    code, err = cli_error(["collect", "--model", str(weightless), "--prompts", "testbed:math", "--limit", "2",
                           "--out", str(out), "--gen-length", "64", "--block", "24"], capsys)
    assert code == 2 and "--block 24 does not divide --gen-length 64" in err and not out.exists()
