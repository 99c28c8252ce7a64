"""What the property-based fuzz tests (tests/test_fuzz_*.py, hypothesis) share: how many inputs they generate, and
what counts as a clear rejection.

CI runs a bounded number of inputs per test (each test's ``ci`` count, seeded: the same inputs every run);
``TRACELOCK_FUZZ_EXAMPLES=N`` runs N per test instead (docs/faults.md has the long run's command and figures), each
input in a process of its own under a wall-clock limit (`bounded`, `isolated`), so a hang inside C code fails too.
A rejection is clear when it is a ValueError or TypeError (or a RuntimeError, as tracelock raises for a backend
that cannot run here) whose message is one line naming the argument at fault; anything else (an IndexError from
inside torch, a message that names no argument, a hang) fails the test with the input that caused it. And a rejection
echoes safely: a value it names is written with its control characters escaped (`assert_safe_echo`), so a value that
holds a carriage return or an escape sequence cannot rewrite the user's terminal.
"""

import contextlib
import faulthandler
import os
import pickle
import re
import select
import signal
import tempfile
import time
import unicodedata

from hypothesis import HealthCheck, settings

LONG_RUN = int(os.environ.get("TRACELOCK_FUZZ_EXAMPLES", "0"))
CLEAR_TYPES = (ValueError, TypeError, RuntimeError)


def fuzz_settings(ci: int):
    """Hypothesis settings of a fuzz test: ``ci`` inputs (or TRACELOCK_FUZZ_EXAMPLES), derandomized so CI sees the
    same inputs every run, no example database written into the checkout, no per-input deadline (a shared machine's
    stalls are not hangs: `time_limit` catches those)."""
    return settings(max_examples=LONG_RUN or ci, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


def assert_clear(err: BaseException, names) -> None:
    """``err`` is a clear rejection: a ValueError / TypeError / RuntimeError whose message is one line and names one
    of ``names`` (the arguments, fields or options that could be at fault)."""
    message = str(err)
    assert isinstance(err, CLEAR_TYPES), f"a raw {type(err).__name__}: {message}"
    assert message and "\n" not in message.strip(), f"not one line: {message!r}"
    named = [n for n in names if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w])", message)]
    assert named, f"names none of {sorted(names)}: {type(err).__name__}: {message}"
    assert_safe_echo(message)


# what a terminal acts on: control characters (a carriage return, an escape sequence), format characters (a
# right-to-left override), line and paragraph separators
UNSAFE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")


def assert_safe_echo(line: str) -> None:
    """An error line holds no character a terminal acts on (`UNSAFE_CATEGORIES`) but the newline that ends it: a
    value it names is escaped (``'0\\r'``, ``0\\x1b[2J``), not echoed raw."""
    raw = [c for c in line.rstrip("\n") if unicodedata.category(c) in UNSAFE_CATEGORIES]
    fix = "escape it, e.g. with repr or tracelock.cli_parser.safe_echo"
    assert not raw, f"echoes {''.join(raw)!r} raw ({fix}): {line!r}"


def echoed(value: str) -> str:
    """``value`` as a safe error line writes it: control and format characters as their escapes."""
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in UNSAFE_CATEGORIES else c
                    for c in value)


@contextlib.contextmanager
def time_limit(seconds: int, what: str):
    """Fail (instead of hanging the run) when the body takes longer than ``seconds``; main thread only."""
    def expired(signum, frame):
        raise AssertionError(f"{what} ran for more than {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---- the long run: each input in a process of its own ----------------------------------------------------------
# An alarm (`time_limit`) raises only when Python code runs again: an input that hangs inside C code (the tokenizers
# library, torch's allocator) held the in-process run past any limit. In the long run (TRACELOCK_FUZZ_EXAMPLES, or
# TRACELOCK_FUZZ_ISOLATE=1) each input runs in a fork of the test process instead, under a wall-clock limit: a child
# still running at its limit is killed with everything it started and fails the test as a hang, one that dies of a
# signal (an abort inside a library) as a crash, each with its input (hypothesis prints it). CI keeps the bounded
# in-process run: a fork per input costs little, but the alarm is enough for its inputs.
ISOLATED = os.environ.get("TRACELOCK_FUZZ_ISOLATE", "1" if LONG_RUN else "0") == "1"


def bounded(fn, seconds: int, what: str):
    """``fn()`` under a time limit: in this process (`time_limit`) in CI, in a child of its own (`isolated`) in the
    long run; its value, or the exception it raised."""
    if ISOLATED:
        return isolated(fn, seconds, what)
    with time_limit(seconds, what):
        return fn()


def _portable(err: BaseException) -> BaseException:
    """``err``, or (when it does not survive pickling) the nearest built-in exception class with its message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        builtin = next(c for c in type(err).__mro__ if c.__module__ == "builtins")
        return builtin(str(err))


def isolated(fn, seconds: float, what: str):
    """``fn()`` in a fork of this process, killed (its process group with it) when it runs ``seconds`` of wall clock;
    returns its value or raises the exception it raised (pickled across). A child killed at the limit, or ended by a
    signal, fails with AssertionError saying which, and what the child wrote to its stdout and stderr at the file
    descriptor level (a C library's own message)."""
    read_end, write_end = os.pipe()
    output = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test run
        try:
            os.setpgid(0, 0)  # a group of its own: what it starts is killed with it
            os.close(read_end)
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
            if faulthandler.is_enabled():  # pytest's writes to its own copy of stderr: a crash's stack goes here
                faulthandler.enable(file=2)
            try:
                value = fn()
            except BaseException as err:  # noqa: BLE001 -- every exception goes back to the parent
                outcome = pickle.dumps(("raised", _portable(err)))
            else:
                try:
                    outcome = pickle.dumps(("value", value))
                except Exception as err:
                    outcome = pickle.dumps(("raised", TypeError(f"{what}: its value does not pickle: {err}")))
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(outcome)
        finally:
            os._exit(0)
    os.close(write_end)
    with contextlib.suppress(OSError):  # the child may have done it first, or already be gone
        os.setpgid(pid, pid)
    chunks, deadline, killed = [], time.monotonic() + seconds, False
    with os.fdopen(read_end, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                killed = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                break
            chunk = os.read(pipe.fileno(), 1 << 20)
            if not chunk:  # the child closed its end: done (or gone)
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    output.seek(0)
    written = output.read().decode(errors="replace")
    if len(written) > 4000:  # a library's message first, a stack dump last
        written = f"{written[:2000]} ... {written[-2000:]}"
    output.close()
    if killed:
        raise AssertionError(f"{what} ran for more than {seconds} s (wall clock) in a process of its own and was "
                             f"killed: a hang. Its output: {written!r}")
    if os.WIFSIGNALED(status) or not chunks:
        how = (f"was ended by {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
               else f"exited with status {os.waitstatus_to_exitcode(status)} before answering")
        raise AssertionError(f"{what} {how} in a process of its own: a crash. Its output: {written!r}")
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "raised":
        raise value
    return value
