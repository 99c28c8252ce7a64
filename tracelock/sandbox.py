"""Sandboxed execution of generated Python code (DESIGN.md §8), never in the harness process: a fresh interpreter
per program with resource limits, its own process group, no network where the kernel allows, a scrubbed environment,
closed stdin and a temporary working directory. A root harness drops the child to ``nobody`` (RLIMIT_NPROC is not
enforced for root)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["RunResult", "run_python", "check_program", "check_many", "probe_isolation", "NETWORK_ISOLATION"]

OUTPUT_LIMIT = 4096  # bytes kept per stream: enough for a traceback, small enough for thousands of results
NETWORK_ISOLATION: bool | None = None  # None until probed; False: unshare(CLONE_NEWNET) is not permitted here
DROP_PRIVILEGES: bool | None = None  # True: the harness is root and the child can switch to nobody

_libc = ctypes.CDLL(None, use_errno=True)  # loaded now: preexec_fn runs between fork and exec
_CLONE_NEWNET, _CAP_DAC_READ_SEARCH, _CAPABILITY_VERSION_3 = 0x40000000, 2, 0x20080522
_PR_SET_KEEPCAPS, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 8, 38, 47, 2
_NOBODY = (65534, 65534)  # uid, gid of nobody/nogroup on Linux; any unprivileged id works, listed or not
# last traceback lines that mean a resource limit, not a bug: RLIMIT_AS, RLIMIT_FSIZE (EFBIG), RLIMIT_NPROC (EAGAIN)
_RESOURCE_ERRORS = ("MemoryError", "OSError: [Errno 27]", "BlockingIOError: [Errno 11]")
# WNOWAIT peeks without reaping: the zombie keeps its pid (= the process group id) from reuse until killpg
_PEEK = os.WEXITED | os.WNOHANG | os.WNOWAIT
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
_probe_lock, _compile_lock = threading.Lock(), threading.Lock()


@dataclass
class RunResult:
    """Outcome of one sandboxed run.

    ``status``: "ok", "syntax_error", "runtime_error" (exception, failed assert, exit != 0), "timeout" (wall clock)
    or "killed" (signal or resource limit: SIGXCPU, MemoryError, file too large, fork refused). ``returncode``:
    None when the program never ran or hit the wall timeout; negative: the signal that killed it.
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"{what} failed")


def _drop_privileges() -> None:
    # Keep only CAP_DAC_READ_SEARCH, ambient so it survives exec: the interpreter may live where only root can
    # enter (here /root/.pyenv). Nothing root owns is writable; no_new_privs stops setuid binaries restoring root.
    _check(_libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setresgid(*(_NOBODY[1],) * 3)
    os.setresuid(*(_NOBODY[0],) * 3)
    mask = 1 << _CAP_DAC_READ_SEARCH  # capset(2) v3: header {version, pid}, data[2] {effective, permitted, inh.}
    header, data = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0), (ctypes.c_uint32 * 6)(mask, mask, mask, 0, 0, 0)
    _check(_libc.capset(header, data), "capset")
    _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_DAC_READ_SEARCH, 0, 0), "prctl(PR_CAP_AMBIENT)")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def probe_isolation() -> dict[str, bool]:
    """Find out, once per process, which isolation features this machine permits.

    Returns:
        ``{"network_isolation": bool, "drop_privileges": bool}``, also kept in the module-level flags.
    """
    global NETWORK_ISOLATION, DROP_PRIVILEGES

    def works(fn) -> bool:  # tried in a real child: seccomp or namespace policy can refuse what root may do
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run([sys.executable, "-S", "-c", ""], preexec_fn=fn, env={}, timeout=30).returncode == 0
        return False

    with _probe_lock:
        if NETWORK_ISOLATION is None:
            DROP_PRIVILEGES = os.geteuid() == 0 and works(_drop_privileges)
            NETWORK_ISOLATION = works(lambda: _check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)"))
            if not NETWORK_ISOLATION or (os.geteuid() == 0 and not DROP_PRIVILEGES):  # said once per process
                warnings.warn(f"partial sandbox: network isolation {NETWORK_ISOLATION}, root dropped {DROP_PRIVILEGES} "
                              "(else max_processes is not enforced)", RuntimeWarning, stacklevel=2)
    return {"network_isolation": NETWORK_ISOLATION, "drop_privileges": DROP_PRIVILEGES}


