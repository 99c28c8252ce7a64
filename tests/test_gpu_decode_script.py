"""bench/gpu_decode.py, the GPU session's measuring script, in its CPU dry run (micro checkpoint, tiny shapes): every
stage runs and the JSON holds each figure the GPU run reports (the GPU-only ones are None on a CPU)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_decode", BENCH / "gpu_decode.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = script.main(["--out", str(tmp_path), "--dry-run"])
    saved = json.loads((tmp_path / "gpu-decode-dry-run.json").read_text())
    assert saved["batches"] == [1, 2] and saved["settings"]["cache"] == "dual"
    assert saved["floor"]["weight_bytes_per_step"] > 0 and "floor_seconds" not in saved["floor"]
    steps = saved["steps_b1"]
    assert steps["cached_steps"] > steps["refresh_steps"] == 16 // 4 and steps["cached_step_median"] > 0
    for B in (1, 2):
        eager, engine = saved["throughput"][f"B{B}-eager-loop"], saved["throughput"][f"B{B}-engine-uncompiled"]
        assert eager["mean_steps"] == engine["mean_steps"] and eager["forwards"] == engine["forwards"]
    assert saved["syncs"] == {"eager-loop": None, "engine-uncompiled": None}
    peer = saved["fastdllm_dual"]
    if "skipped" not in peer:  # the peer checkout is there: its tokens equal tracelock's (fp32)
        assert peer["agreement"] == 1.0 and peer["nfe"] >= steps["cached_steps"] + steps["refresh_steps"]
        assert len(peer["peer"]["sha256:llada/generate.py"]) == 64 and "commit" not in peer["peer"]  # a plain copy
    assert result["shape"].startswith("micro-llada")
