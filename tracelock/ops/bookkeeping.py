"""The canvas bookkeeping of a step: its commits and the block schedule's advance."""

import torch

from tracelock.ops.checks import check_tensor
from tracelock.ops.chooser import call, pick


def apply_commits(x: torch.Tensor, state: torch.Tensor, proposal: torch.Tensor, commit: torch.Tensor,
                  end_ids: torch.Tensor, fill_id: int, stop_at_eot: bool, *, impl: str | None = None) -> torch.Tensor:
    """Apply one decode step's commits to the canvas, in place (spec: ``tracelock.kernels.ref.apply_commits_ref``).

    Committed ACTIVE positions take their proposal and become LOCKED, or EOT for an end token; with
    ``stop_at_eot`` the still-active tail after a row's first EOT becomes EOT filled with ``fill_id``.

    Args:
        x (torch.Tensor): [B, L] int64 canvas tokens. Modified in place.
        state (torch.Tensor): [B, L] uint8 position states (``tracelock.states``). Modified in place.
        proposal (torch.Tensor): [B, L] int64 proposed tokens.
        commit (torch.Tensor): [B, L] bool positions chosen by the policy; ignored where not ACTIVE.
        end_ids (torch.Tensor): [E] int64 end tokens (eos and end-of-turn); E may be 0.
        fill_id (int): pad token written after the first EOT under ``stop_at_eot``.
        stop_at_eot (bool): fill the still-active tail of a row once it holds an EOT.
        impl (str, optional): "torch", "cpp" or "cuda". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        first_active (torch.Tensor): [B] int64 index of the first ACTIVE position per row, or L if none.
    """
    check_tensor("x", x, torch.int64)
    if x.dim() != 2:
        raise ValueError(f"x must be [B, L], got shape {list(x.shape)}")
    shape, device = tuple(x.shape), x.device
    check_tensor("state", state, torch.uint8, shape, device)
    check_tensor("proposal", proposal, torch.int64, shape, device)
    check_tensor("commit", commit, torch.bool, shape, device)
    check_tensor("end_ids", end_ids, torch.int64, device=device)
    if end_ids.dim() != 1:
        raise ValueError(f"end_ids must be 1-D [E], got shape {list(end_ids.shape)}")
    chosen = pick("apply_commits", impl, device)
    return call("apply_commits", impl, chosen, x, state, proposal, commit, end_ids, int(fill_id), bool(stop_at_eot))


def skip_finished_blocks(state, block_idx, region_step, region_initial, steps, rows, prompt_len: int, block: int,
                         num_regions: int, steps_per_block: int, idle_steps: bool, *, impl: str | None = None) -> None:
    """Move the selected rows past their finished semi-AR blocks, in place (spec:
    ``tracelock.kernels.ref.skip_finished_blocks_ref``): the block schedule's per-step advance.

    Args:
        state (torch.Tensor): [B, L] uint8 position states.
        block_idx, region_step, region_initial (torch.Tensor): [B] int64 row counters. Modified in place.
        steps (torch.Tensor): [B] int64 forwards spent on each row.
        rows (torch.Tensor): [B] bool rows to advance.
        prompt_len, block, num_regions, steps_per_block (int), idle_steps (bool): the schedule.
        impl (str, optional): "torch" (the spec without its loop and host sync, `kernels/skip_finished_blocks.py`)
            or "cpp" (CPU). Default: ``TRACELOCK_IMPL``, else the fastest available.
    """
    check_tensor("state", state, torch.uint8)
    if state.dim() != 2:
        raise ValueError(f"state must be [B, L], got shape {list(state.shape)}")
    device, rows_shape = state.device, (state.shape[0],)
    for name, t in (("block_idx", block_idx), ("region_step", region_step), ("region_initial", region_initial),
                    ("steps", steps)):
        check_tensor(name, t, torch.int64, rows_shape, device)
    check_tensor("rows", rows, torch.bool, rows_shape, device)
    args = (state, block_idx, region_step, region_initial, steps, rows, int(prompt_len), int(block),
            int(num_regions), int(steps_per_block), bool(idle_steps))
    return call("skip_finished_blocks", impl, pick("skip_finished_blocks", impl, device), *args)
