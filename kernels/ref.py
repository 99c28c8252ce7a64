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


def tap_project_ref(h1: torch.Tensor, h2: torch.Tensor, h3: torch.Tensor, A: torch.Tensor,
                    c: torch.Tensor) -> torch.Tensor:
    """Project the three hidden-state taps straight to controller inputs: ``h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c``.

    Linear encoders fold into ``A``: with code matrices ``E_h`` and ``E_d``, the codes
    ``[h1 E_h, h2 E_h, h3 E_h, (h2 - h1) E_d, (h3 - h2) E_d]`` are this projection with ``A[0] = [E_h, 0, 0, -E_d, 0]``,
    ``A[1] = [0, E_h, 0, E_d, -E_d]``, ``A[2] = [0, 0, E_h, 0, E_d]`` (N = 832 at the reference widths), and any
    further linear layer (the controller's input projection) multiplies into ``A`` and ``c`` as well.
    Everything is computed in fp32 from upcast inputs.

    Args:
        h1, h2, h3 (torch.Tensor): [T, D] taps (h_{n-2}, h_{n-1}, norm_f(h_n)), fp32, fp16 or bf16.
        A (torch.Tensor): [3, D, N] folded weights, fp32 (fp16/bf16 accepted).
        c (torch.Tensor): [N] bias.

    Returns:
        out (torch.Tensor): [T, N] fp32.
    """
    out = c.float().expand(h1.shape[0], -1).clone()
    for h, a in zip((h1, h2, h3), A):
        out += h.float() @ a.float()
    return out


def window_logits_stats_ref(hidden: torch.Tensor, weight: torch.Tensor, eos_id: int | None) -> tuple:
    """The LM head on the given rows and the greedy signals of ``tracelock.signals.compute_signals``
    (temperature 0) on ``logits = hidden @ weight.T``, in fp32 from upcast inputs.

    The proposal is the argmax (ties to the lowest index); ``max_prob`` and ``second_prob`` are the two largest
    probabilities (equal when the top logits tie), so ``margin = max_prob - second_prob``; ``neg_entropy`` is
    ``sum p log p``. Probabilities come from max-shifted exponentials. This spec materialises the [R, V] logits;
    the Triton kernel computes the same in one online pass over the vocabulary.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the rows to score, fp32, fp16 or bf16.
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16.
        eos_id (int, optional): token whose probability goes into ``eos_prob`` (zeros when None).

    Returns:
        (proposal [R] int64, max_prob [R], second_prob [R], neg_entropy [R], eos_prob [R]), the last four fp32.
    """
    logits = hidden.float() @ weight.float().T
    proposal = logits.argmax(dim=-1)
    top = logits.topk(min(2, logits.shape[-1]), dim=-1).values
    d = logits - top[:, :1]
    q = d.exp()
    z = q.sum(dim=-1)
    neg_entropy = torch.where(q > 0, q * d, 0.0).sum(dim=-1) / z - z.log()
    max_prob = 1 / z
    second_prob = (top[:, 1] - top[:, 0]).exp() / z if top.shape[-1] > 1 else torch.zeros_like(z)
    eos_prob = torch.zeros_like(z) if eos_id is None else d[:, eos_id].exp() / z
    return proposal, max_prob, second_prob, neg_entropy, eos_prob
