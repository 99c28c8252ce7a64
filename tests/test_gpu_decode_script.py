"""The GPU sessions' measuring scripts in their CPU dry runs (micro checkpoints, tiny shapes):
bench/studies/gpu_decode.py, gpu_step.py and gpu_race.py. Every stage runs and the JSON holds each figure the GPU run
reports (the GPU-only ones are None or skipped with a reason on a CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
BENCH = Path(__file__).resolve().parents[1] / "bench" / "studies"



def test_dry_run(tmp_path, study_script):
    result = study_script("gpu_decode").main(["--out", str(tmp_path), "--dry-run"])
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


def test_step_dry_run(tmp_path, study_script):
    study_script("gpu_step").main(["--out", str(tmp_path), "--dry-run"])
    saved = json.loads((tmp_path / "gpu-step-llada-8b-dry-run.json").read_text())
    assert saved["card"] is None and saved["settings"]["cache"] == "dual"
    for stage in ("profile", "kernels", "tracelock_step"):
        assert "error" not in saved[stage] and "stage_seconds" in saved[stage], (stage, saved[stage].get("error"))
    for kind in ("refresh", "cached"):
        prof = saved["profile"][kind]
        assert prof["kernel_seconds"] > 0 and prof["launches"] > 0 and prof["rows"].startswith("CPU")
        # the matrix products' bytes follow from their recorded inputs: at least the weights of every layer
        mm = next(r for r in prof["table"] if r["name"] == "aten::mm")
        assert mm["bytes"] >= saved["floor"]["weight_bytes_per_step"] and mm["gb_per_s"] > 0
        assert abs(sum(r["share_of_step"] for r in prof["table"]) - 1) < 1e-6
    markdown = (tmp_path / "profile-llada-8b-dry-run.md").read_text()
    assert "### cached step" in markdown and "| `aten::mm` |" in markdown
    kernels = saved["kernels"]
    assert [r["B"] for r in kernels["head"]] == [1, 2]
    if kernels["impl"] == "triton":  # under TRITON_INTERPRET=1 (tests/conftest.py): each autotune config ran alone
        for row in kernels["head"] + kernels["taps"]:
            assert len(row["each_config"]) == 5 and all("error" not in c for c in row["each_config"]), row
            assert all(c.get("proposal_agreement", 1.0) == 1.0 and c.get("matches_spec", True)
                       for c in row["each_config"])
    assert all(r["proposal_agreement"] == 1.0 and r["R"] == 4 * r["B"] for r in kernels["head"])
    assert all(r["matches_spec"] and r["T"] == 28 * r["B"] for r in kernels["taps"])
    assert "roofline_share" not in kernels["head"][0]  # no card, no roofline
    step = saved["tracelock_step"]
    assert step["bare"]["cached_steps"] > 0 and step["tracelock"]["cached_steps"] > 0 and step["cached_ratio"] > 0
    assert step["commit_rule"] == {"hold_end": True, "fallback": "confidence"} and step["cached_ratio_paper_rule"] > 0
    assert step["commit_kernel"]["checked_against_spec"] and step["commit_kernel"]["B"] == 1


@pytest.mark.parametrize("shape", ["llada-8b", "dream-7b"])
def test_race_dry_run(tmp_path, shape):
    # a process of its own, as on the GPU: Fast-dLLM's Dream code, imported to race it, changes transformers' Qwen2
    # classes for the rest of the process (the HF parity tests after it failed in one pytest run)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(BENCH / "gpu_race.py"), "--out", str(tmp_path), "--dry-run", "--shape",
                          shape], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    saved = json.loads((tmp_path / f"gpu-race-{shape}-dry-run.json").read_text())
    cells, G = saved["cells"], saved["gen_length"]
    assert saved["per_step"] == [2, 4] and saved["batches"] == [1, 2]
    for k in (2, 4):
        for B in (1, 2):
            eager, engine = cells[f"k{k}-B{B}-eager-loop"], cells[f"k{k}-B{B}-engine-uncompiled"]
            # k tokens per step: G // k steps, one forward each, the loop and the engine alike
            assert eager["mean_steps"] == engine["mean_steps"] == G // k, (eager, engine)
            assert eager["forwards"] == engine["forwards"] == G // k
        if "skipped" not in saved["fastdllm"]:
            peer = cells[f"k{k}-B1-fastdllm"]
            assert peer["nfe"] == peer["steps_argument"] == G // k
            if shape == "llada-8b":  # the same schedule, fp32: Fast-dLLM's tokens are tracelock's
                assert peer["agreement"] == 1.0
                assert saved["tokens_check"]["tokens_equal"] and saved["tokens_check"]["dtype"] == "torch.float32"
            assert f"k{k}-B1-engine-vs-fastdllm" in saved["summary"]
            # every tracelock cell at this k holds its speedup over Fast-dLLM's per-item time, as a number
            assert all(isinstance(c["speedup_vs_fastdllm"], float) for n, c in cells.items()
                       if n.startswith(f"k{k}-") and "seconds_per_item" in c and "fastdllm" not in n)
    assert set(saved["summary"]) >= {"k2-B2-over-B1-tokens-per-second", "k4-B2-over-B1-tokens-per-second"}
    steps = cells["k2-B1-steps"]  # the cached step's median at this shape (no floor without a known card)
    assert steps["cached_steps"] > 0 and steps["cached_step_median"] > 0 and "cached_over_floor" not in steps
    table = (tmp_path / f"race-{shape}-dry-run.md").read_text()
    assert "| k2-B1-steps | cached step " in table and "| k4-B2-engine-uncompiled |" in table
    assert table.count("\n| k") == len(cells)


def test_backbone_dry_run(tmp_path, study_script):
    """Every backbone variant's cached step (uncompiled on the CPU): the CUDA-graph ones at B = 1 and 2, the
    compile-heavy ones at B = 1 after them; each checked against the torch spec's tokens before it is timed; the
    choice per batch; the floor with the rows' KV cache."""
    saved = study_script("gpu_backbone").main(["--out", str(tmp_path), "--dry-run"])
    assert saved == json.loads((tmp_path / "gpu-backbone-llada-8b-dry-run.json").read_text())
    assert saved["floors"]["weight_bytes_per_step"] > 0 and "copy_bandwidth" not in saved["floors"]  # no GPU
    variants = saved["variants"]
    assert list(variants) == ["cudagraphs-kernels-B1", "cudagraphs-kernels+matmul-B1", "cudagraphs-kernels-B2",
                              "cudagraphs-kernels+matmul-B2", "inductor-regional-specs-B1",
                              "inductor-regional-kernels-B1"]
    for name, row in variants.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["check"]["tokens_equal"] and row["check"]["dtype"] == "torch.float32", name
        assert row["cached_steps"] > 0 and row["cached_step_median"] > 0
        # fp32 on a CPU: the Triton products run only on CUDA, every variant runs the same math here
        assert row.get("agreement_with_first_variant", 1.0) == 1.0, name
    assert variants["cudagraphs-kernels-B2"]["kv_bytes_per_step"] == 2 * variants["cudagraphs-kernels-B1"][
        "kv_bytes_per_step"] > 0
    assert saved["choice"]["B1"]["fastest"] in {"cudagraphs-kernels", "cudagraphs-kernels+matmul",
                                                "inductor-regional-specs", "inductor-regional-kernels"}


