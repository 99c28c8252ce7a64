"""The forward's fused tail: the LM head's greedy signals and the taps folded into controller inputs."""

import torch

from tracelock.ops.checks import FLOATS, check_arg, check_dims, check_head
from tracelock.ops.chooser import call, pick


def tap_project(h1: torch.Tensor, h2: torch.Tensor, h3: torch.Tensor, A: torch.Tensor, c: torch.Tensor, *,
                impl: str | None = None) -> torch.Tensor:
    """Fold the three hidden-state taps into controller inputs in one pass (spec: ``tap_project_ref``).

    ``out = h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c`` in fp32 from upcast inputs; with ``A`` holding the encoders'
    folded code matrices the same call writes the trace codes, without materialising deltas or codes.

    Args:
        h1, h2, h3 (torch.Tensor): [T, D] taps, fp32, fp16 or bf16; rows may be strided, each row contiguous.
        A (torch.Tensor): [3, D, N] folded weights, fp32; in the taps' 16-bit dtype for the tensor-core path on GPU.
        c (torch.Tensor): [N] bias, any float dtype above.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        out (torch.Tensor): [T, N] fp32.
    """
    check_arg("h1", h1, FLOATS, strided_rows=True)
    check_dims("h1", h1, "[T, D]")
    like = ("h1", h1)
    check_arg("h2", h2, FLOATS, h1.shape, like, strided_rows=True)
    check_arg("h3", h3, FLOATS, h1.shape, like, strided_rows=True)
    check_arg("A", A, FLOATS, like=like)
    if A.dim() != 3 or A.shape[0] != 3 or A.shape[1] != h1.shape[1]:
        raise ValueError(f"A must be [3, D, N] with D = {h1.shape[1]} (the taps' width), got shape {list(A.shape)}")
    check_arg("c", c, FLOATS, (A.shape[2],), like)
    return call("tap_project", impl, pick("tap_project", impl, h1.device), h1, h2, h3, A, c)


def window_logits_stats(hidden: torch.Tensor, weight: torch.Tensor, eos_id: int | None, *,
                        impl: str | None = None) -> tuple:
    """The LM head on the window's rows plus their greedy signals, in one online-softmax pass over the vocabulary
    (spec: ``window_logits_stats_ref``; the same values as ``tracelock.signals.compute_signals`` at T = 0).
    The Triton path never writes the [R, V] logits.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the rows, fp32, fp16 or bf16; rows may be
            strided (each row contiguous).
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16 (the hidden dtype for the tensor-core path).
        eos_id (int, optional): token whose probability goes into ``eos_prob``; None gives zeros.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (proposal [R] int64 argmax (ties to the lowest index), max_prob [R], second_prob [R] (margin =
        max_prob - second_prob), neg_entropy [R] (sum p log p), eos_prob [R]), the last four fp32.
    """
    _, V = check_head(hidden, weight)
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < V):
        raise ValueError(f"eos_id must be None or an int in [0, {V}) (the vocabulary), got {eos_id!r}")
    chosen = pick("window_logits_stats", impl, hidden.device)
    return call("window_logits_stats", impl, chosen, hidden, weight, eos_id)

