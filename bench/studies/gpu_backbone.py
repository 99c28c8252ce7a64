"""The backbone step fused, on one GPU: the cached decode step of each way the engine can run the backbone, against
the weight-read floor stated two ways (bench/studies/gpu_step_session.sh runs it first).

At a released model's shape (``--shape``, default LLaDA-8B) with random bf16 weights, gen 256, blocks of 32, the
confidence rule at 2 tokens per step with the dual cache (a fixed commit rate, as the race: bench/studies/gpu_race.py):

1. ``floors``: the bytes a cached step must read (every weight but the embedding table) over the card's datasheet
   bandwidth, and over the bandwidth of a device-to-device copy measured here (a 2 GiB ``copy_``, read + write);
2. ``variants``, at B = 1 and B = 32: the engine's step medians (cached and refresh steps apart) for
   - ``cudagraphs-kernels``: the hand-written Triton kernels (fused residual add + RMSNorm, rotary with the K/V write
     into the cache, SiLU x mul), cuBLAS's products, the step captured as CUDA graphs;
   - ``cudagraphs-kernels+matmul``: the same plus the Triton weight-streaming products with their epilogues;
   - ``inductor-regional-specs``: torch.compile with CUDA graphs, one Block compiled and reused for every layer
     (``nested_compile_region``), the plain-PyTorch specs for inductor to fuse;
   - ``inductor-regional-kernels``: the same with the hand-written kernels inside the compiled graph;
   each checked first against the ``cudagraphs-kernels`` tokens (bf16: agreement recorded), each with its
   ``cached_over_floor`` (datasheet) and ``cached_over_copy_floor``; then ``fastest`` at B = 1, the variant the GPU
   default should be (``DecodeEngine(backbone=...)`` and the compile mode), and the goals (1.5x, 1.3x).

``--dry-run``: the micro checkpoint on the CPU, gen 16, blocks of 8, B = 1 and 2, the engine uncompiled (no CUDA
graphs, no inductor), no bandwidth: tests/test_gpu_decode_script.py. The JSON (``gpu-backbone-<shape>.json``) is
rewritten atomically after every stage; a stage its time budget cannot fit is skipped with the reason.

    python bench/studies/gpu_backbone.py --out DIR [--shape llada-8b|dream-7b] [--budget SECONDS] [--dry-run]
"""

import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_decode  # noqa: E402  (bench/studies/gpu_decode.py)
from gpu_stages import Budget, ceilings, log, run_stage, study_parser  # noqa: E402

from tracelock.atomic import atomic_write_text  # noqa: E402

# (name, DecodeEngine compile mode, backbone); a dry run has neither CUDA graphs nor a GPU's inductor
VARIANTS = [("cudagraphs-kernels", "cudagraphs", "kernels"),
            ("cudagraphs-kernels+matmul", "cudagraphs", "kernels+matmul"),
            ("inductor-regional-specs", True, "specs"),
            ("inductor-regional-kernels", True, "kernels")]
GOALS = {"stages_1_2": 1.5, "stage_3": 1.3}


def copy_bandwidth(device, gib: float = 2.0) -> float | None:
    """Bytes/s of a device-to-device ``copy_`` of ``gib`` GiB (read + write counted), best of 5; None on a CPU."""
    if device.type != "cuda":
        return None
    n = int(gib * 2**30) // 2
    src, dst = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    dst.copy_(src)
    best = None
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        best = seconds if best is None else min(best, seconds)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / best


def floors_stage(model, device) -> dict:
    out = gpu_decode.weight_floor(model, device)
    card, bandwidth, _ = ceilings(device)
    measured = copy_bandwidth(device)
    if measured:
        out.update(copy_bandwidth=measured, copy_floor_seconds=out["weight_bytes_per_step"] / measured,
                   copy_share_of_datasheet=measured / bandwidth if bandwidth else None)
    return out


