"""The static-shape decode step on one GPU, in one call (bench/studies/gpu_compile_session.sh runs it).

At LLaDA-8B's shape with random bf16 weights, B = 1, gen 256, blocks of 32, Fast-dLLM's threshold 0.9 with the dual
cache (random weights spread the logits: one commit per step, so a block is one refresh and 31 cached steps):

1. the cached step's time (CUDA events around each step the engine ran as cached only) against the weight-read floor,
   the bytes a step must read (every weight but the embedding table) over the card's bandwidth; goal <= 1.3x;
2. Fast-dLLM's own ``generate_with_dual_cache`` on the same weights and prompts (`bench/peers.py`): time per item,
   NFE, agreement with tracelock's tokens (bf16: the two round differently, so no exact match is asked for);
3. tokens/s at B = 1, 8, 32: the eager loop, the engine's steps captured as CUDA graphs (``compile="cudagraphs"``:
   no compile time) and, at B = 1, torch.compile with CUDA graphs (``compile=True``) when ``--inductor`` is given;
4. host syncs per step (``torch.cuda.set_sync_debug_mode``): the eager loop's and the engine's.

``--dry-run`` runs the same code on the CPU at a tiny shape (the micro LLaDA checkpoint, gen 16, blocks of 4, B = 1
and 2; the engine uncompiled, as a CPU has no CUDA graphs; no bandwidth, no sync count), so the script is tested
without a GPU (tests/test_gpu_decode_script.py). Fast-dLLM's code must be on the device (``--peer-fastdllm DIR``;
it needs einops); without it the row says why it was skipped.
Everything lands in ``--out`` as one JSON plus the printed lines; the JSON is rewritten (atomically) after each stage,
so a run cut off by its time limit keeps the stages it finished.

    python bench/studies/gpu_decode.py --out DIR [--dry-run] [--peer-fastdllm DIR] [--inductor]
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # bench/peers.py
import peers  # noqa: E402  (bench/peers.py)
from gpu_stages import step_times  # noqa: E402

import tracelock  # noqa: E402
from tracelock.atomic import atomic_write_text  # noqa: E402
from tracelock.decode.engine import DecodeEngine, prompt_bucket  # noqa: E402
from tracelock.testing import counting_cuda_syncs  # noqa: E402

# HBM bandwidth of the cards we may get (bytes/s), from NVIDIA's data sheets (SXM)
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
RULE = dict(policy="threshold", policy_args={"tau": 0.9}, cache="dual")


def log(*args):
    print(*args, flush=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_run(args) -> tuple:
    """(model, llada config, label, (gen, block, prompt_len, batches)) of a GPU session script's run: ``args.out``
    made, a CUDA device required unless ``args.dry_run``, one torch thread on a dry run's CPU."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU")
    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    model, config, label = load_shape(args.shape, args.dry_run, args.out)
    return model, config, label, sizes(args.dry_run)


def load_shape(name: str, dry_run: bool, out) -> tuple:
    """(model, official config dict, label) of ``name`` (``tracelock.models.shapes.SHAPES``): random bf16 weights on
    CUDA, or in a dry run the micro checkpoint of the same family on the CPU (written under ``out``)."""
    from tracelock.models.shapes import SHAPES, random_backbone
    from tracelock.models.tiny import dream_config, llada_config

    family, sizes, vocab, max_pos, ids = SHAPES[name]
    if dry_run:
        from tracelock.models import write_tiny_checkpoint

        folder = write_tiny_checkpoint(Path(out) / f"micro-{family}", family=family, seed=0)
        return (tracelock.load_model(folder), json.loads((folder / "config.json").read_text()),
                f"micro-{family} (dry run, CPU)")
    model = random_backbone(name, device="cuda", dtype=torch.bfloat16)
    make = llada_config if family == "llada" else dream_config
    return model, make(*sizes, ids, vocab_rows=vocab, max_positions=max_pos), f"{name} shape, random bf16 weights"


def random_prompts(model, count: int, length: int) -> list:
    """``count`` prompts of ``length`` random ordinary tokens (ids below every special id), seed 0."""
    g = torch.Generator().manual_seed(0)
    top = min(model.spec.mask_id, model.spec.eos_id) - 1
    return torch.randint(0, top, (count, length), generator=g).tolist()


