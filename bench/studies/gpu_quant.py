"""Quantized weights on one GPU (torchao, `tracelock.models.quantize`): the cached decode step per format against its
own weight-read floor and against bf16, at B = 1 and 32, and what quantizing costs (bench/studies/gpu_step_session.sh
runs it).

At a released model's shape (``--shape``, default LLaDA-8B) with random bf16 weights, Fast-dLLM's threshold 0.9
with the dual cache, gen 256 in blocks of 32 (bench/studies/gpu_decode.py's setting), the engine's steps captured as
CUDA graphs (eager kernels: torchao's products as they run without torch.compile). Stages, each guarded and skipped with
the reason when the time budget (``--budget``) has less left than it needs, B = 1 first for every format, then 32:

1. ``quantize-<fmt>`` for int8, int4, fp8 (``--formats``): a copy of the bf16 model quantized in place, its seconds
   (the load-time cost; on a real checkpoint it comes after the bf16 weights are read), the bytes a step reads
   (block weights with their scales, the bf16 head and norms), and one forward's agreement with bf16 (the greedy
   proposals over the answer positions and the logits' relative error): a format this device or the installed
   torchao cannot run is recorded as skipped with `tracelock.models.quantize`'s refusal;
2. ``b1``, ``b32``: per format (bf16 first) the median cached and refresh step over a few steps of one decode
   (``--steps``, after warm-up steps that capture the graphs), the cached step over its own floor (bytes /
   bandwidth) and over bf16's cached step (``cached_over_bf16``; the goals: int8 <= 0.6x, int4 <= 0.4x at B = 1).

``--dry-run``: the micro checkpoint on the CPU in fp32 (no bandwidth, no CUDA graphs): int8 runs, int4 and fp8 are
refused with the message a CPU user gets (tests/test_gpu_quant_script.py). The JSON (``gpu-quant-<shape>.json``)
is rewritten after every stage, so a run cut off keeps what it measured.

    python bench/studies/gpu_quant.py --out DIR [--shape llada-8b|dream-7b] [--budget SECONDS] [--dry-run]
"""

import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_decode  # noqa: E402  (bench/studies/gpu_decode.py)
from gpu_stages import Budget, ceilings, log, run_stage, step_times, study_parser, sync  # noqa: E402

from tracelock.atomic import atomic_write_text  # noqa: E402
from tracelock.models import quantize  # noqa: E402

FORMATS = ("int8", "int4", "fp8")


def quantize_stage(base, fmt: str, prompt: list, settings: dict, device, bandwidth, models: dict) -> dict:
    """``base`` copied and quantized to ``fmt`` (kept in ``models`` for the timing stages), its seconds, bytes, floor
    and one forward's agreement with ``base``; a format the device cannot run: skipped with the refusal."""
    why = quantize.device_refusal(fmt, device, base.dtype)
    if why is None:
        try:
            quantize.import_torchao(fmt)
        except quantize.MissingExtraError as err:
            why = str(err)
    if why:
        return dict(skipped=why)
    sync(device)
    start = time.perf_counter()
    model = copy.deepcopy(base)
    copied = time.perf_counter() - start
    sync(device)
    start = time.perf_counter()
    quantize.quantize_model(model, fmt)
    sync(device)
    seconds = time.perf_counter() - start
    models[fmt] = model
    bytes_ = quantize.weight_bytes(model)
    read = sum(bytes_.values())
    out = dict(config=type(quantize.config(fmt)).__name__, quantize_seconds=seconds, copy_seconds=copied,
               weight_bytes=bytes_, weight_bytes_per_step=read, layers=len(quantize.quantized_layers(model)))
    if bandwidth:
        out["floor_seconds"] = read / bandwidth
    out.update(agreement(base, model, prompt, settings["gen_length"]))
    return out


def agreement(base, model, prompt: list, gen: int) -> dict:
    """One full forward of the prompt and a masked answer: the share of answer positions whose greedy proposal is
    the same as ``base``'s, and the logits' relative error there."""
    device = base.device
    ids = torch.tensor([prompt + [base.spec.mask_id] * gen], device=device)
    positions = torch.arange(len(prompt), len(prompt) + gen, device=device)[None]
    with torch.no_grad():
        want = base.predict(ids, positions).logits.float()
        got = model.predict(ids, positions).logits.float()
    return dict(proposal_agreement=(want.argmax(-1) == got.argmax(-1)).float().mean().item(),
                logits_relative_error=((got - want).norm() / want.norm()).item())


