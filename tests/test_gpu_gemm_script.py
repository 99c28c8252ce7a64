"""bench/studies/gpu_gemm.py (the matrix products' GPU stage) in its CPU dry run: every stage runs at tiny shapes, each
variant is checked against linear_rows_ref before it is timed, and the JSON holds every figure the GPU run reports (the
card's ceilings None on a CPU)."""

import json

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")



def test_gemm_dry_run(tmp_path, study_script):
    result = study_script("gpu_gemm").main(["--out", str(tmp_path), "--dry-run"])
    saved = json.loads((tmp_path / "gpu-gemm-dry-run.json").read_text())
    assert saved["rows"] == [1, 8, 32] and saved["card"] is None and saved["copy"]["gb_per_s"] > 0
    for stage in ("copy", "llada-8b", "dream-7b", "llada-8b-epilogues", "dream-7b-epilogues", "max_autotune"):
        assert "error" not in saved[stage] and "stage_seconds" in saved[stage], (stage, saved[stage].get("error"))
    variants = ("cublas", "triton")
    for shape, qkv in (("llada-8b", 192), ("dream-7b", 112)):
        table = saved[shape]["table"]
        # four products (Dream's q/k/v with its bias) at three row counts, every variant checked, then timed
        assert [(r["product"], r["M"]) for r in table] == [(p, M) for p in ("qkv", "o", "gate_up", "down")
                                                           for M in (1, 8, 32)]
        assert table[0]["N"] == qkv and table[0]["bias"] == (shape == "dream-7b")
        for row in table:
            assert row["bytes"] > row["N"] * row["K"] * 2 and row["flops"] == 2 * row["M"] * row["N"] * row["K"]
            for v in variants:
                assert row[v]["matches_spec"] and row[v]["matches_spec_after_timing"], (v, row[v])
                assert row[v]["seconds"] > 0 and row[v]["gb_per_s"] > 0, (v, row[v])
                assert "roofline_share" not in row[v] and "tensor_peak_share" not in row[v]  # no card
        if saved["impl"] == "triton":  # under TRITON_INTERPRET=1 (tests/conftest.py): each autotune config alone
            assert all(len(r["each_config"]) == 5 and all(c["matches_spec"] for c in r["each_config"]) for r in table)
        step = saved[shape]["per_step"]["M32"]
        assert step["cublas_seconds_per_step"] > 0 and step["triton_seconds_per_step"] > 0
        assert "floor_seconds_per_step" not in step
        epilogues = saved[f"{shape}-epilogues"]["table"]
        want = ["residual", "silu_mul", "residual"] + (["bias"] if shape == "dream-7b" else [])
        assert sorted({r["epilogue"] for r in epilogues}) == sorted(set(want))
        for row in epilogues:
            assert row["cublas_unfused"]["matches_spec"] and row["triton_fused"]["matches_spec"], row
            assert row["fused_speedup"] > 0
    autotune = saved["max_autotune"]["table"]
    assert [(r["shape"], r["M"]) for r in autotune] == [("llada-8b", 32), ("dream-7b", 32)]
    assert all(r["max_autotune"]["matches_spec"] for r in autotune)
    assert result["impl"] == saved["impl"]