def settings_for(gen: int, block: int, backbone: str) -> dict:
    """The race's rule at 2 tokens per step (`gpu_race.our_settings` without the family's score) on ``backbone``."""
    return dict(policy="confidence", policy_args={"steps": gen // 2}, gen_length=gen, block=block, cache="dual",
                backbone=backbone)


def variant_row(model, prompts, settings, device, mode, floors, reference_tokens) -> tuple:
    """(row, tokens): the step medians of one variant and its tokens' agreement with ``reference_tokens``."""
    steps = gpu_decode.time_engine_steps(model, prompts, settings, device, mode)
    engine = gpu_decode._engine(model, prompts, settings, mode)
    tokens, _, _ = gpu_decode._decode(model, prompts, settings, engine)
    row = dict(steps)
    if reference_tokens is not None:
        row["agreement"] = (tokens.cpu() == reference_tokens.cpu()).float().mean().item()
    cached = row["cached_step_median"]
    if floors.get("floor_seconds"):
        row["cached_over_floor"] = cached / floors["floor_seconds"]
    if floors.get("copy_floor_seconds"):
        row["cached_over_copy_floor"] = cached / floors["copy_floor_seconds"]
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, tokens


def choose(variants: dict, batch: int) -> dict:
    """The fastest variant at ``batch`` by its cached step, and where it stands against the goals."""
    ran = {name: v for name, v in variants.items() if name.endswith(f"-B{batch}") and "cached_step_median" in v}
    if not ran:
        return dict(fastest=None, why="no variant ran")
    name = min(ran, key=lambda n: ran[n]["cached_step_median"])
    out = dict(fastest=name.rsplit("-B", 1)[0], cached_step_median=ran[name]["cached_step_median"])
    if "cached_over_floor" in ran[name]:
        ratio = ran[name]["cached_over_floor"]
        out.update(cached_over_floor=ratio, **{f"goal_{k}_met": ratio <= v for k, v in GOALS.items()})
    return out


def main(argv=None):
    parser = study_parser(__doc__, 200.0)
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes (default: 1 and the largest of the session, 32; a dry run 1 and 2)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget)
    model, _, label, (gen, block, prompt_len, batches) = gpu_decode.start_run(args)
    block = 8 if args.dry_run else block
    device = model.device
    batch_sizes = args.batches or [batches[0], batches[-1]]  # B = 1 (the goals) and the largest batch
    prompts = gpu_decode.random_prompts(model, batch_sizes[-1], prompt_len)
    card, bandwidth, flop_rate = ceilings(device)
    result = dict(shape=label, device=torch.cuda.get_device_name(device) if device.type == "cuda" else
                  platform.processor() or platform.machine(), card=card, bandwidth=bandwidth, torch=torch.__version__,
                  gen_length=gen, block=block, prompt_length=prompt_len, budget_seconds=args.budget,
                  started=time.strftime("%Y-%m-%d %H:%M:%S"), variants={})
    path = Path(args.out) / f"gpu-backbone-{args.shape}{'-dry-run' if args.dry_run else ''}.json"

    def save():
        atomic_write_text(path, json.dumps(result, indent=2, default=str) + "\n")

    save()
    run_stage(result, "floors", lambda: floors_stage(model, device), save, budget, 5)
    floors = result["floors"] if "weight_bytes_per_step" in result["floors"] else {}
    reference = {}
    for B in batch_sizes:
        for name, mode, backbone in VARIANTS:
            if args.dry_run:
                mode = False  # no CUDA graphs, no GPU inductor on a CPU

            def cell(B=B, mode=mode, backbone=backbone, name=name):
                row, tokens = variant_row(model, prompts[:B], settings_for(gen, block, backbone), device, mode,
                                          floors, reference.get(B))
                reference.setdefault(B, tokens)
                return dict(row, compile=mode, backbone=backbone)
            run_stage(result["variants"], f"{name}-B{B}", cell, save, budget, 30 if mode is True else 12)
    result["choice"] = {f"B{B}": choose(result["variants"], B) for B in batch_sizes}
    save()
    log("choice", result["choice"])
    log("wrote", path)
    return result


if __name__ == "__main__":
    main()
