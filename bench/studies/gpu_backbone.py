"""The backbone step fused, on one GPU: the cached decode step of each way the engine can run the backbone, against
the read floor stated two ways (bench/studies/step_session.py runs it first after the kernel tests).

At a released model's shape (``--shape``, default LLaDA-8B) with random bf16 weights, gen 256, blocks of 32, the
confidence rule at 2 tokens per step with the dual cache (a fixed commit rate, as the race: bench/studies/gpu_race.py):

1. ``floors``: the bytes a cached step must read over the card's datasheet bandwidth, and over the bandwidth of a
   device-to-device copy measured here (a 2 GiB ``copy_``, read + write): every weight but the embedding table, plus
   the KV cache of the batch's rows (the dual cache's attention reads it whole: +1.3% at B = 1, +43% at B = 32);
2. ``variants``, at B = 1 and B = 32 (``--batches``):
   - ``cudagraphs-kernels``: the hand-written Triton kernels (fused residual add + RMSNorm, rotary with the K/V write
     into the cache, SiLU x mul), cuBLAS's products, the step captured as CUDA graphs;
   - ``cudagraphs-kernels+matmul``: the same plus the Triton weight-streaming products with their epilogues;
   - ``inductor-regional-specs`` / ``-kernels``: torch.compile with CUDA graphs, one Block compiled and reused for
     every layer, the plain-PyTorch specs (or the kernels) inside: compile-heavy, so at B = 1 only, after every
     CUDA-graph cell, each when ``INDUCTOR_NEED`` seconds of the budget are left (``--variants`` picks);
   each variant first decodes on the shape's first two layers in fp32 and its tokens must equal the torch spec's
   (``fused_generate(impl="torch")``) there: a mismatch stops the variant and is recorded (``check``); then one
   engine on the bf16 model decodes once (capture or compile; its agreement with the first variant's tokens kept)
   and is timed step by step: ``cached_over_floor`` (datasheet) and ``cached_over_copy_floor``;
3. ``choice``, rewritten after every cell: the fastest variant per batch (the GPU default should be its
   ``DecodeEngine(backbone=...)`` and compile mode) and the goals (1.5x, 1.3x).

``--dry-run``: the micro checkpoint on the CPU (fp32: it is its own check model), gen 16, blocks of 8, B = 1 and 2,
the engine uncompiled, no bandwidth: tests/test_gpu_decode_script.py. The JSON (``gpu-backbone-<shape>.json``) is
rewritten atomically after every cell; a cell its time budget cannot fit is skipped with the reason.

    python bench/studies/gpu_backbone.py --out DIR [--shape llada-8b|dream-7b] [--budget SECONDS] [--batches 1 32]
        [--variants NAME ...] [--dry-run]
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
# seconds a cell needs: a check on two fp32 layers, a capture and a decode of the bf16 model, one timed decode; an
# inductor cell compiles twice (measured 90 s for one compile at LLaDA-8B in the race: gpu_race.py --inductor)
CUDAGRAPHS_NEED, INDUCTOR_NEED = 15, 120


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


def check_model(args, model, device):
    """The model the variants' tokens are checked on: the shape's first two layers in fp32 (bf16 rounds differently
    per op order; fp32 does not change a token here), or a dry run's fp32 micro checkpoint itself."""
    if args.dry_run:
        return model
    from tracelock.models.shapes import random_backbone

    return random_backbone(args.shape, layers=2, device=device, dtype=torch.float32)


def spec_tokens(model, prompts, settings):
    """The torch spec's tokens: the eager loop with every op's plain-PyTorch spec (``impl="torch"``)."""
    import tracelock

    plain = {k: v for k, v in settings.items() if k != "backbone"}
    return tracelock.fused_generate(model, prompts, impl="torch", **plain)[0].cpu()


def check_variant(small, prompts, settings, mode, want) -> dict:
    """The variant's tokens on the check model against the spec's ``want``: equal, or where they part."""
    engine = gpu_decode._engine(small, prompts, settings, mode)
    tokens = gpu_decode._decode(small, prompts, settings, engine)[0].cpu()
    del engine
    same = tokens == want
    out = dict(tokens_equal=bool(same.all()), agreement=same.float().mean().item(), dtype=str(small.dtype),
               layers=small.spec.num_layers)
    if not out["tokens_equal"]:
        row, col = (~same).nonzero()[0].tolist()
        out["first_difference"] = dict(row=row, position=col, spec=int(want[row, col]), variant=int(tokens[row, col]))
    return out


