"""Progress of the long commands on stderr: tqdm bars (items done, rate, ETA) and short status lines.

Both stay off stdout, which carries the results (tables, JSON). ``tracelock --quiet`` (``TRACELOCK_QUIET=1``) turns
them off, and so does being a torchrun rank other than 0, so K processes do not draw K bars.
"""

import os
import sys

QUIET_ENV = "TRACELOCK_QUIET"


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "0") not in ("", "0") or os.environ.get("RANK", "0") != "0"


def progress_bar(iterable=None, *, total=None, desc=None, unit="item", disable=False, **kwargs):
    """A tqdm bar on stderr; ``disable`` (or `quiet`) gives one that draws nothing but still counts."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=disable or quiet(), **kwargs)


def status(line: str) -> None:
    """A status line on stderr (which stage a command is in), unless quiet."""
    if not quiet():
        print(f"  {line}", file=sys.stderr, flush=True)
