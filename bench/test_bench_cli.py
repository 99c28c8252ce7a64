"""`tracelock --help` and every command's `--help`: the seconds a user waits (wall, the timed rows) and the child's
CPU seconds (extra_info), beside two yardsticks in the same group: the interpreter's own start (`python -c pass`)
and `python -c "import torch"`, the cost the help must not pay. tests/test_cli_grammar.py checks the behaviour (the
help is shown, with every default, and imports no torch); how fast it is on a machine is measured here, not asserted.
Each row runs its command once and checks the output before it times; without --benchmark that run is all.
"""

import resource
import statistics
import subprocess
import sys

import pytest

from tracelock.cli import build_parser

# `lm-eval` hands --help to lm-evaluation-harness's own command line (not tracelock's parser)
COMMANDS = sorted(set(build_parser()._subparsers._group_actions[0].choices) - {"lm-eval"})
ROWS = {"python -c pass": ["-c", "pass"], "python -c 'import torch'": ["-c", "import torch"],
        "tracelock --help": ["-m", "tracelock", "--help"],
        **{f"tracelock {c} --help": ["-m", "tracelock", c, "--help"] for c in COMMANDS}}


@pytest.mark.parametrize("row", list(ROWS))
def test_help(benchmark, machine, row):
    args, cpu = ROWS[row], []

    def run():
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        return done

    # check before timing: the command ran, and a help row printed the help
    done = run()
    assert done.returncode == 0, done.stderr
    if "--help" in args:
        assert done.stdout.startswith(f"usage: {row.removesuffix(' --help')}"), done.stdout[:200]
    benchmark.group = "cli-help"
    benchmark.extra_info.update(machine, command=row, cpu_seconds_first=cpu[0])
    if benchmark.disabled:
        return  # smoke run: the checked run above was this very call; --benchmark times it
    del cpu[:]
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    timed = cpu[1:]  # the rounds after the warm-up
    benchmark.extra_info.update(cpu_seconds_min=min(timed), cpu_seconds_median=statistics.median(timed))
