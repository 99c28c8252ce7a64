"""Pure-torch references (``*_ref``) for every tracelock op: the executable spec, no triton."""

import torch

from tracelock.states import ACTIVE, EOT, LOCKED


def apply_commits_ref(
    x: torch.Tensor,
    state: torch.Tensor,
    proposal: torch.Tensor,
    commit: torch.Tensor,
    end_ids: torch.Tensor,
    fill_id: int,
    stop_at_eot: bool,
) -> torch.Tensor:
    """Apply one decode step's commits to the canvas, in place; the per-step bookkeeping of the loop.

    Only ACTIVE positions move: ``commit`` at a PROMPT, LOCKED or EOT position is ignored. A committed
    position gets ``x = proposal`` and ``state = EOT`` if the proposal is one of ``end_ids``, else
    ``state = LOCKED``. With ``stop_at_eot``, let ``j`` be the first EOT position of a row after this
    step's commits (EOT states from earlier steps count too); every still-ACTIVE position after ``j``
    becomes EOT with ``x = fill_id``. Without ``stop_at_eot`` nothing else changes.

    Args:
        x (torch.Tensor): [B, L] int64 canvas tokens. Modified in place.
        state (torch.Tensor): [B, L] uint8 position states (``tracelock.states``). Modified in place.
        proposal (torch.Tensor): [B, L] int64 proposed tokens.
        commit (torch.Tensor): [B, L] bool positions chosen by the policy.
        end_ids (torch.Tensor): [E] int64 end tokens (eos and end-of-turn); E may be 0.
        fill_id (int): the pad token written after the first EOT under ``stop_at_eot``.
        stop_at_eot (bool): fill the still-active tail of a row once it holds an EOT.

    Returns:
        first_active (torch.Tensor): [B] int64 index of the first ACTIVE position per row, or L if the
            row has none (the sliding window's left pointer; a row is done when ``first_active == L``).
    """
    B, L = x.shape
    take = commit & (state == ACTIVE)
    is_end = torch.isin(proposal, end_ids)
    new_state = torch.where(take, torch.where(is_end, EOT, LOCKED).to(state.dtype), state)
    # torch.where instead of boolean indexing: no host sync, so the loop stays asynchronous on GPU
    x.copy_(torch.where(take, proposal, x))
    if stop_at_eot:
        # a running count of EOTs marks every position at or after the row's first EOT
        after_eot = (new_state == EOT).cumsum(1) > 0
        fill = after_eot & (new_state == ACTIVE)
        x.masked_fill_(fill, fill_id)
        new_state.masked_fill_(fill, EOT)
    state.copy_(new_state)
    # a sentinel column L keeps the reduction defined for L == 0 and for rows with no active position
    pos = torch.arange(L + 1, device=x.device)
    active = torch.cat([new_state == ACTIVE, torch.ones((B, 1), dtype=torch.bool, device=x.device)], dim=1)
    return torch.where(active, pos, L).amin(1)
