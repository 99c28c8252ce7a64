# Copyright (c) 2025 the tracelock authors.
# The whole commit rule of one step in one launch, one program per row: margin, threshold, cap by rank, held slots,
# fallback to the best eligible slot by its own score, token and state writes, the end-of-text tail fill, and the
# window's new left pointer, with no host sync.
# IO per row: reads R·(4 + 4 + 1 + 1 + 8 + 8 + 1) bytes of slots (score, fallback score, held, active, proposal,
# position, state gather) and L bytes of state (twice with stop_at_eot), writes at most R·9 bytes of canvas (plus the
# filled tail) and 16 bytes. Spec: commit_step_ref (kernels/ref.py).

import torch

from tracelock._triton import triton
from tracelock.kernels.ref import commit_margin_threshold
from tracelock.states import ACTIVE, EOT, LOCKED

tl = triton.language

# canvas positions scanned per iteration of the row scans ([BLOCK_L, BLOCK_R] membership tile)
BLOCK_L = 128


@triton.jit
def _commit_step_kernel(
    SCORE, TAU, FALLBACK, HELD, ACTIVE_MASK, PROPOSAL, POSITIONS, X, STATE, END_IDS, FIRST_ACTIVE, COMMITTED,
    R, L, E,
    m_threshold, cap, fill_id,
    HAS_CAP: tl.constexpr, HAS_FALLBACK: tl.constexpr, HAS_HELD: tl.constexpr, STOP_AT_EOT: tl.constexpr,
    S_ACTIVE: tl.constexpr, S_LOCKED: tl.constexpr, S_EOT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_L: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < R
    p_slot = i_b * R + o_r
    p_row = i_b * L
    b_m = tl.load(SCORE + p_slot, mask=m_r, other=0.0).to(tl.float32) - tl.load(TAU + i_b).to(tl.float32)
    b_act = tl.load(ACTIVE_MASK + p_slot, mask=m_r, other=0) != 0
    b_pos = tl.load(POSITIONS + p_slot, mask=m_r, other=-1)  # [BLOCK_R]
    m_in = m_r & b_act & (b_pos >= 0) & (b_pos < L)
    b_st = tl.load(STATE + p_row + b_pos, mask=m_in, other=0)
    # eligible: may commit; m == m is false only for NaN, which never commits
    b_ok = m_in & (b_st == S_ACTIVE) & (b_m == b_m)
    if HAS_HELD:
        b_ok = b_ok & (tl.load(HELD + p_slot, mask=m_r, other=0) == 0)
    b_pass = b_ok & (b_m > m_threshold)
    if HAS_CAP:
        # rank = how many passing slots outrank this one (higher m, or equal m at a lower slot)
        b_beat = (b_m[:, None] > b_m[None, :]) | ((b_m[:, None] == b_m[None, :]) & (o_r[:, None] < o_r[None, :]))
        b_rank = tl.sum((b_beat & b_pass[:, None]).to(tl.int32), 0)  # [BLOCK_R]
        b_pass = b_pass & (b_rank < cap)
    if HAS_FALLBACK:
        b_f = tl.load(FALLBACK + p_slot, mask=m_r, other=0.0).to(tl.float32)
    else:
        b_f = b_m
    # fallback: the lowest slot among the candidates of highest f (BLOCK_R, i.e. none, when there is none)
    b_cand = b_ok & (b_f == b_f)
    b_best = tl.max(tl.where(b_cand, b_f, float("-inf")), 0)
    b_first = tl.min(tl.where(b_cand & (b_f == b_best), o_r, BLOCK_R), 0)
    n_pass = tl.sum(b_pass.to(tl.int32), 0)
    b_commit = b_pass | ((n_pass == 0) & (o_r == b_first))
    b_prop = tl.load(PROPOSAL + p_slot, mask=m_r, other=0)
    o_e = tl.arange(0, BLOCK_E)
    b_end = tl.load(END_IDS + o_e, mask=o_e < E, other=0)
    b_is_end = tl.sum(((b_prop[:, None] == b_end[None, :]) & (o_e < E)[None, :]).to(tl.int32), 1) > 0
    b_new = tl.where(b_is_end, S_EOT, S_LOCKED).to(tl.uint8)
    # the row's first EOT after this step's commits: earlier EOTs, or a committed end token
    b_eot = tl.full([], L, dtype=tl.int64)
    if STOP_AT_EOT:
        b_eot = tl.min(tl.where(b_commit & b_is_end, b_pos, L), 0)
        for l0 in range(0, L, BLOCK_L):
            o_l = l0 + tl.arange(0, BLOCK_L)
            b_row = tl.load(STATE + p_row + o_l, mask=o_l < L, other=0)
            b_eot = tl.minimum(b_eot, tl.min(tl.where((o_l < L) & (b_row == S_EOT), o_l, L), 0))
    # the first ACTIVE position after this step, from the state before the writes minus this step's commits and
    # fill: reading the row back after the stores would need a barrier between the threads of the program
    b_fa = tl.full([], L, dtype=tl.int64)
    for l0 in range(0, L, BLOCK_L):
        o_l = l0 + tl.arange(0, BLOCK_L)
        m_l = o_l < L
        b_row = tl.load(STATE + p_row + o_l, mask=m_l, other=0)  # [BLOCK_L]
        b_taken = tl.sum(((o_l[:, None] == b_pos[None, :]) & b_commit[None, :]).to(tl.int32), 1) > 0
        b_still = m_l & (b_row == S_ACTIVE) & ~b_taken
        if STOP_AT_EOT:
            # positions after the first EOT that no commit took: the fill (disjoint from the slots' writes)
            b_fill = b_still & (o_l > b_eot)
            tl.store(X + p_row + o_l, tl.full([BLOCK_L], 0, tl.int64) + fill_id, mask=b_fill)
            tl.store(STATE + p_row + o_l, tl.full([BLOCK_L], S_EOT, tl.uint8), mask=b_fill)
            b_still = b_still & ~b_fill
        b_fa = tl.minimum(b_fa, tl.min(tl.where(b_still, o_l, L), 0))
    tl.store(X + p_row + b_pos, b_prop, mask=b_commit)
    tl.store(STATE + p_row + b_pos, b_new, mask=b_commit)
    tl.store(FIRST_ACTIVE + i_b, b_fa)
    tl.store(COMMITTED + i_b, tl.sum(b_commit.to(tl.int64), 0))


def commit_step_triton(score: torch.Tensor, tau: torch.Tensor, active: torch.Tensor, proposal: torch.Tensor,
                       positions: torch.Tensor, x: torch.Tensor, state: torch.Tensor, end_ids: torch.Tensor,
                       theta: float, cap: int, fallback_score: torch.Tensor | None = None,
                       held: torch.Tensor | None = None, inclusive: bool = False, fill_id: int = 0,
                       stop_at_eot: bool = False) -> tuple:
    """Triton ``commit_step`` (same contract as ``commit_step_ref``); inputs are validated by ``tracelock.ops``."""
    B, L = x.shape
    R = score.shape[1]
    E = end_ids.shape[0]
    first_active = torch.empty(B, dtype=torch.int64, device=x.device)
    committed = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return first_active, committed
    _commit_step_kernel[(B,)](
        score, tau, score if fallback_score is None else fallback_score, active if held is None else held, active,
        proposal, positions, x, state, end_ids, first_active, committed,
        R, L, E, commit_margin_threshold(theta, inclusive), int(cap), int(fill_id),
        HAS_CAP=cap > 0, HAS_FALLBACK=fallback_score is not None, HAS_HELD=held is not None,
        STOP_AT_EOT=bool(stop_at_eot), S_ACTIVE=ACTIVE, S_LOCKED=LOCKED, S_EOT=EOT,
        BLOCK_R=triton.next_power_of_2(R), BLOCK_E=triton.next_power_of_2(max(E, 1)), BLOCK_L=BLOCK_L,
    )
    return first_active, committed