def step_medians(model, prompts: list, settings: dict, device, mode, steps: int) -> dict:
    """The median cached and refresh step of one decode of ``prompts`` on an engine (``mode``): the first block's
    steps, after ``warmup`` steps (a refresh and cached steps: the graphs captured), ``steps`` timed."""
    engine = gpu_decode._engine(model, prompts, settings, mode)
    for p in prompts:
        engine.admit(p)
    times = step_times(engine, device, warmup=3, limit=steps)
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(cached_step_median=statistics.median(times["cached"]) if times["cached"] else None,
                cached_steps=len(times["cached"]),
                refresh_step_median=statistics.median(times["refresh"]) if times["refresh"] else None)


def timing_stage(models: dict, prompts: list, settings: dict, device, mode, steps: int, result: dict) -> dict:
    """`step_medians` per format (the unquantized model first: bf16, fp32 in a dry run), each cached step over its own
    floor and over the unquantized model's."""
    out = {}
    base = next(iter(models))
    for fmt, model in models.items():
        try:
            row = step_medians(model, prompts, settings, device, mode, steps)
        except Exception as err:  # one format failing (a kernel, out of memory) leaves the others their rows
            out[fmt] = dict(error=f"{type(err).__name__}: {err}"[:500])
            continue
        floor = (result["floor"] if fmt == base else result[f"quantize-{fmt}"]).get("floor_seconds")
        cached = row["cached_step_median"]
        if floor and cached:
            row["cached_over_own_floor"] = cached / floor
        unquantized = out.get(base, {}).get("cached_step_median")
        if unquantized and cached:
            row[f"cached_over_{base}"] = cached / unquantized
        out[fmt] = row
        log(f"  {fmt}", row)
    return out


def main(argv=None):
    parser = study_parser(__doc__, 45.0)
    parser.add_argument("--formats", default=",".join(FORMATS), help="formats, comma-separated (default: all)")
    parser.add_argument("--steps", type=int, default=8, help="cached steps timed per format and batch (8)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget)
    formats = [quantize.quantize_format(f) for f in args.formats.split(",") if f.strip()]
    model, _, label, (gen, block, prompt_len, batches) = gpu_decode.start_run(args)
    device = model.device
    card, bandwidth, _ = ceilings(device)
    mode = False if args.dry_run else "cudagraphs"
    prompts = gpu_decode.random_prompts(model, max(batches), prompt_len)
    settings = dict(gpu_decode.RULE, gen_length=gen, block=block)
    torchao = None
    try:
        torchao = quantize.import_torchao().__version__
    except quantize.MissingExtraError as err:
        torchao = f"not importable: {err}"
    floor = dict(weight_bytes_per_step=sum(quantize.weight_bytes(model).values()))
    if bandwidth:
        floor["floor_seconds"] = floor["weight_bytes_per_step"] / bandwidth
    result = dict(shape=label, device=torch.cuda.get_device_name(device) if device.type == "cuda" else
                  platform.processor() or platform.machine(), card=card, bandwidth=bandwidth, torch=torch.__version__,
                  torchao=torchao, dtype=str(model.dtype), settings=settings, prompt_length=prompt_len,
                  engine_mode=mode, budget_seconds=args.budget, floor=floor)
    path = Path(args.out) / f"gpu-quant-{args.shape}{'-dry-run' if args.dry_run else ''}.json"

    def save():
        atomic_write_text(path, json.dumps(result, indent=2, default=str) + "\n")

    save()
    log("floor", floor)
    models = {{torch.bfloat16: "bf16", torch.float32: "fp32"}.get(model.dtype, str(model.dtype)): model}
    for fmt in formats:
        run_stage(result, f"quantize-{fmt}", lambda fmt=fmt: quantize_stage(model, fmt, prompts[0], settings, device,
                                                                           bandwidth, models), save, budget, 6)
    for B in (batches[0], batches[-1]):  # 1 and 32 (a dry run: 1 and 2)
        run_stage(result, f"b{B}", lambda B=B: timing_stage(models, prompts[:B], settings, device, mode, args.steps,
                                                          result), save, budget, 4 * len(models))
    log("wrote", path)
    return result


if __name__ == "__main__":
    main()
