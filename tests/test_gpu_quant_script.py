"""bench/studies/gpu_quant.py in its CPU dry run (the micro checkpoint in fp32): int8 is quantized and timed against the
unquantized step, int4 and fp8 are skipped with the refusal a CPU user gets, and the JSON holds each figure the GPU
run reports (the bandwidth-based ones absent on a CPU). It runs as a device call of its own."""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH = Path(__file__).resolve().parents[1] / "bench" / "studies"



def test_quant_dry_run(tmp_path, study_script):
    from tracelock.extras import MissingExtraError
    from tracelock.models import quantize

    try:
        quantize.import_torchao()
    except MissingExtraError:
        pytest.skip("torchao is not installed (the quant extra)")
    study_script("gpu_quant").main(["--out", str(tmp_path), "--dry-run", "--steps", "3"])
    saved = json.loads((tmp_path / "gpu-quant-llada-8b-dry-run.json").read_text())
    assert saved["card"] is None and saved["dtype"] == "torch.float32" and saved["torchao"].startswith("0.18")
    int8 = saved["quantize-int8"]
    assert "error" not in int8, int8.get("error")
    assert int8["layers"] == 16 and int8["quantize_seconds"] > 0 and "floor_seconds" not in int8
    assert int8["weight_bytes"]["blocks"] < saved["floor"]["weight_bytes_per_step"] / 4
    assert int8["proposal_agreement"] >= 0.9 and int8["logits_relative_error"] < 0.05
    for fmt, needs in (("int4", "8.0"), ("fp8", "9.0")):
        assert f"quantize='{fmt}'" in saved[f"quantize-{fmt}"]["skipped"]
        assert f"compute capability {needs} or newer" in saved[f"quantize-{fmt}"]["skipped"]
    for B in (1, 2):
        rows = saved[f"b{B}"]
        assert set(rows) - {"stage_seconds"} == {"fp32", "int8"}
        assert rows["fp32"]["cached_steps"] == rows["int8"]["cached_steps"] > 0
        assert rows["int8"]["cached_over_fp32"] > 0 and "cached_over_own_floor" not in rows["int8"]


def test_torchao_is_pinned_for_the_device():
    """The device has no network: torchao travels as a staged wheel (bench/studies/stage_peers.sh) of the version
    constraints.txt pins."""
    assert '"torchao==0.18.0"' in (BENCH / "stage_peers.sh").read_text()
    assert "torchao==0.18.0" in (BENCH.parents[1] / "constraints.txt").read_text()
