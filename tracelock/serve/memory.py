"""Keep the server's resident memory flat under glibc's malloc.

A decode step frees and allocates tensor buffers of a few hundred KiB to a few MiB. glibc serves those from its
heap once it has freed one (its mmap threshold rises to the largest freed mmapped block), and keeps the freed heap
pages: the server's RSS crept up under a long mixed load (docs/serving.md, the soak test). Pinning the threshold
(which also stops it rising) sends large buffers back to the system when freed, and trimming the heap when the
server goes idle returns what the small ones left. Both are no-ops where the C library is not glibc.
"""

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept from rising


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # musl and others: no such library, nothing to tune
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at 128 KiB; True when it was set. A ``MALLOC_MMAP_THRESHOLD_`` in the environment
    is the user's own choice and is left alone."""
    libc = _glibc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``); the server calls it when it goes
    idle, so an idle server's RSS is what it holds, not what it once needed."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