def sizes(dry_run: bool) -> tuple:
    """(gen, block, prompt length, batches): LLaDA's paper setting on a GPU, a tiny one in a dry run."""
    return (16, 4, 12, (1, 2)) if dry_run else (256, 32, 128, (1, 8, 32))


def setup(args):
    """(model, prompts, settings, official config dict, device, label, batches) at LLaDA-8B's shape."""
    model, config, label = load_shape("llada-8b", args.dry_run, args.out)
    gen, block, prompt_len, batches = sizes(args.dry_run)
    prompts = random_prompts(model, max(batches), prompt_len)
    return model, prompts, dict(RULE, gen_length=gen, block=block), config, model.device, label, batches


def weight_floor(model, device, batch: int = 1, canvas: int | None = None) -> dict:
    """The bytes a cached step reads (every parameter but the embedding table, whose rows are gathered; with
    ``canvas``, also the KV cache of ``batch`` rows of ``canvas`` positions, which a dual-cache step's attention reads
    whole) and, on a known card, the time reading them takes at the card's bandwidth (``floor_seconds``; the weights
    alone: ``weight_floor_seconds``)."""
    read = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name != "embed.weight")
    spec = model.spec
    kv = 0 if canvas is None else (2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * batch * canvas *
                                   next(model.parameters()).element_size())
    out = dict(weight_bytes_per_step=read, kv_bytes_per_step=kv, batch=batch, canvas=canvas)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        card = next((k for k in BANDWIDTH if k in name), None)
        if card:
            out.update(card=card, bandwidth=BANDWIDTH[card], floor_seconds=(read + kv) / BANDWIDTH[card],
                       weight_floor_seconds=read / BANDWIDTH[card])
    return out


def time_engine_steps(model, prompts, settings, device, compile) -> dict:
    """Decode ``prompts`` on an engine, timing every step; the medians of the cached-only and refresh steps."""
    engine = _engine(model, prompts, settings, compile)
    engine_step_medians(engine, prompts, device)  # the first round compiles / captures; the second is timed
    return engine_step_medians(engine, prompts, device)


def engine_step_medians(engine, prompts, device) -> dict:
    """One decode of ``prompts`` on ``engine`` (reset first), every step timed: the cached-only and refresh steps'
    medians and counts."""
    engine.reset()
    for p in prompts:
        engine.admit(p)
    times = step_times(engine, device)
    return dict(cached_step_median=statistics.median(times["cached"]), cached_steps=len(times["cached"]),
                refresh_step_median=statistics.median(times["refresh"]) if times["refresh"] else None,
                refresh_steps=len(times["refresh"]))


def _engine(model, prompts, settings, compile) -> DecodeEngine:
    bucket = prompt_bucket(max(map(len, prompts)), settings["gen_length"], model.spec.max_positions)
    return DecodeEngine(model, slots=len(prompts), prompt_len=bucket, compile=compile, **settings)


def _decode(model, prompts, settings, engine):
    """One decode of ``prompts``: on ``engine``, or the eager loop (``fused_generate``) when it is None."""
    if engine is None:
        tokens, stats = tracelock.fused_generate(model, prompts, **settings)
        return tokens, stats.steps, stats.forwards
    engine.reset()
    slots = [engine.admit(p) for p in prompts]
    before = engine.forwards
    while engine.step():
        pass
    rows = [engine.result(s) for s in slots]
    return torch.cat([t for t, _ in rows]), [st.steps[0] for _, st in rows], engine.forwards - before


def tokens_per_second(model, prompts, settings, device, compile, rounds=2) -> tuple:
    """(row, tokens): generated tokens per second on ``prompts`` after a warm-up decode (the eager loop for
    ``compile=None``, else an engine with that compile mode), and the tokens of the last decode."""
    engine = None if compile is None else _engine(model, prompts, settings, compile)
    _decode(model, prompts, settings, engine)
    best, out = None, None
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        out = _decode(model, prompts, settings, engine)
        _sync(device)
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    tokens, steps, forwards = out
    generated = len(prompts) * settings["gen_length"]
    row = dict(seconds=best, tokens_per_second=generated / best, mean_steps=sum(steps) / len(prompts),
               forwards=forwards)
    return row, tokens


