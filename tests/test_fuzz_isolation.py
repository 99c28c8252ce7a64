"""The fuzz tests' long-run harness (tests/fuzzing.py, `isolated`): each input in a fork of its own under a
wall-clock limit, so an input that hangs where the in-process alarm cannot reach (inside C code, with the signal
blocked) fails as a hang instead of holding the run, one that kills its process fails as a crash, and what the
input returns or raises comes back as it was. CI's fuzz runs stay in process (`bounded`); this checks the harness."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("fuzzing", Path(__file__).with_name("fuzzing.py"))
fuzzing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzzing)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() only")


class Odd(ValueError):
    """An exception that does not survive pickling (its constructor takes two arguments)."""

    def __init__(self, what, why):
        super().__init__(f"{what}: {why}")


def throw(err):
    raise err


def test_a_value_and_an_exception_come_back_as_they_were():
    assert fuzzing.isolated(lambda: {"tokens": [1, 2, 3]}, 60, "value") == {"tokens": [1, 2, 3]}
    assert fuzzing.isolated(os.getpid, 60, "pid") != os.getpid()  # it did run elsewhere
    with pytest.raises(ValueError, match="^gen_length=0 must be positive$"):
        fuzzing.isolated(lambda: throw(ValueError("gen_length=0 must be positive")), 60, "error")
    with pytest.raises(ValueError, match="^block: too wide$") as caught:  # unpicklable: its nearest built-in class
        fuzzing.isolated(lambda: throw(Odd("block", "too wide")), 60, "odd")
    assert type(caught.value) is ValueError
    with pytest.raises(TypeError, match="its value does not pickle"):  # an error of its own
        fuzzing.isolated(lambda: (lambda: None), 60, "lambda")


def test_a_hang_the_alarm_cannot_reach_is_killed_and_fails_with_its_output():
    def hang():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as C code that never returns to Python
        os.write(2, b"stuck in C\n")
        with fuzzing.time_limit(1, "the alarm"):
            time.sleep(120)

    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"hang ran for more than 2 s .* a hang.*stuck in C"):
        fuzzing.isolated(hang, 2, "hang")
    assert time.monotonic() - start < 100  # killed at its limit, not when its sleep ended


def test_a_hung_input_is_killed_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "grandchild"

    def start_and_hang():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        pid_file.write_text(str(child.pid))
        time.sleep(300)

    with pytest.raises(AssertionError, match="a hang"):
        fuzzing.isolated(start_and_hang, 10, "start and hang")
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # gone, or a zombie its new parent has not reaped yet
        try:
            state = Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hung input's own child {grandchild} still runs")


def test_an_input_that_kills_its_process_fails_as_a_crash():
    def crash():
        os.write(2, b"Fatal Python error: Aborted\n")
        os.abort()

    with pytest.raises(AssertionError, match=r"crash was ended by SIGABRT .* a crash.*Fatal Python error"):
        fuzzing.isolated(crash, 60, "crash")
    with pytest.raises(AssertionError, match=r"exit exited with status 3 before answering"):
        fuzzing.isolated(lambda: os._exit(3), 60, "exit")


def test_bounded_runs_in_process_unless_isolated(monkeypatch):
    monkeypatch.setattr(fuzzing, "ISOLATED", False)
    assert fuzzing.bounded(os.getpid, 60, "here") == os.getpid()
    monkeypatch.setattr(fuzzing, "ISOLATED", True)
    assert fuzzing.bounded(os.getpid, 60, "there") != os.getpid()
