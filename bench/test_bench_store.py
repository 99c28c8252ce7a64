"""Trace store and feature cache: bytes per trace (extra_info) and the time to read them back.

Measured on the testbed's quick-controller run (``quick_run``: 8 math traces at gen 64, every step recorded, an
fp16 cache), against the reference release's ~35 MB per 256-token trace.
"""

import pytest

from tracelock.traces.cache import FeatureCache, cache_bytes_per_trace
from tracelock.traces.store import iter_traces, store_bytes_per_trace

REFERENCE_RELEASE_BYTES_PER_TRACE = 35e6


@pytest.fixture
def run(quick_run):
    if quick_run is None:
        pytest.skip("the store benchmark measures the testbed's quick-controller traces (default backbone only)")
    return quick_run


def test_canonical_traces(benchmark, run, machine):
    traces = list(iter_traces(run / "traces"))
    # check before timing: every collected trace reads back, with its tokens
    assert len(traces) == 8 and all(t.final.size for t in traces)
    per_trace = store_bytes_per_trace(run / "traces")
    benchmark.group = "trace-store-testbed"
    benchmark.extra_info.update(machine, store="canonical", traces=len(traces), bytes_per_trace=per_trace,
                                reference_release_ratio=REFERENCE_RELEASE_BYTES_PER_TRACE / per_trace)
    benchmark.pedantic(lambda: list(iter_traces(run / "traces")), rounds=10, warmup_rounds=1)


def test_feature_cache(benchmark, run, machine):
    cache = FeatureCache(run / "cache")
    assert len(cache.trace_ids) == 8 and cache[0]["codes"].shape[1] == cache.code_dim
    per_trace = cache_bytes_per_trace(run / "cache")
    benchmark.group = "trace-store-testbed"
    benchmark.extra_info.update(machine, store=f"feature cache ({cache.dtype})", traces=len(cache.trace_ids),
                                items=len(cache), bytes_per_trace=per_trace,
                                reference_release_ratio=REFERENCE_RELEASE_BYTES_PER_TRACE / per_trace)

    def read_all():
        fresh = FeatureCache(run / "cache", verify=False)
        return [fresh[i] for i in range(len(fresh))]

    benchmark.pedantic(read_all, rounds=3, warmup_rounds=1)
