# Copyright (c) 2025 the tracelock authors.
# The whole commit rule of one step in one launch, one program per row: margin, threshold, cap by rank, fallback
# to the best live slot, token and state writes, and the window's new left pointer, with no host sync.
# IO per row: reads R·(4 + 1 + 8 + 8 + 1) bytes of slots (score, active, proposal, position, state gather) and
# L bytes of state (first-active scan), writes at most R·9 bytes of canvas plus 9 bytes. Spec: commit_step_ref.

import torch

from tracelock._triton import triton
from tracelock.kernels.ref import commit_margin_threshold
from tracelock.states import ACTIVE, EOT, LOCKED

tl = triton.language

# canvas positions scanned per iteration of the first-active search ([BLOCK_L, BLOCK_R] membership tile)
BLOCK_L = 128


@triton.jit
def _commit_step_kernel(
    SCORE, TAU, ACTIVE_MASK, PROPOSAL, POSITIONS, X, STATE, END_IDS, FIRST_ACTIVE, DONE,
    R, L, E,
    m_threshold, cap,
    HAS_CAP: tl.constexpr, S_ACTIVE: tl.constexpr, S_LOCKED: tl.constexpr, S_EOT: tl.constexpr,
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
    # live: may commit; m == m is false only for NaN, which never commits
    b_live = m_in & (b_st == S_ACTIVE) & (b_m == b_m)
    b_pass = b_live & (b_m > m_threshold)
    if HAS_CAP:
        # rank = how many passing slots outrank this one (higher m, or equal m at a lower slot)
        b_beat = (b_m[:, None] > b_m[None, :]) | ((b_m[:, None] == b_m[None, :]) & (o_r[:, None] < o_r[None, :]))
        b_rank = tl.sum((b_beat & b_pass[:, None]).to(tl.int32), 0)  # [BLOCK_R]
        b_pass = b_pass & (b_rank < cap)
    # fallback: the lowest slot among the live slots of highest m (BLOCK_R, i.e. none, when no slot is live)
    b_best = tl.max(tl.where(b_live, b_m, float("-inf")), 0)
    b_first = tl.min(tl.where(b_live & (b_m == b_best), o_r, BLOCK_R), 0)
    n_pass = tl.sum(b_pass.to(tl.int32), 0)
    b_commit = b_pass | ((n_pass == 0) & (o_r == b_first))
    b_prop = tl.load(PROPOSAL + p_slot, mask=m_r, other=0)
    o_e = tl.arange(0, BLOCK_E)
    b_end = tl.load(END_IDS + o_e, mask=o_e < E, other=0)
    b_is_end = tl.sum(((b_prop[:, None] == b_end[None, :]) & (o_e < E)[None, :]).to(tl.int32), 1) > 0
    b_new = tl.where(b_is_end, S_EOT, S_LOCKED).to(tl.uint8)
    # the first ACTIVE position after this step, from the state before the writes minus this step's commits:
    # reading the row back after the stores would need a barrier between the threads of the program
    b_fa = tl.full([], L, dtype=tl.int64)
    for l0 in range(0, L, BLOCK_L):
        o_l = l0 + tl.arange(0, BLOCK_L)
        m_l = o_l < L
        b_row = tl.load(STATE + p_row + o_l, mask=m_l, other=0)  # [BLOCK_L]
        b_taken = tl.sum(((o_l[:, None] == b_pos[None, :]) & b_commit[None, :]).to(tl.int32), 1) > 0
        b_still = m_l & (b_row == S_ACTIVE) & ~b_taken
        b_fa = tl.minimum(b_fa, tl.min(tl.where(b_still, o_l, L), 0))
    tl.store(X + p_row + b_pos, b_prop, mask=b_commit)
    tl.store(STATE + p_row + b_pos, b_new, mask=b_commit)
    tl.store(FIRST_ACTIVE + i_b, b_fa)
    tl.store(DONE + i_b, b_fa == L)


def commit_step_triton(score: torch.Tensor, tau: torch.Tensor, active: torch.Tensor, proposal: torch.Tensor,
                       positions: torch.Tensor, x: torch.Tensor, state: torch.Tensor, end_ids: torch.Tensor,
                       theta: float, cap: int) -> tuple:
    """Triton ``commit_step`` (same contract as ``commit_step_ref``); inputs are validated by ``tracelock.ops``."""
    B, L = x.shape
    R = score.shape[1]
    E = end_ids.shape[0]
    first_active = torch.empty(B, dtype=torch.int64, device=x.device)
    done = torch.empty(B, dtype=torch.bool, device=x.device)
    if B == 0:
        return first_active, done
    _commit_step_kernel[(B,)](
        score, tau, active, proposal, positions, x, state, end_ids, first_active, done,
        R, L, E, commit_margin_threshold(theta), int(cap),
        HAS_CAP=cap > 0, S_ACTIVE=ACTIVE, S_LOCKED=LOCKED, S_EOT=EOT,
        BLOCK_R=triton.next_power_of_2(R), BLOCK_E=triton.next_power_of_2(max(E, 1)), BLOCK_L=BLOCK_L,
    )
    return first_active, done
