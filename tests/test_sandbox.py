"""tracelock.sandbox: real sandboxed subprocesses, no mocks."""

import json
import os
import signal
import socket
import sys
import tempfile
import time

import pytest

from tracelock import sandbox
from tracelock.sandbox import check_many, check_program, cpu_seconds_for, run_python

FEATURES = sandbox.probe_isolation()


def _survivors(marker: str, within: float = 3.0) -> list[int]:
    """Live (non-zombie) processes whose command line holds ``marker``, searched in the harness's /proc: a
    contained run sees its own PID namespace, so the pids it prints are not the host's. Waits up to ``within``
    seconds for them to go (a container's init may not reap orphans, hence zombies count as gone)."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
                continue
            if marker.encode() in cmdline and state != "Z":
                alive.append(int(entry))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_ok_program():
    r = run_python("print('hello')")
    assert (r.status, r.returncode, r.stdout, r.stderr) == ("ok", 0, "hello\n", "")
    assert r.seconds > 0  # how long it took is bench/test_bench_sandbox.py's to measure, not a bound here


def test_syntax_errors_are_classified_without_running():
    for source in ("def f(:\n    pass\n", "def f():\nreturn 1\n", "x = 1\0"):
        r = run_python(source)
        assert r.status == "syntax_error" and r.returncode is None, source
        assert "Error" in r.stderr


def test_runtime_error_and_failing_assert():
    r = run_python("raise ValueError('boom')")
    assert (r.status, r.returncode) == ("runtime_error", 1)
    assert r.stderr.rstrip().endswith("ValueError: boom")
    r = run_python("assert 1 + 1 == 3, 'bad sum'")
    assert r.status == "runtime_error" and "AssertionError: bad sum" in r.stderr


def test_wall_timeout_kills_the_process_group():
    src = ("import subprocess\np = subprocess.Popen(['sleep', '30.0101'])\nprint(p.pid, flush=True)\n"
           "while True:\n    pass\n")
    t0 = time.monotonic()
    r = run_python(src, timeout=1, cpu_seconds=10)
    assert r.status == "timeout" and r.returncode is None
    # the wall clock is the behaviour: killed at the 1 s timeout (about 1.05 s here), not when the child's 30 s sleep
    # lets go of the output pipe; 10 s is 10x the timeout, room for a busy machine, and still a third of that sleep
    assert time.monotonic() - t0 < 10
    assert len(r.stdout.split()) == 1, "the child was not started"
    assert not _survivors("30.0101"), "the sandboxed program's child survived the timeout"


def test_cpu_limit_kills():
    r = run_python("while True:\n    pass\n", timeout=10, cpu_seconds=1)
    assert r.status == "killed"  # not "timeout": the 1 s CPU limit ended it, not the 10 s wall clock
    assert r.returncode in (-signal.SIGXCPU, -signal.SIGKILL)


def test_cpu_limit_sits_above_the_wall_clock():
    # equal limits raced: on a loaded machine an endless loop's SIGXCPU could land before the harness polled its
    # deadline, and the run read "killed" instead of "timeout"
    assert [cpu_seconds_for(t) for t in (0.5, 1, 1.2, 10)] == [2, 2, 3, 11]
    r = run_python("while True:\n    pass\n", timeout=1)  # the default CPU limit: cpu_seconds_for(timeout)
    assert (r.status, r.returncode) == ("timeout", None)


def test_memory_bomb_fails():
    r = run_python("b = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert r.status == "killed" and "allocated" not in r.stdout
    assert "MemoryError" in r.stderr
    assert run_python("b = bytearray(64 * 1024**2)", memory_mb=256).status == "ok"  # the limit is not too tight


@pytest.mark.skipif(os.geteuid() == 0 and not FEATURES["drop_privileges"],
                    reason="running as root and cannot drop to nobody: the kernel ignores RLIMIT_NPROC for root")
def test_process_limit_stops_spawning_and_everything_is_cleaned_up():
    src = ("import subprocess\n"
           "for _ in range(50):\n"
           "    print(subprocess.Popen(['sleep', '30.0202']).pid, flush=True)\n")
    r = run_python(src, max_processes=4)
    # the refused fork raised in the program and nothing handled it: an exception, not a signal
    assert (r.status, r.returncode, r.signal) == ("runtime_error", 1, None), r
    assert r.stderr.rstrip().endswith("BlockingIOError: [Errno 11] Resource temporarily unavailable")
    assert 0 < len(r.stdout.split()) < 50
    assert not _survivors("30.0202"), "spawned children outlived the run"


def test_file_size_limit():
    src = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (5 << 20))\n"
    r = run_python(src, max_file_mb=1)
    assert r.status == "killed" and "File too large" in r.stderr
    assert run_python(src.replace("5 << 20", "512 << 10"), max_file_mb=1).status == "ok"


def test_fresh_working_directory_is_removed_and_environment_scrubbed(monkeypatch):
    monkeypatch.setenv("TRACELOCK_SANDBOX_CANARY", "leaked")
    src = "import json, os\nopen('scratch.txt', 'w').write('x')\nprint(json.dumps([os.getcwd(), dict(os.environ)]))"
    r = run_python(src)
    assert r.status == "ok", r.stderr
    cwd, env = json.loads(r.stdout)
    assert os.path.dirname(cwd) == tempfile.gettempdir() and cwd != os.getcwd()
    assert not os.path.exists(cwd), "the temporary working directory was not deleted"
    assert "TRACELOCK_SANDBOX_CANARY" not in env
    assert env == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
                   "PYTHONDONTWRITEBYTECODE": "1", "HOME": cwd}
    assert run_python("import sys\nprint(sys.stdin.read() == '')").stdout == "True\n"  # stdin gives nothing


def test_output_is_truncated():
    r = run_python("import sys\nprint('x' * 100000)\nsys.stderr.write('e' * 100000 + 'END')\nraise SystemExit(3)")
    assert r.status == "runtime_error" and r.returncode == 3
    assert len(r.stdout) < 2 * sandbox.OUTPUT_LIMIT and r.stdout.endswith("[... truncated]")
    assert len(r.stderr) < 2 * sandbox.OUTPUT_LIMIT and r.stderr.endswith("END")


@pytest.mark.skipif(not FEATURES["network_isolation"], reason="unshare(CLONE_NEWNET) is not permitted here")
def test_network_is_isolated():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        src = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\n"
        blocked = run_python(src)
        assert blocked.status == "runtime_error" and "OSError" in blocked.stderr, blocked
        assert run_python(src, network=True).status == "ok"  # control: the same connect works without isolation


def test_check_program_humaneval_style():
    tests = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 9\n"
    passing = check_program("def square(x):\n    return x * x\n", tests, entry_point="square")
    assert passing.status == "ok", passing.stderr
    failing = check_program("def square(x):\n    return x + x\n", tests, entry_point="square")
    assert failing.status == "runtime_error" and "AssertionError" in failing.stderr
    assert check_program("def square(x)\n    return x\n", tests, entry_point="square").status == "syntax_error"
    with pytest.raises(ValueError, match="entry_point"):
        check_program("", tests, entry_point="square); import os; (")


def test_check_many_keeps_order_and_runs_concurrently():
    # each job prints when it started and when it ended (the wall clock every process shares): concurrent means the
    # four were all running at once, every start before every end, however long the machine took. The starts lie
    # about 0.05 s apart on the idle 2-core machine; the 1 s sleep leaves 20x that. The speedup is
    # bench/test_bench_sandbox.py's to measure
    tests = "def check(candidate):\n    assert candidate() == {i}\n"
    jobs = [(f"import time\ndef f():\n    print(time.time(), flush=True)\n    time.sleep(1)\n    print(time.time())\n"
             f"    return {i}\n", tests.format(i=i if i != 2 else -1), "f") for i in range(4)]
    results = check_many(jobs, workers=4)
    assert [r.status for r in results] == ["ok", "ok", "runtime_error", "ok"]
    starts, ends = zip(*(map(float, r.stdout.split()) for r in results))
    assert max(starts) < min(ends), f"the jobs did not all run at once: started {starts}, ended {ends}"


def test_crash_signal_is_reported():
    r = run_python("import ctypes\nctypes.string_at(0)\n")  # a segfault in C code: no Python traceback
    assert (r.status, r.returncode, r.signal) == ("killed", -signal.SIGSEGV, "SIGSEGV"), r
    assert r.stderr.endswith("[tracelock: the program was killed by SIGSEGV]\n")
    assert run_python("print(1)").signal is None


@pytest.mark.skipif(not FEATURES["containment"], reason="neither mount and PID namespaces nor a user namespace "
                                                         "is permitted here")
def test_contained_run_has_its_own_processes_and_working_directory_and_no_home():
    home = os.path.realpath(os.path.expanduser("~"))
    src = ("import json, os\n"
           "open('scratch.txt', 'w').write('x')\n"
           "def ls(path):\n"
           "    try:\n"
           "        return sorted(os.listdir(path))\n"
           "    except OSError as err:\n"
           "        return type(err).__name__\n"
           "print(json.dumps({'pid': os.getpid(), 'proc': [p for p in os.listdir('/proc') if p.isdigit()],\n"
           f"                  'cwd': ls('.'), 'at': os.getcwd(), 'root': ls('/'), 'home': ls({home!r}),\n"
           "                  'tmp': ls('/tmp')}))\n")
    r = run_python(src)
    assert r.status == "ok", r.stderr
    seen = json.loads(r.stdout)
    # PID 2 of a namespace of its own under its init, and /proc says so
    assert seen["pid"] == 2 and seen["proc"] == ["1", "2"]
    assert seen["cwd"] == ["candidate.py", "scratch.txt"]
    # the tree holds the system's folders, the interpreter's and the run's own, nothing else of the machine
    interpreter = {os.path.realpath(p).split(os.sep)[1] for p in (sys.executable, sys.prefix, sys.base_prefix)}
    assert set(seen["root"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc",
                                 "tmp"} | interpreter | {os.path.abspath(sys.executable).split(os.sep)[1]}, seen
    assert {"home", "var", "run", "srv", "mnt", "opt", "sys"}.isdisjoint(set(seen["root"]) - interpreter), seen
    # the harness user's home is absent, or holds only the folders on the way to the interpreter
    on_the_way = {os.path.relpath(p, home).split(os.sep)[0] for path in (sys.executable, sys.prefix, sys.base_prefix)
                  for p in (os.path.abspath(path), os.path.realpath(path)) if p.startswith(home + os.sep)}
    assert seen["home"] == (sorted(on_the_way) if on_the_way else "FileNotFoundError"), seen
    # /tmp holds only the way to the run's own directory (and to the interpreter, if it lives there): no other
    # run's, no file the harness left there
    ways = [seen["at"]] + [os.path.realpath(p) for p in (sys.executable, sys.prefix, sys.base_prefix)]
    assert set(seen["tmp"]) == {p.split(os.sep)[2] for p in ways if p.startswith("/tmp/")}, seen
    for path in ("/tmp/tracelock-contained-probe", os.path.join(os.getcwd(), "tracelock-contained-probe"),
                 os.path.join(home, "tracelock-contained-probe")):
        r = run_python(f"open({path!r}, 'w').write('x')")
        # the read-only tree refuses, or the folder is not there at all
        refused = "Read-only file system" in r.stderr or "No such file or directory" in r.stderr
        assert r.status == "runtime_error" and refused, (path, r)
        assert not os.path.exists(path)


def test_check_program_needs_the_tests_to_finish():
    tests = "def check(candidate):\n    assert candidate(2) == 5\n"
    for early_exit in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"):
        r = check_program(f"def f(x):\n    {early_exit.replace(chr(10), chr(10) + '    ')}\n", tests, entry_point="f")
        assert r.status == "runtime_error" and r.returncode == 0, (early_exit, r)
        assert "exited with code 0 before its tests finished" in r.stderr
    r = check_program("import sys\ndef f(x):\n    sys.stderr.write('note\\n')\n    return 5\n", tests, entry_point="f")
    assert (r.status, r.stderr) == ("ok", "note\n")  # the end-of-tests line is taken out again
