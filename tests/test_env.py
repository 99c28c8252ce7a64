"""The environment report: ``python -m tracelock.env`` and ``tracelock env`` in subprocesses."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tracelock import env
from tracelock.ops import IMPLEMENTATIONS

# the facts, then one line per op: its implementation and, for a Triton kernel, its self-check
KEYS = ["tracelock", "python", "torch", "threads", "triton", "interpreter", "_C", "gpu", "transformers",
        *(f"op {op}" for op in IMPLEMENTATIONS)]


def test_env_report_keys():
    info = env.report()
    assert list(info) == KEYS
    assert all(isinstance(v, str) and v for v in info.values())


def _console_script():
    script = shutil.which("tracelock", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the tracelock console script is not installed next to this python")
    return [script]


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(lambda: [sys.executable, "-m", "tracelock.env"], id="python-m-tracelock.env"),
        pytest.param(lambda: [sys.executable, "-m", "tracelock", "env"], id="python-m-tracelock-env"),
        pytest.param(lambda: [*_console_script(), "env"], id="tracelock-env"),
    ],
)
def test_env_cli(command, tmp_path):
    done = subprocess.run(command(), capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == KEYS
