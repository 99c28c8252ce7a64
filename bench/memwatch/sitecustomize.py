"""Where a server's memory goes, read from inside it: ``PYTHONPATH=bench/memwatch TRACELOCK_MEMWATCH=FILE`` in the
environment of a ``tracelock serve`` process (bench/soak.py passes its environment on) starts a thread that appends
a JSON line to FILE every ``TRACELOCK_MEMWATCH_EVERY`` seconds (default 10):

- ``rss``: the process's resident memory (bytes);
- glibc's own statistics (``mallinfo2``, every arena): ``heap`` (bytes its arenas took from the system),
  ``in_use`` (allocated by the program), ``free`` (freed but kept), ``mmapped`` (large blocks mapped on their own);
- Python's cyclic collector: ``objects`` it tracks (frozen ones aside), ``frozen``, ``collections`` per generation;
- ``tensors`` / ``tensor_bytes``: the torch tensors among the tracked objects and their storages' bytes;
- with ``TRACELOCK_MEMWATCH_TRACEMALLOC=1``, ``traced`` (Python's own allocations) and ``top``, the 8 source lines
  whose allocations grew most since the first reading (tracemalloc, 8 frames; slow).

Used to find the soak's RSS growth (docs/serving.md). Other processes, and a server without the variable, are
untouched.
"""

import os
import sys


def _watch(path: str, every: float) -> None:
    import ctypes
    import gc
    import json
    import re
    import threading
    import time
    import tracemalloc

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):  # not glibc (2.33 or later): no allocator statistics
        libc = None
    if os.environ.get("TRACELOCK_MEMWATCH_TRACEMALLOC") == "1":
        tracemalloc.start(8)

    def tensors():
        torch = sys.modules.get("torch")
        if torch is None:
            return 0, 0
        count, storages = 0, {}
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                count += 1
                try:
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
                except RuntimeError:  # a tensor without storage (meta, sparse)
                    pass
        return count, sum(storages.values())

    def loop():
        first = None
        while True:
            status = open("/proc/self/status").read()
            row = dict(t=time.time(), rss=1024 * int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1]))
            if libc is not None:
                info = libc.mallinfo2()
                row.update(heap=info.arena, in_use=info.uordblks, free=info.fordblks, mmapped=info.hblkhd)
            row.update(objects=len(gc.get_objects()), frozen=gc.get_freeze_count(),
                       collections=[g["collections"] for g in gc.get_stats()])
            row["tensors"], row["tensor_bytes"] = tensors()
            if tracemalloc.is_tracing():
                snapshot = tracemalloc.take_snapshot()
                row["traced"] = tracemalloc.get_traced_memory()[0]
                if first is None:
                    first = snapshot
                row["top"] = [str(s) for s in snapshot.compare_to(first, "lineno")[:8]]
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            time.sleep(every)

    threading.Thread(target=loop, name="memwatch", daemon=True).start()


if os.environ.get("TRACELOCK_MEMWATCH") and sys.argv[1:2] == ["serve"]:  # python -m tracelock serve ...
    _watch(os.environ["TRACELOCK_MEMWATCH"], float(os.environ.get("TRACELOCK_MEMWATCH_EVERY", "10")))
