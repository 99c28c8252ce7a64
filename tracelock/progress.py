"""Progress of the long commands on stderr: tqdm bars (items done, rate, ETA) and short status lines.

Both stay off stdout, which carries the results (tables, JSON). ``tracelock --quiet`` (``TRACELOCK_QUIET=1``) turns
them off, and so does being a torchrun rank other than 0, so K processes do not draw K bars.
"""

import os
import sys

QUIET_ENV = "TRACELOCK_QUIET"


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "0") not in ("", "0") or os.environ.get("RANK", "0") != "0"


_load_noticed = False


def notice_oversubscription(load: float | None = None, cores: int | None = None) -> str | None:
    """Once per process, when a stage starts: a machine that became busy after the command chose its threads (the CLI
    checks the load at its start) is called out on stderr, unless quiet or the run has said so already.
    Oversubscribed means a 1-minute load average above the cores while this process runs more than one thread (its
    own threads count in the load).
    Returns the notice printed, if any."""
    global _load_noticed
    threads = os.environ.get("OMP_NUM_THREADS", "")
    said = os.environ.get("TRACELOCK_LOAD_NOTICED")  # the CLI's notice at the start (`cli_threads.NOTICE_ENV`)
    if _load_noticed or not threads.isdigit() or int(threads) < 2 or said or quiet():
        return None
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load <= cores + 0.5:
        return None
    _load_noticed = True
    line = (f"tracelock: this machine became busy (load average {load:.1f} on {cores} cores) while this command runs "
            f"{threads} threads: threads that wait for a core make decoding many times slower; run it again with "
            "--threads 1 if it is slow")
    print(line, file=sys.stderr, flush=True)
    return line


def progress_bar(iterable=None, *, total=None, desc=None, unit="item", disable=False, **kwargs):
    """A tqdm bar on stderr; ``disable`` (or `quiet`) gives one that draws nothing but still counts. Each bar is a
    new stage: `notice_oversubscription` looks at the load first."""
    from tqdm import tqdm

    notice_oversubscription()

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=disable or quiet(), **kwargs)


def status(line: str) -> None:
    """A status line on stderr (which stage a command is in), unless quiet."""
    if not quiet():
        print(f"  {line}", file=sys.stderr, flush=True)
