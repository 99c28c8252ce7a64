"""Learn2PD training examples from the trace store: one per recorded step, the step's block.

A trace stores tokens only; the backbone is replayed on each recorded step's canvas (`tracelock.traces.replay`) to
get the confidences of *every* position of the step's block, committed ones included, as the filter reads them at
deployment. The label of a position is whether its proposal already equals the trace's final token (upstream:
``is_correct = x0 == final``, over the whole block). The step's block is the one holding its first active position.
"""

from __future__ import annotations

import numpy as np
import torch

from tracelock.traces.replay import replay

__all__ = ["block_examples"]


def block_examples(model, traces, block: int, *, encoder=None, batch_size: int = 8) -> tuple:
    """(inputs, labels) of every recorded step of ``traces``.

    Args:
        model (DiffusionBackbone): the backbone the traces were decoded with.
        traces (iterable of Trace): decoded with semi-AR blocks of ``block`` positions.
        block (int): the filter's block size.
        encoder (TapEncoder, optional): L2P-Hidden: the inputs are the encoder's codes of each position's taps
            instead of its confidence.
        batch_size (int): replayed steps per forward. Default: 8.

    Returns:
        inputs: [N, block] fp32 confidences, or [N, block, C] fp32 codes with ``encoder``.
        labels: [N, block] fp32 1.0 where the proposal equals the final token.
        groups: [N] int64 index of each example's trace (for a split by trace).
    """
    xs, ys, groups = [], [], []
    for n, trace in enumerate(traces):
        got = trace.meta.get("block")
        if got != block:
            raise ValueError(f"trace {trace.meta.get('id', n)} was decoded with block={got!r}, not {block}: a "
                             f"Learn2PD filter learns one block size from traces of that block size; collect them "
                             f"with `tracelock collect --block {block}`")
        P = len(trace.prompt)
        final = torch.from_numpy(trace.final.astype(np.int64))
        for step, taps, proposals, confidence in replay(model, trace, batch_size=batch_size):
            still_active = np.flatnonzero(trace.commit_step >= step)
            start = int(still_active[0]) // block * block
            where = slice(start, start + block)
            if encoder is None:
                xs.append(confidence[where].float().cpu())
            else:
                codes = encoder.codes(*(t[P + start:P + start + block] for t in taps))
                xs.append(codes.float().cpu())
            ys.append((proposals[where].cpu() == final[where]).float())
            groups.append(n)
    if not xs:
        raise ValueError("no recorded steps in these traces; collect some with `tracelock collect`")
    return torch.stack(xs), torch.stack(ys), torch.tensor(groups)
