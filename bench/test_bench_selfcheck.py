"""What the kernels' self-check (tracelock.selfcheck) costs a process: every Triton op checked once on its small
input, bf16 on CUDA (fp32 under the CPU interpreter). The first round of a fresh process pays Triton's JIT compile
(from its on-disk cache when warm), recorded as ``first_round_seconds``; the timed rounds are the checks themselves,
which a decoding process pays once per op, dtype and shape class."""

import subprocess
import sys
import time

import pytest
import torch

from tracelock import _triton, selfcheck

pytestmark = pytest.mark.skipif(not _triton.triton_available or not (_triton.triton_interpret or
                                                                   torch.cuda.is_available()),
                                reason="needs Triton on CUDA or under TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# a fresh process: import, then every check once (its JIT compiles included), timed from inside
FRESH = ("import time, torch; from tracelock import selfcheck; start = time.perf_counter(); "
         "ok = [selfcheck.check(op, {device!r}, torch.{dtype})[0] for op in sorted(selfcheck.BUILDERS)]; "
         "torch.cuda.synchronize() if torch.cuda.is_available() else None; "
         "print(all(ok), time.perf_counter() - start)")


def check_all() -> list:
    out = [selfcheck.check(op, DEVICE, DTYPE)[0] for op in sorted(selfcheck.BUILDERS)]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return out


def test_selfcheck_cost(request, benchmark, machine):
    start = time.perf_counter()
    assert all(check_all())  # check before timing: every kernel passes here
    first = time.perf_counter() - start
    fresh = subprocess.run([sys.executable, "-c", FRESH.format(device=DEVICE, dtype=str(DTYPE).split(".")[1])],
                           capture_output=True, text=True, timeout=600)
    assert fresh.returncode == 0 and fresh.stdout.split()[0] == "True", fresh.stderr[-2000:]
    benchmark.group = f"selfcheck-{DEVICE}-{str(DTYPE).split('.')[1]}"
    benchmark.extra_info.update(machine, ops=len(selfcheck.BUILDERS), first_round_seconds=first,
                                fresh_process_seconds=float(fresh.stdout.split()[1]),
                                interpreter=_triton.triton_interpret)
    benchmark.pedantic(check_all, rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1)