def variant_row(model, small, prompts, settings, device, mode, floors, spec, first_tokens) -> tuple:
    """(row, tokens) of one variant: checked against the spec on the check model first (a mismatch stops it here),
    then one engine on ``model``: a decode (capture or compile; agreement with ``first_tokens``), a timed decode."""
    row = dict(check=check_variant(small, prompts, settings, mode, spec))
    if not row["check"]["tokens_equal"]:
        row["stopped"] = "tokens differ from the torch spec's on the check model: not timed"
        return row, None
    engine = gpu_decode._engine(model, prompts, settings, mode)
    tokens = gpu_decode._decode(model, prompts, settings, engine)[0].cpu()
    if first_tokens is not None:
        row["agreement_with_first_variant"] = (tokens == first_tokens).float().mean().item()
    row.update(gpu_decode.engine_step_medians(engine, prompts, device))
    cached = row["cached_step_median"]
    if floors.get("floor_seconds"):
        row.update(floor_seconds=floors["floor_seconds"], cached_over_floor=cached / floors["floor_seconds"])
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


def batch_floors(model, device, base: dict, batch: int, canvas: int) -> dict:
    """The floors at ``batch`` rows: the weights and the rows' KV cache over the datasheet and the measured copy."""
    out = gpu_decode.weight_floor(model, device, batch, canvas)
    if base.get("copy_bandwidth"):
        out["copy_floor_seconds"] = (out["weight_bytes_per_step"] + out["kv_bytes_per_step"]) / base["copy_bandwidth"]
    return out


def main(argv=None):
    parser = study_parser(__doc__, 200.0)
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes (default: 1 and the largest of the session, 32; a dry run 1 and 2)")
    parser.add_argument("--variants", nargs="+", default=[v[0] for v in VARIANTS],
                        choices=[v[0] for v in VARIANTS], help="the variants to run (default: all four)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget)
    model, _, label, (gen, block, prompt_len, batches) = gpu_decode.start_run(args)
    block = 8 if args.dry_run else block
    device = model.device
    batch_sizes = args.batches or [batches[0], batches[-1]]  # B = 1 (the goals) and the largest batch
    prompts = gpu_decode.random_prompts(model, max(batch_sizes), prompt_len)
    card, bandwidth, flop_rate = ceilings(device)
    result = dict(shape=label, device=torch.cuda.get_device_name(device) if device.type == "cuda" else
                  platform.processor() or platform.machine(), card=card, bandwidth=bandwidth, torch=torch.__version__,
                  gen_length=gen, block=block, prompt_length=prompt_len, budget_seconds=args.budget,
                  started=time.strftime("%Y-%m-%d %H:%M:%S"), variants={}, choice={})
    path = Path(args.out) / f"gpu-backbone-{args.shape}{'-dry-run' if args.dry_run else ''}.json"

    def save():
        result["choice"] = {f"B{B}": choose(result["variants"], B) for B in batch_sizes}
        atomic_write_text(path, json.dumps(result, indent=2, default=str) + "\n")

    save()
    run_stage(result, "floors", lambda: floors_stage(model, device), save, budget, 5)
    base = result["floors"] if "weight_bytes_per_step" in result["floors"] else {}
    small = check_model(args, model, device)
    spec, first = {}, {}
    # the CUDA-graph cells at every batch first, then the compile-heavy ones at B = 1
    cells = [(B, v) for B in batch_sizes for v in VARIANTS if v[1] != True and v[0] in args.variants]  # noqa: E712
    cells += [(batch_sizes[0], v) for v in VARIANTS if v[1] is True and v[0] in args.variants]
    for B, (name, mode, backbone) in cells:
        if args.dry_run:
            mode = False  # no CUDA graphs, no GPU inductor on a CPU

        def cell(B=B, mode=mode, backbone=backbone):
            settings = settings_for(gen, block, backbone)
            if B not in spec:
                spec[B] = spec_tokens(small, prompts[:B], settings)
            floors = batch_floors(model, device, base, B, prompt_len + gen)
            row, tokens = variant_row(model, small, prompts[:B], settings, device, mode, floors, spec[B],
                                      first.get(B))
            if tokens is not None:
                first.setdefault(B, tokens)
            return dict(row, compile=mode, backbone=backbone, kv_bytes_per_step=floors["kv_bytes_per_step"])
        run_stage(result["variants"], f"{name}-B{B}", cell, save, budget,
                  INDUCTOR_NEED if mode is True else CUDAGRAPHS_NEED)
    log("choice", result["choice"])
    log("wrote", path)
    return result


if __name__ == "__main__":
    main()
