"""Property-based fuzzing of every `tracelock` command's options: for each subcommand, argument lists built from its
own parser (each option now and then, with a fitting value, a value of the wrong kind, out of range, empty, a path
that does not exist, an empty folder or a file of garbage). A command either runs (it is stopped after a few seconds:
what is fuzzed is how options are refused, not the jobs) or stops with a clear error: argparse's usage error or
tracelock's one line ``tracelock CMD: error: ...`` naming an option it was given or the value at fault; never a
traceback. `tracelock serve`'s options are checked up to its server (`serve_config`), which would otherwise run
until stopped; `lm-eval` hands its arguments to lm-evaluation-harness untouched and is left out. In the long run
(``TRACELOCK_FUZZ_EXAMPLES``) each command runs in a fork of its own (tests/fuzzing.py, `isolated`): one that does
not stop within STOP_SECONDS of its stop signal (inside C code), or that dies of a signal, fails with its options."""

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import tracelock
import tracelock.cli
from tracelock.cli import build_parser

_spec = importlib.util.spec_from_file_location("fuzzing", Path(__file__).with_name("fuzzing.py"))
fuzzing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzzing)

pytestmark = pytest.mark.usefixtures("one_thread")

RUN_SECONDS = 8  # a command still running after this accepted its options
# the long run (fuzzing.ISOLATED): a command in a process of its own that has not stopped this long after its stop
# signal is a hang (inside C code, where the signal cannot reach Python), killed and failed with its options
STOP_SECONDS = 60
# import what the commands import lazily now: a command stopped in the middle of an import would leave a half-made
# module behind for the next one (an ImportError of the harness, not of the command)
tracelock.load_tokenizer("testbed")
importlib.import_module("matplotlib.pyplot")
SUBPARSERS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
COMMANDS = sorted(c for c in SUBPARSERS if c != "lm-eval")


class StillRunning(BaseException):  # noqa: N818 -- not an error: the command accepted its options
    """Raised into a command that runs past RUN_SECONDS (a BaseException, so the command's handlers let it by)."""


def value_for(action, folder: Path):
    """A strategy of values for one option: fitting ones and wrong ones."""
    paths = st.sampled_from([str(folder / "missing"), str(folder / "empty"), str(folder / "garbage.json"),
                             str(folder / "out")])
    wrong = st.one_of(st.sampled_from(["", "-1", "0", "nan", "x", "1e99", "-", "none"]),
                      st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=8))
    if action.choices:
        return st.one_of(st.sampled_from(sorted(map(str, action.choices))), wrong)
    kind = getattr(action.type, "__name__", "")
    if action.type is float or "float" in kind:
        return st.one_of(st.floats(-1, 10).map(str), wrong)
    if action.type is int or "int" in kind:
        return st.one_of(st.integers(-2, 6).map(str), st.sampled_from(["1000000000", "99999999999999999999"]),
                         wrong)
    dest = action.dest
    if dest in ("model", "backbone"):
        return st.one_of(st.just("testbed"), paths, wrong)
    if dest in ("tasks", "task"):
        return st.one_of(st.sampled_from(["testbed:math", "testbed:code", "gsm8k", "testbed:math,nope"]), wrong)
    if dest in ("policy", "policies"):
        return st.one_of(st.sampled_from(["confidence", "threshold:tau=0.9", "tracelock", "nope", "threshold:tau=x"]),
                         wrong)
    return st.one_of(paths, wrong, st.sampled_from(["testbed", "1", "cpu", "64/16"]))


@st.composite
def command_line(draw, folder: Path):
    """(command, argv) for one subcommand: its required options always, the others now and then."""
    command = draw(st.sampled_from(COMMANDS))
    argv = [command]
    for action in SUBPARSERS[command]._actions:
        if isinstance(action, argparse._HelpAction) or action.dest == "help":
            continue
        if not action.option_strings:  # a positional
            if action.nargs in ("*", "?") and draw(st.booleans()):
                continue
            argv.append(draw(value_for(action, folder)))
            continue
        if not action.required and draw(st.floats(0, 1)) > 0.3:
            continue
        option = draw(st.sampled_from(action.option_strings))
        if action.nargs == 0:  # a switch
            argv.append(option)
        elif action.nargs == "?" and draw(st.booleans()):
            argv.append(option)
        else:
            value = draw(value_for(action, folder))
            argv.append(f"{option}={value}" if value.startswith("-") else option)
            if not value.startswith("-"):
                argv.append(value)
    return command, argv


