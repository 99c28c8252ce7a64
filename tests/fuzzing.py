"""What the property-based fuzz tests (tests/test_fuzz_*.py, hypothesis) share: how many inputs they generate, and
what counts as a clear rejection.

CI runs a bounded number of inputs per test (each test's ``ci`` count, seeded: the same inputs every run);
``TRACELOCK_FUZZ_EXAMPLES=N`` runs N per test instead (docs/faults.md has the long run's command and figures).
A rejection is clear when it is a ValueError or TypeError (or a RuntimeError, as tracelock raises for a backend
that cannot run here) whose message is one line naming the argument at fault; anything else (an IndexError from
inside torch, a message that names no argument, a hang) fails the test with the input that caused it. And a rejection
echoes safely: a value it names is written with its control characters escaped (`assert_safe_echo`), so a value that
holds a carriage return or an escape sequence cannot rewrite the user's terminal.
"""

import contextlib
import os
import re
import signal
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
    assert not raw, f"echoes {''.join(raw)!r} raw (escape it, e.g. with repr or tracelock.cli_common.safe_echo): {line!r}"


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
