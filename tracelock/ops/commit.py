"""The commit rule of a step (`commit_step`), in place on the canvas."""

import torch

from tracelock.ops.checks import FLOATS, check_arg, check_dims, check_no_nan
from tracelock.ops.chooser import call, pick


def _check_commit_step_args(score, tau, active, proposal, positions, x, state, end_ids, theta, cap, fallback_score,
                            held, inclusive, fill_id, stop_at_eot) -> None:
    """`commit_step`'s argument checks: each names the argument and what it must be."""
    from tracelock.kernels.ref import commit_margin_threshold

    check_arg("x", x, (torch.int64,))
    check_dims("x", x, "[B, L]")
    check_arg("score", score, FLOATS, like=("x", x))
    check_dims("score", score, "[B, R]")
    B, L = x.shape
    R = score.shape[1]
    if score.shape[0] != B or R == 0 or L == 0:
        raise ValueError(f"score must be [B, R] with B = {B} (x's rows) and R >= 1, and x must have L >= 1 "
                         f"positions; got score {list(score.shape)}, x {list(x.shape)}")
    like = ("x", x)
    check_arg("tau", tau, FLOATS, (B,), like)
    check_arg("active", active, (torch.bool,), (B, R), like)
    check_arg("proposal", proposal, (torch.int64,), (B, R), like)
    check_arg("positions", positions, (torch.int64,), (B, R), like)
    check_arg("state", state, (torch.uint8,), (B, L), like)
    check_arg("end_ids", end_ids, (torch.int64,), like=like)
    check_dims("end_ids", end_ids, "[E]")
    if fallback_score is not None:
        check_arg("fallback_score", fallback_score, FLOATS, (B, R), like)
    if held is not None:
        check_arg("held", held, (torch.bool,), (B, R), like)
    commit_margin_threshold(theta)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"cap must be an int >= 0 (0 = no cap), got {cap!r}")
    for name, value in (("inclusive", inclusive), ("stop_at_eot", stop_at_eot)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if isinstance(fill_id, bool) or not isinstance(fill_id, int):
        raise TypeError(f"fill_id must be an int token id, got {fill_id!r}")


def commit_step(score: torch.Tensor, tau: torch.Tensor, active: torch.Tensor, proposal: torch.Tensor,
                positions: torch.Tensor, x: torch.Tensor, state: torch.Tensor, end_ids: torch.Tensor, theta: float,
                cap: int = 0, *, fallback_score: torch.Tensor | None = None, held: torch.Tensor | None = None,
                inclusive: bool = False, fill_id: int = 0, stop_at_eot: bool = False, impl: str | None = None) -> tuple:
    """The commit rule of one step over the window's slots, in place on the canvas (spec: ``commit_step_ref``, its
    selection ``commit_select_ref``).

    Margin ``m = score - tau``, ``p = sigmoid(m)``: live slots (active, ACTIVE on the canvas, not held) with
    ``p > theta`` (``>=`` with ``inclusive``) commit, at most ``cap`` of them by descending ``p`` (ties to the lowest
    slot); when none passes, the live slot of highest ``fallback_score`` commits (the margin when None). Committed
    positions take their proposal and become EOT (an end token) or LOCKED; with ``stop_at_eot`` a row's still-active
    tail after its first EOT becomes EOT filled with ``fill_id``. No host sync on the device; outside a graph a NaN
    score, tau or fallback score at an active slot is an error (the spec's rule, that NaN never commits, is what a
    graph gets).

    Args:
        score (torch.Tensor): [B, R] controller score at the slots, fp32 (fp16/bf16 upcast).
        tau (torch.Tensor): [B] per-row threshold, fp32 (fp16/bf16 upcast).
        active (torch.Tensor): [B, R] bool slots that may commit.
        proposal (torch.Tensor): [B, R] int64 proposed tokens.
        positions (torch.Tensor): [B, R] int64 canvas positions of the slots (distinct among live slots).
        x (torch.Tensor): [B, L] int64 canvas tokens. Modified in place.
        state (torch.Tensor): [B, L] uint8 position states. Modified in place.
        end_ids (torch.Tensor): [E] int64 end tokens; E may be 0.
        theta (float): commit threshold on ``p``, in [0, 1]. The paper's default is 0.95.
        cap (int): most commits per row and step; 0 = no cap. Default: 0.
        fallback_score (torch.Tensor, optional): [B, R] what the fallback maximises, fp32 (fp16/bf16 upcast): the
            backbone's confidence or neg-entropy for the shipped rule. Default: None (the margin: the paper's rule).
        held (torch.Tensor, optional): [B, R] bool slots held this step (``hold_end``). Default: None.
        inclusive (bool): ``p >= theta``, the reference release's rule. Default: False.
        fill_id (int): the pad token of the tail fill. Default: 0.
        stop_at_eot (bool): fill a row's still-active tail after its first EOT. Default: False.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (first_active [B] int64, the first ACTIVE position per row or L; committed [B] int64, slots committed).
    """
    _check_commit_step_args(score, tau, active, proposal, positions, x, state, end_ids, theta, cap, fallback_score,
                            held, inclusive, fill_id, stop_at_eot)
    B, R = score.shape
    check_no_nan(active, score=score, tau=tau[:, None].expand(B, R), fallback_score=fallback_score)
    chosen = pick("commit_step", impl, x.device)
    return call("commit_step", impl, chosen, score, tau, active, proposal, positions, x, state, end_ids,
                float(theta), cap, fallback_score, held, inclusive, fill_id, stop_at_eot)
