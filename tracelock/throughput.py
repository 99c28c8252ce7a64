"""Throughput mode: decode many prompts in batches formed by length, and report tokens per second.

Sorting by prompt length keeps the left padding of each batch small (every row of a batch is padded to its longest
prompt, and padded positions still run through the backbone). Rows decode independently (batch == single), so the
order changes the cost, never the tokens.
"""

import time
from dataclasses import dataclass

import torch

from tracelock.decode.settings import FIELDS, settings_from


@dataclass
class ThroughputStats:
    """What a throughput run cost: tokens are generated tokens before each row's first end token."""

    prompts: int
    batches: int
    tokens: int
    steps: int  # forwards summed over rows
    seconds: float
    padding: float  # share of prompt positions that were left padding

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def length_batches(prompts: list, batch_size: int) -> list:
    """Index lists of at most ``batch_size`` prompts, longest first, so each batch holds similar lengths."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int")
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def generate_many(model, prompts: list, settings=None, *, batch_size: int, generate=None, **decode_args):
    """Decode token-id ``prompts`` (a list of lists) in length-sorted batches of ``batch_size``.

    Args:
        model: a `tracelock.load_model` backbone.
        prompts (list): token-id lists.
        settings (DecodeSettings, optional): the decoding settings (or its fields as keywords, in ``decode_args``).
        batch_size (int): rows per batch.
        generate (callable, optional): `tracelock.fused_generate` (default) or `tracelock.reference_generate`.
        **decode_args: `DecodeSettings`'s fields and `fused_generate`'s other arguments (impl, compile, ...).

    Returns:
        (outputs, ThroughputStats): ``outputs[i]`` = (generated token ids, steps) of ``prompts[i]``, in input order.
    """
    if generate is None:
        from tracelock.generate import fused_generate as generate
    from tracelock.checks import check_prompt_lists

    check_prompt_lists(prompts, name="prompts")
    fields = {k: decode_args.pop(k) for k in FIELDS if k in decode_args}
    settings = settings_from(settings, fields, "generate_many")  # checked once, for every batch
    gen_length = settings.gen_length
    outputs, tokens, steps, padded, total = [None] * len(prompts), 0, 0, 0, 0
    batches = length_batches(prompts, batch_size)
    start = time.perf_counter()
    for batch in batches:
        rows = [prompts[i] for i in batch]
        canvas, stats = generate(model, rows, settings, **decode_args)
        generated = canvas[:, -gen_length:].tolist()
        for j, i in enumerate(batch):
            outputs[i] = (generated[j], stats.steps[j])
        tokens += sum(stats.gen_lengths)
        steps += sum(stats.steps)
        width = canvas.shape[1] - gen_length
        padded += sum(width - len(r) for r in rows)
        total += width * len(rows)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    return outputs, ThroughputStats(prompts=len(prompts), batches=len(batches), tokens=tokens, steps=steps,
                                    seconds=seconds, padding=padded / total)