def test_backbone_mismatch_stops_the_variant(tmp_path, study_script, monkeypatch):
    """A variant whose tokens differ from the spec's on the check model is recorded and not timed."""
    script = study_script("gpu_backbone")
    real = script.spec_tokens
    monkeypatch.setattr(script, "spec_tokens", lambda *a: real(*a) + 1)
    saved = script.main(["--out", str(tmp_path), "--dry-run", "--batches", "1", "--variants", "cudagraphs-kernels"])
    row = saved["variants"]["cudagraphs-kernels-B1"]
    assert not row["check"]["tokens_equal"] and row["check"]["first_difference"]["position"] >= 0
    assert row["stopped"].startswith("tokens differ") and "cached_step_median" not in row
    assert saved["choice"]["B1"] == {"fastest": None, "why": "no variant ran"}


def test_session_stops_at_once_without_the_peer(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PEER="", DRY_RUN="0", PATH=os.environ["PATH"])
    env.pop("NO_PEER", None)
    script = BENCH / "gpu_step_session.sh"
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env,
                         cwd=tmp_path)  # no bench/.peers here, and no ../shared beside tmp_path
    assert run.returncode == 2 and "bash bench/studies/stage_peers.sh" in run.stderr, run.stderr


def test_stage_guard(study_script):
    """A stage that raises is recorded with its error, one that needs more time than is left is skipped; both
    save, and the run goes on."""
    step = study_script("gpu_stages")
    result, saves = {}, []

    def boom():
        raise RuntimeError("CUDA out of memory")

    step.run_stage(result, "a", boom, lambda: saves.append(1), step.Budget(60), 1)
    step.run_stage(result, "b", lambda: dict(x=1), lambda: saves.append(1), step.Budget(5), 30)
    step.run_stage(result, "c", lambda: dict(x=1), lambda: saves.append(1), step.Budget(60), 1)
    assert result["a"]["error"] == "RuntimeError: CUDA out of memory" and "boom" in result["a"]["traceback"]
    assert result["b"]["skipped"].startswith("time budget") and result["c"]["x"] == 1 and len(saves) == 3