def run(argv: list) -> tuple:
    """(exit status or "running", stderr) of ``tracelock *argv`` in this process, stopped after RUN_SECONDS."""
    environ, threads = dict(os.environ), torch.get_num_threads()

    def stop(signum, frame):
        raise StillRunning

    previous = signal.signal(signal.SIGALRM, stop)
    err, out = io.StringIO(), io.StringIO()
    signal.alarm(RUN_SECONDS)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            status = tracelock.cli.main(argv)
    except SystemExit as exit:  # argparse
        status = exit.code
    except StillRunning:
        status = "running"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    return status, err.getvalue()


def serve_options(argv: list) -> tuple:
    """`tracelock serve`'s checks before it listens (`serve_config`): (0 or 2, the error line)."""
    from tracelock.serve.cli import serve_config

    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            args = build_parser().parse_args(argv)
    except SystemExit as exit:
        return exit.code, err.getvalue()
    try:
        serve_config(args, max_positions=512)
    except ValueError as error:
        return 2, f"tracelock serve: error: {error}\n"
    return 0, ""


@fuzzing.fuzz_settings(ci=100)
@given(data=st.data())
def test_every_command_runs_or_names_the_bad_option(data):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "empty").mkdir()
        (folder / "garbage.json").write_bytes(b"\x00{not json at all")
        command, argv = data.draw(command_line(folder), label="argv")
        cwd = os.getcwd()
        os.chdir(folder)  # a relative --out ("1", "", ...) lands in the scratch folder, not in the checkout
        try:
            check = (lambda: serve_options(argv)) if command == "serve" else (lambda: run(argv))
            if fuzzing.ISOLATED:
                status, stderr = fuzzing.isolated(check, RUN_SECONDS + STOP_SECONDS, f"tracelock {shlex.join(argv)}")
            else:
                status, stderr = check()
        finally:
            os.chdir(cwd)
    assert "Traceback" not in stderr, stderr
    event(f"exit {status}")  # pytest --hypothesis-show-statistics: how the inputs ended
    if status in (0, None, "running"):
        return
    # a progress bar may redraw itself (carriage returns) before the error line; a value given may hold one itself
    errors = [line for line in stderr.split("\n") if "error:" in line]
    assert errors, f"exit {status} without an error line: {stderr!r}"
    last = errors[-1]
    start = re.search(r"tracelock[\w -]*: error: ", last)  # after a progress bar's carriage returns, if any
    fuzzing.assert_safe_echo(last[start.start():] if start else last)  # a value it names is escaped, not raw
    own = re.search(r"tracelock [\w-]+: error: (.*)", last)
    if own:  # tracelock's own line (argparse's names its option itself): names an option or the value
        message = own[1]
        options = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")]
        # the option as given, or as the keyword it becomes (device='' names --device); a value given
        values = [a for a in argv[1:] if len(a) >= 3] + [a.split("=", 1)[1] for a in argv[1:] if "=" in a]
        given_ = [fuzzing.echoed(v) for v in values if v] + options + [o[2:].replace("-", "_") for o in options]
        # a value named first ("0\\r holds no encoder ...", escaped) counts however short it is
        named = [g for g in given_ if g in message] + [v for v in argv[1:] if repr(v) in message] + \
            [v for v in argv[1:] if v and message.startswith(fuzzing.echoed(v) + " ")]
        # argparse's own "the following arguments are required: run" names a positional argument the input lacks
        required = "the following arguments are required:" in message
        assert named or required or re.search(r"--[a-z]", message), \
            f"names no option nor value given: {last} (argv {argv})"
