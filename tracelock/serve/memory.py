"""Keep the server's resident memory flat under glibc's malloc.

A decode step frees and allocates tensor buffers of a few hundred KiB to a few MiB. glibc serves those from its
heap once it has freed one (its mmap threshold rises to the largest freed mmapped block), keeps the freed heap
pages, and gives each thread that allocates its own arena: the server's RSS crept up under a long mixed load
(docs/serving.md, the soak test). Pinning the threshold (which also stops it rising) sends large buffers back to the
system when freed, two arenas let the event loop and the decode thread reuse each other's freed memory, and trimming
the heap when the server goes idle returns what the small ones left. All are no-ops where the C library is not
glibc.
"""

import ctypes
import functools
import os
import sys

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept from rising
ARENA_MAX = 2  # the event loop's and the decode thread's: memory one thread frees is reused by the other


@functools.cache  # opened once: release_free_memory runs each time the server goes idle
def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # musl and others: no such library, nothing to tune
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def tune_malloc() -> list:
    """Pin glibc's mmap threshold at 128 KiB and cap its arenas at two (call it before the server's threads start);
    the names of the settings made. ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` in the environment are the
    user's own choice and are left alone."""
    libc = _glibc()
    if libc is None:
        return []
    made = []
    for env, param, value in (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                              ("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENA_MAX)):
        if env not in os.environ and libc.mallopt(param, value) == 1:
            made.append(env)
    return made


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``); the server calls it when it goes
    idle, so an idle server's RSS is what it holds, not what it once needed."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
