"""The race at a fixed commit rate on one GPU: Fast-dLLM's own code against tracelock's eager loop and engine, at a
released model's shape (bench/studies/gpu_step_session.sh runs it once per shape).

Random weights spread the logits, so a threshold rule commits one token per step there (bench/studies/gpu_decode.py); a
trained model commits several. This race fixes the rate instead: k tokens per step (``--per-step``, default 2 and
4) on both sides, with the dual cache, in blocks of 32 of gen 256 after 128-token random prompts:

- Fast-dLLM: its own ``steps`` argument, ``steps = 256 // k`` (LLaDA: ``generate_with_dual_cache`` with no
  threshold, LLaDA's low-confidence schedule; Dream: its block sampler's scheduled rule with ``dual_cache=True``,
  ``int(n (1 - s/t))`` per step ranked by neg-entropy); batch 1 (its functions decode one prompt at a time);
- tracelock: ``confidence`` with ``steps = 256 // k`` (``per_step=k``; Dream: ranked by ``neg_entropy``), the eager loop
  (``fused_generate``) and the engine with its steps captured as CUDA graphs, at B = 1, 32, 8 (that order); with
  ``--inductor``, also torch.compile + CUDA graphs at B = 1, right after the other B = 1 cells (it needs 90 s of the
  budget; the larger batches then get what is left).

First, at B = 1 and the first k, the engine's step medians (cached and refresh steps apart) and the cached step
over the weight-read floor at this shape. Each cell of the race is one warm-up decode and one timed decode (seconds
per item, tokens/s, mean steps, forwards); Fast-dLLM's row has its NFE and the share of its tokens equal to
tracelock's eager B = 1 tokens (bf16 rounds differently in the two: no exact match is asked for on a GPU; the dry run
in fp32 is exact for LLaDA). Every cell is guarded (an error is recorded in its place) and skipped, with the reason,
when the time budget (``--budget``) has less left than it needs; the JSON (``gpu-race-<shape>.json``) is rewritten
atomically after every cell, with the speedups, the summary and the table.

``--dry-run``: the micro checkpoint of the shape's family on the CPU, gen 16, blocks of 8, B = 1 and 2, the engine
uncompiled (tests/test_gpu_decode_script.py).

    python bench/studies/gpu_race.py --out DIR [--shape llada-8b|dream-7b] [--per-step 2 4] [--budget SECONDS]
        [--peer-fastdllm DIR] [--inductor] [--dry-run]
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # bench/peers.py
import gpu_decode  # noqa: E402  (bench/studies/gpu_decode.py)
import peers  # noqa: E402  (bench/peers.py)
from gpu_stages import Budget, log, run_stage, sync  # noqa: E402  (bench/studies/gpu_stages.py)
from gpu_step import steps_over_floor  # noqa: E402  (bench/studies/gpu_step.py)

from tracelock.atomic import atomic_write_text  # noqa: E402


def our_settings(family: str, k: int, gen: int, block: int) -> dict:
    """tracelock's side of the race: k per step in blocks with the dual cache, Dream ranked by neg-entropy."""
    # steps = gen // k is what ``per_step=k`` means to fused_generate (`tracelock.policies.with_steps`); the engine
    # takes the policy's own argument
    args = {"steps": gen // k} if family == "llada" else {"steps": gen // k, "score": "neg_entropy"}
    return dict(policy="confidence", policy_args=args, gen_length=gen, block=block, cache="dual")


def engine_settings(settings: dict, backbone: str | None) -> dict:
    """``settings`` for an engine cell: the eager loop has no backbone choice, the engine takes ``backbone``."""
    return settings if backbone is None else dict(settings, backbone=backbone)


def tokens_check(folder, model, config, shape: str | None, k: int, gen: int, block: int, prompt_len: int,
                 device) -> dict:
    """Before timing: Fast-dLLM's own code and tracelock's eager loop decode the same tokens at k per step, in fp32
    (bf16 rounds differently in the two): on the shape's first two layers (``shape``; the race's bf16 model is not
    used), or on ``model`` itself when ``shape`` is None (a dry run's fp32 micro checkpoint)."""
    import tracelock
    from tracelock.models.shapes import SHAPES, random_backbone
    from tracelock.models.tiny import dream_config, llada_config

    family = model.spec.family
    if shape is not None:
        _, sizes, vocab, max_pos, ids = SHAPES[shape]
        model = random_backbone(shape, layers=2, device=device, dtype=torch.float32)
        make = llada_config if family == "llada" else dream_config
        config = make(sizes[0], sizes[1], sizes[2], 2, sizes[4], ids, vocab_rows=vocab, max_positions=max_pos)
    fast = FastDLLM(folder, model, config)
    prompt = gpu_decode.random_prompts(model, 1, prompt_len)[0]
    ours, _ = tracelock.fused_generate(model, [prompt], **our_settings(family, k, gen, block))
    canvas, _ = fast.run(prompt, gen=gen, block=block, steps=gen // k)
    same = (canvas[0, -gen:].cpu() == ours[0, -gen:].cpu()).float().mean().item()
    out = dict(layers=model.spec.num_layers, dtype=str(model.dtype), agreement=same, tokens_equal=same == 1.0)
    if device.type == "cuda":
        del model, fast
        torch.cuda.empty_cache()
    return out


class FastDLLM:
    """Fast-dLLM's own code on the model's weights (``bench/peers.py``): ``run(prompt, steps)`` -> (canvas, NFE)."""

    def __init__(self, folder, model, config):
        self.family, self.folder, self.model = model.spec.family, folder, model
        if self.family == "llada":
            self.module = peers.llada_generate_module(folder)
            self.peer = peers.load_llada(folder, model, config)
        else:
            self.peer = peers.load_dream(folder, model, config)
            # its sampler returns no NFE: its forwards are counted
            self.forwards = 0
            self.peer.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.forwards += 1

    def run(self, prompt, *, gen: int, block: int, steps: int):
        if self.family == "llada":
            return peers.run_llada(self.module, self.peer, "confidence-dual", prompt, gen_length=gen, block=block,
                                   mask_id=self.model.spec.mask_id, steps=steps)
        config = peers.dream_generation_config(self.folder, self.model.spec, gen, steps, alg="entropy")
        self.forwards = 0
        canvas = peers.run_dream(self.peer, config, prompt, block=block)
        return canvas, self.forwards


def fastdllm_cell(fast, prompt, gen, block, k, ours_tokens, device) -> dict:
    """Fast-dLLM at k per step on one prompt: one warm-up, one timed run."""
    steps = gen // k
    fast.run(prompt, gen=gen, block=block, steps=steps)
    sync(device)
    start = time.perf_counter()
    canvas, nfe = fast.run(prompt, gen=gen, block=block, steps=steps)
    sync(device)
    seconds = time.perf_counter() - start
    out = dict(seconds_per_item=seconds, tokens_per_second=gen / seconds, steps_argument=steps, nfe=int(nfe))
    if ours_tokens is not None:
        out["agreement"] = (canvas[0, -gen:].cpu() == ours_tokens[0, -gen:].cpu()).float().mean().item()
    return out


def our_cell(model, prompts, settings, device, mode) -> tuple:
    """(row, tokens): tracelock's loop (``mode`` None) or engine on ``prompts``, one warm-up and one timed decode."""
    row, tokens = gpu_decode.tokens_per_second(model, prompts, settings, device, mode, rounds=1)
    row["seconds_per_item"] = row["seconds"] / len(prompts)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the JSON (created)")
    parser.add_argument("--shape", default="llada-8b", choices=["llada-8b", "dream-7b"],
                        help="the released shape (default: llada-8b)")
    parser.add_argument("--per-step", type=int, nargs="+", default=[2, 4], help="tokens per step k (2 4)")
    parser.add_argument("--budget", type=float, default=170.0,
                        help="seconds the cells may take; a cell that needs more than is left is skipped (170)")
    parser.add_argument("--peer-fastdllm", default=None, help="Fast-dLLM checkout (default: ../shared/peers/fast-dllm)")
    parser.add_argument("--inductor", action="store_true",
                        help="also torch.compile + CUDA graphs at B = 1 when the budget allows (default: off)")
    parser.add_argument("--backbone", default=None, choices=["kernels", "specs", "kernels+matmul"],
                        help="the engine cells' backbone ops (DecodeEngine's backbone=; default: the engine's)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, micro checkpoint, tiny shapes (default: off)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget)
    model, config, label, (gen, block, prompt_len, batches) = gpu_decode.start_run(args)
    # a dry run's blocks of 8 keep two steps per block at k = 4 (Fast-dLLM's dual cache indexes past its schedule
    # when a block has one step)
    block = 8 if args.dry_run else block
    bad = [k for k in args.per_step if k < 1 or block % k]
    if bad:
        parser.error(f"--per-step {bad}: k must divide the block ({block}) so that steps = {gen} // k is a whole "
                     "number of steps per block")
    prompts = gpu_decode.random_prompts(model, max(batches), prompt_len)
    device, family = model.device, model.spec.family
    mode = False if args.dry_run else "cudagraphs"
    engine_name = f"engine-{mode or 'uncompiled'}"
    result = dict(shape=label, device=torch.cuda.get_device_name(device) if device.type == "cuda" else
                  platform.processor() or platform.machine(), torch=torch.__version__, gen_length=gen, block=block,
                  prompt_length=prompt_len, batches=list(batches), per_step=args.per_step, budget_seconds=args.budget,
                  settings={f"k{k}": our_settings(family, k, gen, block) for k in args.per_step},
                  floor=gpu_decode.weight_floor(model, device, 1, prompt_len + gen), cells={})
    path = Path(args.out) / f"gpu-race-{args.shape}{'-dry-run' if args.dry_run else ''}.json"
    cells = result["cells"]

    def save():
        # the speedups, the goals' ratios and the table after every cell: a run cut off keeps them
        speedups(cells, args.per_step)
        result["summary"] = summary(cells, args.per_step, batches, engine_name)
        atomic_write_text(path, json.dumps(result, indent=2, default=str) + "\n")
        atomic_write_text(path.with_name(f"race-{args.shape}{'-dry-run' if args.dry_run else ''}.md"),
                          markdown(result))

    folder, why = peers.find_fastdllm(args.peer_fastdllm)
    fast = None
    if folder is None:
        result["fastdllm"] = dict(skipped=why)
    else:
        result["fastdllm"] = dict(peer=peers.fastdllm_version(folder))
        try:
            fast = FastDLLM(folder, model, config)
        except Exception as err:  # recorded; tracelock's cells still run
            result["fastdllm"]["error"] = f"{type(err).__name__}: {err}"
    save()

    # first, where Fast-dLLM runs: the two decode the same tokens (fp32, two layers); then the cached step against
    # the weight-read floor at this shape, at the race's first k
    k = args.per_step[0]
    if fast is not None:
        run_stage(result, "tokens_check", lambda: tokens_check(folder, model, config, None if args.dry_run else
                                                               args.shape, k, gen, block, prompt_len, device),
                  save, budget, 20)
    run_stage(cells, f"k{k}-B1-steps", lambda: steps_over_floor(
        model, prompts[0], engine_settings(our_settings(family, k, gen, block), args.backbone), device, mode), save,
              budget, 10)
    first, rest = list(batches[:1]), sorted(batches[1:], reverse=True)  # B = 1 (the goals), then the largest batch
    tokens_b1 = {}
    for B in first + rest:
        for k in args.per_step:
            settings = our_settings(family, k, gen, block)
            for mode_name, m in (("eager-loop", None), (engine_name, mode)):
                def cell(B=B, settings=settings, m=m, k=k):
                    run = settings if m is None else engine_settings(settings, args.backbone)
                    row, tokens = our_cell(model, prompts[:B], run, device, m)
                    if B == 1 and m is None:
                        tokens_b1[k] = tokens
                    return row
                run_stage(cells, f"k{k}-B{B}-{mode_name}", cell, save, budget, 10 if B == 1 else 25)
            if B == 1 and fast is not None:
                run_stage(cells, f"k{k}-B1-fastdllm", lambda k=k: fastdllm_cell(
                    fast, prompts[0], gen, block, k, tokens_b1.get(k), device), save, budget, 15)
        if B == 1 and args.inductor and device.type == "cuda":  # asked for: before the larger batches
            k = args.per_step[0]
            run_stage(cells, f"k{k}-B1-engine-inductor", lambda k=k: our_cell(
                model, prompts[:1], our_settings(family, k, gen, block), device, True)[0], save, budget, 90)
    save()
    log(markdown(result))
    log("summary", result["summary"])
    log("wrote", path)
    return result


def markdown(result: dict) -> str:
    """The race's cells as a markdown table: per cell seconds per item, tokens/s, steps, forwards (NFE for
    Fast-dLLM), and Fast-dLLM's seconds per item over the cell's at the same k (B = 1 cells per item, larger batches
    per item of the batch); a cell that did not run says why."""
    cells = result["cells"]
    lines = [f"### {result['shape']}, {result['device']}: gen {result['gen_length']}, blocks of {result['block']}, "
             f"dual cache, k tokens per step", "",
             "| cell | seconds per item | tokens/s | steps | forwards | Fast-dLLM / cell, per item |",
             "|---|---|---|---|---|---|"]
    for name, c in cells.items():
        if "seconds_per_item" not in c:
            why = c.get("skipped") or c.get("error") or ""
            if "cached_step_median" in c:
                why = f"cached step {c['cached_step_median'] * 1e3:.2f} ms" + (
                    f", {c['cached_over_floor']:.2f}x the weight-read floor" if "cached_over_floor" in c else "")
            lines.append(f"| {name} | {why[:100]} | | | | |")
            continue
        k = name.split("-")[0]
        fast = cells.get(f"{k}-B1-fastdllm", {}).get("seconds_per_item")
        ratio = f"{fast / c['seconds_per_item']:.2f}x" if fast else ""
        steps = c.get("mean_steps", c.get("steps_argument"))
        lines.append(f"| {name} | {c['seconds_per_item']:.3f} | {c['tokens_per_second']:.1f} | {steps} | "
                     f"{c.get('forwards', c.get('nfe'))} | {ratio} |")
    return "\n".join(lines) + "\n"


def speedups(cells: dict, per_step) -> None:
    """Each tracelock cell's ``speedup_vs_fastdllm``: Fast-dLLM's seconds per item (one prompt at a time, B = 1) over
    the cell's seconds per item at the same k, as a number in the cell."""
    for k in per_step:
        fast = cells.get(f"k{k}-B1-fastdllm", {}).get("seconds_per_item")
        for name, c in cells.items():
            if fast and name.startswith(f"k{k}-") and "fastdllm" not in name and "seconds_per_item" in c:
                c["speedup_vs_fastdllm"] = fast / c["seconds_per_item"]


def summary(cells: dict, per_step, batches, engine_name) -> dict:
    """The goals' ratios where their cells ran: the cached step over the floor at B = 1, tracelock's engine over
    Fast-dLLM per item at B = 1, and tokens/s at the largest batch over B = 1 (engine)."""
    out = {}
    steps = cells.get(f"k{per_step[0]}-B1-steps", {})
    if "cached_over_floor" in steps:
        out["B1-cached-step-over-floor"] = steps["cached_over_floor"]
    for k in per_step:
        engine1, fast = cells.get(f"k{k}-B1-{engine_name}", {}), cells.get(f"k{k}-B1-fastdllm", {})
        if "seconds_per_item" in engine1 and "seconds_per_item" in fast:
            out[f"k{k}-B1-engine-vs-fastdllm"] = fast["seconds_per_item"] / engine1["seconds_per_item"]
        top = cells.get(f"k{k}-B{max(batches)}-{engine_name}", {})
        if "tokens_per_second" in engine1 and "tokens_per_second" in top:
            out[f"k{k}-B{max(batches)}-over-B1-tokens-per-second"] = top["tokens_per_second"] / engine1[
                "tokens_per_second"]
    return out


if __name__ == "__main__":
    main()
