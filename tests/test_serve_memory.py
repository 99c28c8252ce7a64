"""The server's malloc tuning (tracelock.serve.memory): on glibc the mmap threshold is pinned and the arenas capped
unless the user set them, and trimming gives freed heap pages back to the system (measured in a fresh process, so
other tests' heaps do not blur the figure). Its effect on a long mixed load is bench/soak.py's to show
(docs/serving.md)."""

import os
import subprocess
import sys

import pytest

from tracelock.serve import memory

pytestmark = pytest.mark.skipif(memory._glibc() is None, reason="glibc's malloc only (Linux with glibc)")

# many small blocks freed in an order that leaves the heap's top in use: glibc keeps the freed pages until trimmed
PROGRAM = """
import re, sys
from tracelock.serve.memory import release_free_memory
def rss():
    return int(re.search(r"^VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read(), re.M)[1])
blocks = [bytearray(4000) for _ in range(60000)]
keep = blocks[-1]
del blocks
before = rss()
release_free_memory()
print(before, rss())
"""


def test_malloc_is_tuned_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert memory.tune_malloc() == ["MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX"]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert memory.tune_malloc() == ["MALLOC_ARENA_MAX"]


def test_trimming_gives_freed_heap_pages_back():
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}  # no automatic trim: only ours returns them
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, env=env,
                         check=True).stdout.split()
    before, after = map(int, out)
    assert before - after > 100_000, (before, after)  # KiB: most of the 240 MB of freed blocks went back
