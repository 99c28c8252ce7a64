# Copyright (c) 2025 the tracelock authors.
# KLASS's step fused into the LM head, its memory the previous step's logits and their logsumexp (no distribution is
# ever written): each program runs hidden @ weight.T over its split of the vocabulary tile by tile
# (head_logits_tile), reads the previous logits of the tile and overwrites them with this step's, and keeps per row
# the online max m, argmax, z = sum exp(x - m) and a = sum exp(x - m)·(x - m - log(p_prev + eps)) (rescaled as
# window_logits_stats's entropy sum), so that kl = a / z - log z. The merge launch combines the splits and writes
# the proposal, 1 / z, the KL and this step's logsumexp m + log z into the memory. IO: reads V·D weights once + R·D
# hidden per split + R·V·4 previous logits (none for a row without a previous pass), writes R·V·4 logits + 20·R·S
# bytes of partials + 20·R bytes (outputs and lse). Spec: head_step_kl_ref in kernels/ref.py; see kernels/README.md.

import torch

from tracelock._triton import autotune_configs, triton
from tracelock.kernels.head_logits import head_logits_tile, merge_rows, plan
from tracelock.kernels.tap_project import dot_native, with_config

tl = triton.language

# (BLOCK_V, BLOCK_D, warps, stages): the epilogue holds the logits, the previous ones and their pointers as
# [BLOCK_R, BLOCK_V] tiles; these three compile for sm_90 without spills at 64 and 32 rows (ptxas -v: 127-255
# registers), where (64, 64, 4 warps) and (64, 128, 8 warps) spilled at 32 (tests/test_kernels_compile.py). Not swept
# on a GPU.
CONFIGS = [
    triton.Config({"BLOCK_V": 64, "BLOCK_D": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_V": 128, "BLOCK_D": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_V": 32, "BLOCK_D": 64}, num_warps=4, num_stages=4),
]
EPS = tl.constexpr(1e-12)


# the memory is overwritten in place: autotuning must run every trial config from the same previous logits
@triton.autotune(configs=autotune_configs(CONFIGS), key=["V", "D", "BLOCK_R", "DOT_NATIVE"],
                 restore_value=["PREV_LOGITS"])
