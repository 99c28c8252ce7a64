"""Replay a trace through the frozen backbone: the taps, proposals and confidences of its steps.

A trace stores tokens only (`tracelock.traces.trace`); everything a feature needs is recomputed here from
``trace.x_at(step)``. Rows are unpadded (one trace, so one length), several steps go through one forward, and
the backbone's `predict` applies Dream's shift to logits and taps alike: the features of canvas position i come
from output row ``spec.output_rows(i)``, exactly as the decode loop reads them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from tracelock.models.query import Outputs
from tracelock.signals import compute_signals
from tracelock.traces.trace import Trace


def _check_steps(trace: Trace, steps) -> np.ndarray:
    steps = np.asarray(trace.steps if steps is None else steps, dtype=np.int64).reshape(-1)
    if steps.size and (steps.min() < 0 or steps.max() >= trace.num_steps):
        raise ValueError(f"steps must lie in [0, {trace.num_steps}) for this trace (it took {trace.num_steps} "
                         f"forwards); got {steps.min()}..{steps.max()}")
    return steps


@torch.no_grad()
def replay(model, trace: Trace, steps=None, *, batch_size: int = 8) -> Iterator[tuple]:
    """Run the backbone on the canvas of each step of ``trace``.

    Args:
        model (DiffusionBackbone): the frozen backbone the trace was decoded with.
        trace (Trace): the trace.
        steps (array-like, optional): step indices to replay. Default: the trace's recorded steps.
        batch_size (int): steps per forward. Default: 8.

    Yields:
        (step, taps, proposals, confidence): ``taps`` = (h1, h2, h3), each [P + G, D] fp32 on the model's device
        (every position, prompt included); ``proposals`` [G] int64 greedy argmax over the whole generation
        region (the decode loop's proposal at temperature 0); ``confidence`` [G] fp32 its softmax probability.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    steps = _check_steps(trace, steps)
    P, G = len(trace.prompt), trace.gen_length
    L = P + G
    device = model.device
    all_pos = torch.arange(L, device=device)
    gen_pos = torch.arange(P, L, device=device)
    for lo in range(0, len(steps), batch_size):
        chunk = steps[lo:lo + batch_size]
        x = torch.from_numpy(np.stack([trace.x_at(int(s)) for s in chunk])).to(device)
        b = len(chunk)
        out = model.predict(x, gen_pos.expand(b, G), outputs=Outputs(taps=True, tap_positions=all_pos.expand(b, L)))
        signals = compute_signals(out.logits)
        taps = [t.float() for t in out.taps]
        for j, step in enumerate(chunk.tolist()):
            yield step, tuple(t[j] for t in taps), signals.proposal[j], signals.confidence[j]


def sample_taps(model, traces: list, max_positions: int, *, seed: int = 0, batch_size: int = 8) -> torch.Tensor:
    """Taps at up to ``max_positions`` (trace, recorded step, position) triples drawn uniformly without
    replacement from all of them (prompt positions included), replaying only the steps drawn.

    Returns:
        torch.Tensor: [n, 3, D] fp32 on the CPU (h1, h2, h3 of each sample).
    """
    if max_positions < 1:
        raise ValueError(f"max_positions={max_positions} must be >= 1")
    counts = [len(t.steps) * (len(t.prompt) + t.gen_length) for t in traces]
    total = sum(counts)
    if total == 0:
        raise ValueError("no positions to sample: the traces are empty (pass at least one trace with steps)")
    rng = np.random.default_rng(seed)
    picks = np.sort(rng.choice(total, min(max_positions, total), replace=False))
    from tracelock.progress import progress_bar

    out, offset = [], 0
    for trace, count in progress_bar(list(zip(traces, counts)), desc="replay", unit="trace"):
        mine = picks[(picks >= offset) & (picks < offset + count)] - offset
        offset += count
        if mine.size == 0:
            continue
        row, pos = np.divmod(mine, len(trace.prompt) + trace.gen_length)
        wanted = {}
        for r, p in zip(row.tolist(), pos.tolist()):
            wanted.setdefault(int(trace.steps[r]), []).append(p)
        for step, taps, _, _ in replay(model, trace, sorted(wanted), batch_size=batch_size):
            idx = torch.tensor(wanted[step], device=taps[0].device)
            out.append(torch.stack([t[idx] for t in taps], dim=1).cpu())
    return torch.cat(out)
