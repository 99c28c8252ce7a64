"""`run_sandboxed`: the stable script API for running generated Python code, a thin layer over `tracelock.sandbox`.

The code runs in a separate, resource-limited process (never in the caller's), with a scrubbed environment, no
network, a process budget of its own, no capability, its own PID namespace and a read-only file tree of its own that
holds the system's folders and the interpreter only, for a root harness and any other alike. Where the kernel
refuses that containment, the code runs only on the user's explicit opt-in (``TRACELOCK_ALLOW_UNCONTAINED_CODE=1``)
and `tracelock.sandbox.ContainmentUnavailable` is raised otherwise; see `tracelock.sandbox`.
"""

from __future__ import annotations

from tracelock.sandbox import RunResult, run_python

__all__ = ["run_sandboxed"]


def run_sandboxed(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512) -> RunResult:
    """Run ``code`` in the sandbox.

    Args:
        code: a complete Python program.
        timeout_s: wall-clock seconds before the run is killed (status "timeout"); the CPU-time limit is one
            second above it, rounded up (`tracelock.sandbox.cpu_seconds_for`).
        memory_mb: the address-space limit in MiB.

    Returns:
        The sandbox's RunResult: ``.status`` ("ok", "syntax_error", "runtime_error", "timeout", "killed"),
        ``.passed`` (status == "ok"), ``.stdout``, ``.stderr`` (cut to `tracelock.sandbox.OUTPUT_LIMIT` bytes),
        ``.returncode``, ``.seconds`` and ``.contained`` (False only for a run on the opt-in).

    Raises:
        tracelock.sandbox.ContainmentUnavailable: the code cannot be contained here and the user has not opted in.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str holding a Python program, got {type(code).__name__}")
    if not timeout_s > 0 or memory_mb < 1:
        raise ValueError(f"timeout_s must be > 0 and memory_mb >= 1, got {timeout_s}, {memory_mb}")
    return run_python(code, timeout=timeout_s, memory_mb=memory_mb)