@triton.jit
def _head_step_kl_kernel(
    H, W, PREV_LOGITS, PREV_LSE, PART_M, PART_Z, PART_A, PART_I,
    R, V, D, S, SPLIT_V,
    stride_h,
    DOT_NATIVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_r, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < R
    # +inf: no previous pass, p_prev = 0 and the previous logits are not read
    b_lse = tl.load(PREV_LSE + o_r, mask=m_r, other=float("inf"))
    has_prev = b_lse < float("inf")
    b_lse = tl.where(has_prev, b_lse, 0.0)
    v_start = i_s * SPLIT_V
    v_end = tl.minimum(v_start + SPLIT_V, V)
    o = tl.arange(0, BLOCK_V)
    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_z = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_a = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_i = tl.zeros([BLOCK_R], dtype=tl.int64)
    for v0 in range(v_start, v_end, BLOCK_V):
        o_v = v0 + o
        m_v = o_v < v_end
        b_l = head_logits_tile(H, W, o_r, m_r, o_v, m_v, D, stride_h, DOT_NATIVE, BLOCK_R, BLOCK_V, BLOCK_D)
        m_rv = m_r[:, None] & m_v[None, :]
        p_prev = PREV_LOGITS + o_r[:, None] * V + o_v[None, :]
        b_prev = tl.load(p_prev, mask=m_rv & has_prev[:, None], other=0.0)  # [BLOCK_R, BLOCK_V]
        b_lq = tl.where(has_prev[:, None], tl.log(tl.exp(b_prev - b_lse[:, None]) + EPS), tl.log(EPS))
        # every thread has read its previous logits before any overwrites them: the store's layout (the dot's) need
        # not give a thread the elements its load did
        tl.debug_barrier()
        tl.store(p_prev, b_l, mask=m_rv)
        # argmax takes the first maximum and a later tile must be strictly larger: ties keep the lowest index
        b_tmax = tl.max(b_l, 1)
        b_i = tl.where(b_tmax > b_m, v0 + tl.argmax(b_l, 1).to(tl.int64), b_i)
        # rescale the running sums to the new max; sum q·(d - lq) picks up (old max - new max)·z
        b_mn = tl.maximum(b_m, b_tmax)
        b_alpha = tl.exp(b_m - b_mn)
        b_a = b_alpha * (b_a + tl.where(b_z > 0, b_m - b_mn, 0.0) * b_z)
        b_z = b_alpha * b_z
        b_d = tl.where(m_v[None, :], b_l - b_mn[:, None], 0.0)
        b_q = tl.where(m_v[None, :], tl.exp(b_d), 0.0)
        b_z += tl.sum(b_q, 1)
        b_a += tl.sum(tl.where(b_q > 0, b_q * (b_d - b_lq), 0.0), 1)
        b_m = b_mn
    p_part = o_r * S + i_s
    tl.store(PART_M + p_part, b_m, mask=m_r)
    tl.store(PART_Z + p_part, b_z, mask=m_r)
    tl.store(PART_A + p_part, b_a, mask=m_r)
    tl.store(PART_I + p_part, b_i, mask=m_r)


@triton.jit
def _head_step_kl_merge_kernel(
    PART_M, PART_Z, PART_A, PART_I, PREV_LSE, PROPOSAL, CONFIDENCE, KL,
    R, S,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_s = tl.arange(0, BLOCK_S)
    m_r = o_r < R
    m_rs = m_r[:, None] & (o_s < S)[None, :]
    p_part = o_r[:, None] * S + o_s[None, :]
    b_m = tl.load(PART_M + p_part, mask=m_rs, other=float("-inf"))  # [BLOCK_R, BLOCK_S]
    b_z = tl.load(PART_Z + p_part, mask=m_rs, other=0.0)
    b_a = tl.load(PART_A + p_part, mask=m_rs, other=0.0)
    # padding rows get max 0 and sum 1 instead of -inf and 0, so they form no nan or division by zero
    b_max = tl.where(m_r, tl.max(b_m, 1), 0.0)  # [BLOCK_R]
    # the first split holding the max holds the lowest index among equal maxima
    b_top = tl.argmax(b_m, 1).to(tl.int64)
    b_alpha = tl.exp(b_m - b_max[:, None])
    b_zt = tl.where(m_r, tl.sum(b_alpha * b_z, 1), 1.0)
    b_at = tl.sum(b_alpha * (b_a + tl.where(b_z > 0, b_m - b_max[:, None], 0.0) * b_z), 1)
    b_logz = tl.log(b_zt)
    tl.store(PROPOSAL + o_r, tl.load(PART_I + o_r * S + b_top, mask=m_r, other=0), mask=m_r)
    tl.store(CONFIDENCE + o_r, 1.0 / b_zt, mask=m_r)
    tl.store(KL + o_r, b_at / b_zt - b_logz, mask=m_r)
    tl.store(PREV_LSE + o_r, b_max + b_logz, mask=m_r)


def head_step_kl_triton(hidden: torch.Tensor, weight: torch.Tensor, prev_logits: torch.Tensor,
                        prev_lse: torch.Tensor, split_v: int | None = None, config: int | None = None) -> tuple:
    """Triton ``head_step_kl`` (same contract as ``head_step_kl_ref``: ``prev_logits`` and ``prev_lse`` are
    overwritten in place; fp32); inputs are validated by ``tracelock.ops``. ``split_v`` overrides the columns per
    split (tests force several splits with it); ``config`` launches ``CONFIGS[config]`` instead of autotuning."""
    R, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    proposal = torch.empty(R, dtype=torch.int64, device=dev)
    confidence, kl = torch.empty(R, **f32), torch.empty(R, **f32)
    if R == 0:
        return proposal, confidence, kl
    BLOCK_R, row_tiles, split_v, S = plan(R, V, dev, split_v)
    part_m, part_z, part_a = (torch.empty((R, S), **f32) for _ in range(3))
    part_i = torch.empty((R, S), dtype=torch.int64, device=dev)
    kernel, chosen = with_config(_head_step_kl_kernel, CONFIGS, config)
    kernel[(row_tiles, S)](
        hidden, weight, prev_logits, prev_lse, part_m, part_z, part_a, part_i, R, V, D, S, split_v, hidden.stride(0),
        DOT_NATIVE=dot_native(hidden.dtype, weight.dtype), BLOCK_R=BLOCK_R, **chosen,
    )
    BLOCK_S = triton.next_power_of_2(S)
    rows = merge_rows(R, BLOCK_S)
    _head_step_kl_merge_kernel[(triton.cdiv(R, rows),)](
        part_m, part_z, part_a, part_i, prev_lse, proposal, confidence, kl, R, S, BLOCK_R=rows, BLOCK_S=BLOCK_S,
    )
    return proposal, confidence, kl