def test_kernel_rows_from_cuda_events(study_script):
    """The profile's table on a GPU's events (built here by hand: no GPU in CI): kernels grouped by name, bytes from
    the launching op's recorded inputs (or the model's dtype where the profiler recorded no dtypes), known bytes for
    the Triton head, none where not derivable; GB/s and shares from them."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    step = study_script("profile_table")

    def event(name, device, us=0.0, kernels=(), shapes=None, dtypes=None):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us),
                               kernels=list(kernels), input_shapes=shapes, input_dtypes=dtypes, is_async=False)

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    mm = [[32, 4096], [4096, 12288]]
    events = [event("aten::mm", cpu, kernels=[Kernel("gemm", 0, 10.0)], shapes=mm, dtypes=["c10::BFloat16"] * 2),
              event("gemm", gpu, 10.0),
              event("aten::mm", cpu, kernels=[Kernel("gemm", 0, 30.0)], shapes=mm),  # no dtypes recorded
              event("gemm", gpu, 30.0),
              event("_window_logits_stats_kernel", gpu, 50.0), event("_window_logits_stats_merge_kernel", gpu, 5.0),
              event("aten::add", cpu, kernels=[Kernel("elementwise", 0, 5.0)], shapes=[[32, 4096], [32, 4096]],
                    dtypes=["c10::BFloat16"] * 2),
              event("elementwise", gpu, 5.0),
              # a split-K GEMM: its bytes go to its longest kernel, none to the reduction
              event("aten::addmm", cpu, kernels=[Kernel("splitk_gemm", 0, 8.0), Kernel("splitk_reduce", 0, 1.0)],
                    shapes=[[12288], [32, 4096], [4096, 12288]], dtypes=["c10::BFloat16"] * 3),
              event("splitk_gemm", gpu, 8.0), event("splitk_reduce", gpu, 1.0)]
    rows, what = step.kernel_rows(events, {"window_logits_stats_kernel": 10**6}, default_size=2)
    assert what == "CUDA kernels"
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows][:2] == ["_window_logits_stats_kernel", "gemm"]
    assert by["gemm"]["calls"] == 2 and abs(by["gemm"]["seconds"] - 40e-6) < 1e-12 and by["gemm"]["ops"] == ["aten::mm"]
    assert by["gemm"]["bytes"] == 2 * (32 * 4096 + 4096 * 12288) * 2
    assert by["_window_logits_stats_kernel"]["bytes"] == 10**6
    assert by["_window_logits_stats_merge_kernel"]["bytes"] is None and by["elementwise"]["bytes"] is None
    assert by["splitk_gemm"]["bytes"] == (12288 + 32 * 4096 + 4096 * 12288) * 2 and by["splitk_reduce"]["bytes"] is None
    assert by["splitk_reduce"]["ops"] == ["aten::addmm"]
    summary = step.kernel_table(rows, 3.35e12, top=2)
    assert summary["launches"] == 7 and abs(summary["kernel_seconds"] - 109e-6) < 1e-12
    assert summary["table"][-1]["name"] == "other (4 kernels)" and len(summary["table"]) == 3
    gemm = summary["table"][1]
    assert abs(gemm["gb_per_s"] - gemm["bytes"] / 40e-6 / 1e9) < 1e-6 and abs(gemm["share_of_step"] - 40 / 109) < 1e-9
    assert abs(gemm["bandwidth_share"] - gemm["gb_per_s"] * 1e9 / 3.35e12) < 1e-9
    summary.update(wall_seconds=2e-4, rows=what)
    assert "| `gemm` | 2 | 0.040 | 36.7% |" in step.markdown("cached step", summary)