def syncs_per_step(model, prompts, settings, device, compile) -> dict | None:
    """Host syncs per step of one decode (the eager loop for ``compile=None``, else an engine), counted by torch's
    CUDA sync debug mode (CUDA only). The count covers the whole decode: an engine's admission and result reads too."""
    if device.type != "cuda":
        return None
    engine = None if compile is None else _engine(model, prompts, settings, compile)
    _decode(model, prompts, settings, engine)  # warm: captures and compiles happen outside the count
    with counting_cuda_syncs() as syncs:
        _, steps, _ = _decode(model, prompts, settings, engine)
    return dict(syncs=len(syncs), steps=max(steps), per_step=len(syncs) / max(steps))


def fastdllm_row(args, model, config, prompts, settings, ours_tokens) -> dict:
    folder, why = peers.find_fastdllm(args.peer_fastdllm)
    if folder is None:
        return dict(skipped=why)
    module = peers.llada_generate_module(folder)
    peer = peers.load_llada(folder, model, config)
    G, block = settings["gen_length"], settings["block"]
    run = lambda: peers.run_llada(module, peer, "fastdllm-0.9-dual", prompts[0], gen_length=G, block=block,  # noqa
                                  mask_id=model.spec.mask_id)
    run()
    _sync(model.device)
    start = time.perf_counter()
    canvas, nfe = run()
    _sync(model.device)
    seconds = time.perf_counter() - start
    agreement = (canvas[0, -G:].cpu() == ours_tokens[0, -G:].cpu()).float().mean().item()
    return dict(seconds_per_item=seconds, nfe=int(nfe), agreement=agreement, peer=peers.fastdllm_version(folder))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the JSON (created)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, micro checkpoint, gen 16, blocks of 4, B = 1 and 2 (default: off)")
    parser.add_argument("--peer-fastdllm", default=None, help="Fast-dLLM checkout (default: ../shared/peers/fast-dllm)")
    parser.add_argument("--inductor", action="store_true",
                        help="also time torch.compile + CUDA graphs at B = 1 (slow to compile at 8B; default: off)")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU")
    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    model, prompts, settings, config, device, label, batches = setup(args)
    # the CPU has no CUDA graphs: the dry run takes the engine's steps uncompiled (tests/ check the compiled path)
    captured = False if args.dry_run else "cudagraphs"
    result = dict(shape=label, device=torch.cuda.get_device_name(device) if device.type == "cuda" else
                  platform.processor() or platform.machine(), torch=torch.__version__, settings=settings,
                  batches=list(batches), prompt_length=len(prompts[0]), engine_mode=captured)
    path = Path(args.out) / ("gpu-decode-dry-run.json" if args.dry_run else "gpu-decode.json")

    def save():
        atomic_write_text(path, json.dumps(result, indent=2, default=str) + "\n")

    result["floor"] = weight_floor(model, device)
    log("floor", result["floor"])

    result["steps_b1"] = time_engine_steps(model, prompts[:1], settings, device, captured)
    floor = result["floor"].get("floor_seconds")
    if floor:
        result["steps_b1"]["cached_over_floor"] = result["steps_b1"]["cached_step_median"] / floor
    log("steps B=1", result["steps_b1"])
    save()

    result["throughput"], tokens_b1 = {}, None
    for B in batches:
        for mode in (None, captured):
            row, tokens = tokens_per_second(model, prompts[:B], settings, device, mode)
            name = "eager-loop" if mode is None else f"engine-{mode or 'uncompiled'}"
            result["throughput"][f"B{B}-{name}"] = row
            if B == 1 and mode is None:
                tokens_b1 = tokens
            log(f"B={B} {name}", row)
            save()
    if args.inductor and device.type == "cuda":
        row, _ = tokens_per_second(model, prompts[:1], settings, device, True, rounds=1)
        result["throughput"]["B1-engine-inductor"] = row
        log("B=1 engine-inductor", row)

    result["syncs"] = {("eager-loop" if m is None else f"engine-{m or 'uncompiled'}"):
                       syncs_per_step(model, prompts[:1], settings, device, m) for m in (None, captured)}
    log("syncs", result["syncs"])
    save()
    result["fastdllm_dual"] = fastdllm_row(args, model, config, prompts, settings, tokens_b1)
    log("fastdllm", result["fastdllm_dual"])
    save()
    log("wrote", path)
    return result


if __name__ == "__main__":
    main()