def _syntax_error(source: str) -> str | None:
    # Compiling executes nothing and is far cheaper than a process. dont_inherit keeps this module's __future__
    # flags out; the lock because catch_warnings (silencing SyntaxWarning here) is not thread-safe.
    try:
        with _compile_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(source, "<candidate>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        return "".join(traceback.format_exception_only(exc))
    except (RecursionError, MemoryError):  # pathological input: let the sandboxed child report it
        pass
    return None


def _lowered(which: int, soft: int, hard: int | None = None) -> tuple[int, tuple[int, int]]:
    # never above the harness's own hard limit: the child is no longer root when it applies these
    hard, cap = soft if hard is None else hard, resource.getrlimit(which)[1]
    return which, tuple(v if cap == resource.RLIM_INFINITY else min(v, cap) for v in (soft, hard))


def _collect(proc: subprocess.Popen, timeout: float) -> tuple[str, str, bool]:
    """Read both pipes until EOF or the deadline; keep the head of stdout and the tail of stderr (the traceback)."""
    deadline, out, err, timed_out = time.monotonic() + timeout, bytearray(), bytearray(), False
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            while sel.get_map():
                if os.waitid(os.P_PID, proc.pid, _PEEK):  # exited, but leftover children may hold the pipes open
                    with contextlib.suppress(OSError):
                        os.killpg(proc.pid, signal.SIGKILL)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = os.waitid(os.P_PID, proc.pid, _PEEK) is None
                    break
                for key, _ in sel.select(min(remaining, 0.05)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.data is out:
                        out += chunk[: max(0, OUTPUT_LIMIT + 1 - len(out))]
                    else:
                        err += chunk
                        del err[: max(0, len(err) - OUTPUT_LIMIT - 1)]
    finally:  # also on errors and KeyboardInterrupt: nothing may outlive the run
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()  # the caller's `with Popen` closes the pipes
    out = out[:OUTPUT_LIMIT] + b"\n[... truncated]" if len(out) > OUTPUT_LIMIT else out
    err = b"[truncated ...]\n" + err[-OUTPUT_LIMIT:] if len(err) > OUTPUT_LIMIT else err
    return out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), timed_out


def run_python(source: str, *, timeout: float = 5.0, cpu_seconds: int = 5, memory_mb: int = 512,
               max_processes: int = 16, max_file_mb: int = 1, network: bool = False) -> RunResult:
    """Run untrusted Python source in a fresh sandboxed subprocess.

    Args:
        source: the program; written to a file in the run's temporary directory, never put on a command line.
        timeout: wall-clock seconds before the whole process group is killed (status "timeout").
        cpu_seconds: RLIMIT_CPU; SIGXCPU at the limit, SIGKILL one second later (status "killed").
        memory_mb: RLIMIT_AS in MiB (the interpreter itself needs about 30).
        max_processes: RLIMIT_NPROC; it counts all processes and threads of the child's user: ``nobody`` (shared
            by concurrent runs) when the harness is root, else the harness's own user.
        max_file_mb: RLIMIT_FSIZE in MiB, the largest file the program may write.
        network: False: an empty network namespace where permitted (``NETWORK_ISOLATION``); True: untouched.

    Returns:
        A RunResult; stdout and stderr are cut to ``OUTPUT_LIMIT`` bytes (head of stdout, tail of stderr).
    """
    if timeout <= 0 or min(cpu_seconds, memory_mb, max_processes, max_file_mb) < 1:
        raise ValueError("timeout must be > 0 and cpu_seconds, memory_mb, max_processes, max_file_mb >= 1")
    start = time.perf_counter()
    if (error := _syntax_error(source)) is not None:
        return RunResult("syntax_error", None, "", error, time.perf_counter() - start)
    probe_isolation()
    isolate, drop = not network and NETWORK_ISOLATION, DROP_PRIVILEGES
    # RLIMIT_AS last: the forked child still has the parent's large address space until exec
    limits = [_lowered(resource.RLIMIT_CORE, 0), _lowered(resource.RLIMIT_CPU, cpu_seconds, cpu_seconds + 1),
              _lowered(resource.RLIMIT_NPROC, max_processes), _lowered(resource.RLIMIT_FSIZE, max_file_mb << 20),
              _lowered(resource.RLIMIT_AS, memory_mb << 20)]

    def preexec() -> None:
        os.setsid()  # own process group, so killpg reaches every descendant that did not leave it
        os.umask(0o077)
        if isolate:  # fail closed: isolation was requested and probed as available
            _check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        if drop:
            _drop_privileges()  # after the unshare, which needs root
        for which, value in limits:
            resource.setrlimit(which, value)

    workdir = tempfile.mkdtemp(prefix="tracelock-sandbox-")
    try:
        path = os.path.join(workdir, "candidate.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        if drop:  # nobody must be able to read the source and write in its working directory
            os.chown(workdir, *_NOBODY)
        # -S -s -P rather than -I: -I implies -E, which would ignore PYTHONHASHSEED
        with subprocess.Popen([sys.executable, "-S", "-s", "-B", "-P", path], cwd=workdir, env=dict(_ENV, HOME=workdir),
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=preexec, close_fds=True) as proc:
            stdout, stderr, timed_out = _collect(proc, timeout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rc, last = (None if timed_out else proc.returncode), (stderr.strip().splitlines() or [""])[-1]
    status = ("timeout" if timed_out else "ok" if rc == 0 else
              "killed" if rc < 0 or last.startswith(_RESOURCE_ERRORS) else "runtime_error")
    return RunResult(status, rc, stdout, stderr, time.perf_counter() - start)


def check_program(program: str, tests: str, *, entry_point: str | None = None, timeout: float = 5.0,
                  **limits) -> RunResult:
    """Run a program followed by its tests in one sandboxed process (HumanEval style).

    Args:
        program: the candidate program (for HumanEval: prompt + completion).
        tests: test code; HumanEval's defines ``check(candidate)`` and asserts inside it.
        entry_point: when given, ``check(<entry_point>)`` is appended and called.
        timeout, **limits: as for ``run_python`` (cpu_seconds, memory_mb, max_processes, max_file_mb, network).

    Returns:
        The RunResult; status "ok" means the program and every assert ran without error.
    """
    if entry_point is not None and not entry_point.isidentifier():
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    call = f"\ncheck({entry_point})\n" if entry_point else ""
    return run_python(f"{program}\n\n{tests}\n{call}", timeout=timeout, **limits)


def check_many(jobs: list[tuple[str, str, str | None]], *, workers: int = 2, timeout: float = 5.0,
               **limits) -> list[RunResult]:
    """Run ``(program, tests, entry_point)`` jobs concurrently, each in its own sandboxed process.

    Args:
        jobs: the jobs, as for ``check_program``.
        workers: how many subprocesses run at once (the threads only wait on them, so the GIL is no bottleneck).
        timeout, **limits: per job, as for ``run_python``.

    Returns:
        One RunResult per job, in input order.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    probe_isolation()  # once, before the threads race for it
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda j: check_program(j[0], j[1], entry_point=j[2], timeout=timeout, **limits), jobs))
