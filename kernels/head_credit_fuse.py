# Copyright (c) 2025 the tracelock authors.
# CreditDecoding's step fused into the LM head: each program runs hidden @ weight.T over its split of the vocabulary
# tile by tile (head_logits_tile), decays the rows' credit tile in place (beta·C, 0 for a fresh row, whose credit is
# not read) and keeps per row the raw logits' online max, sum and argmax, the fused logits' (x + alpha·log(C + 1))
# value at that argmax, and the fused online max, sum and argmax over every other column. The merge launch finds the
# top-1 v1 and p1, adds p1 ** gamma to credit[v1] (boosted rows) and folds v1's new fused value into the rest: only
# that one column changes, so no second pass is needed, and no difference of sums is formed. The [R, V] logits never
# leave registers. IO: reads V·D weights once + R·D hidden per split + R·V·4 credit (not for fresh rows), writes
# R·V·4 credit + 36·R·S bytes of partials + 12·R bytes. Spec: head_credit_fuse_ref in kernels/ref.py; see
# kernels/README.md.

import torch

from tracelock._triton import autotune_configs, triton
from tracelock.kernels.head_logits import head_logits_tile, merge_rows, plan
from tracelock.kernels.tap_project import dot_native, with_config

tl = triton.language

# (BLOCK_V, BLOCK_D, warps, stages): the epilogue holds the logits, the credit, its pointers and the fused logits as
# [BLOCK_R, BLOCK_V] tiles beside the accumulator; these three compile for sm_90 without spills at 64 and 32 rows
# (ptxas -v: 128-202 registers), where (64, 64, 4 warps), (128, 64, 8 warps) and (64, 128, 8 warps) spilled at one
# of them (tests/test_kernels_compile.py). Not swept on a GPU.
CONFIGS = [
    triton.Config({"BLOCK_V": 64, "BLOCK_D": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_V": 64, "BLOCK_D": 32}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_V": 32, "BLOCK_D": 64}, num_warps=4, num_stages=4),
]


# the credit is updated in place: autotuning must run every trial config from the same credit
@triton.autotune(configs=autotune_configs(CONFIGS), key=["V", "D", "BLOCK_R", "DOT_NATIVE"], restore_value=["CREDIT"])
@triton.jit
def _head_credit_fuse_kernel(
    H, W, CREDIT, FRESH, PART_M1, PART_Z1, PART_I1, PART_F1, PART_M2, PART_Z2, PART_I2,
    R, V, D, S, SPLIT_V,
    stride_h,
    alpha, beta,
    DOT_NATIVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_r, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < R
    fresh = tl.load(FRESH + o_r, mask=m_r, other=1) != 0
    v_start = i_s * SPLIT_V
    v_end = tl.minimum(v_start + SPLIT_V, V)
    o = tl.arange(0, BLOCK_V)
    # raw logits: max, sum of exp(x - max), argmax, and the fused value there
    b_m1 = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_z1 = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_i1 = tl.zeros([BLOCK_R], dtype=tl.int64)
    b_f1 = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    # fused logits of every column but the raw argmax: max, sum, argmax (V: none yet)
    b_m2 = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_z2 = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_i2 = tl.full([BLOCK_R], V, dtype=tl.int64)
    for v0 in range(v_start, v_end, BLOCK_V):
        o_v = v0 + o
        m_v = o_v < v_end
        b_l = head_logits_tile(H, W, o_r, m_r, o_v, m_v, D, stride_h, DOT_NATIVE, BLOCK_R, BLOCK_V, BLOCK_D)
        m_rv = m_r[:, None] & m_v[None, :]
        p_c = CREDIT + o_r[:, None] * V + o_v[None, :]
        b_c = tl.load(p_c, mask=m_rv & ~fresh[:, None], other=0.0) * beta  # [BLOCK_R, BLOCK_V]
        # every thread has read its credit before any overwrites it: the compiler may give the store another layout
        # (the dot's, which the fused logits take) than the load's
        tl.debug_barrier()
        tl.store(p_c, b_c, mask=m_rv)
        b_f = tl.where(m_v[None, :], b_l + alpha * tl.log(b_c + 1.0), float("-inf"))
        # argmax takes the first maximum and a later tile must be strictly larger: ties keep the lowest index
        b_tmax = tl.max(b_l, 1)
        b_targ = tl.argmax(b_l, 1)
        m_top = b_tmax > b_m1
        m_at = o[None, :] == b_targ[:, None]
        # where the raw argmax moves into this tile, its column leaves the tile's fused set and the old argmax's
        # fused value joins the running one
        b_fx = tl.where(m_top[:, None] & m_at, float("-inf"), b_f)
        b_jv = tl.where(m_top, b_f1, float("-inf"))
        b_ji = b_i1
        b_f1 = tl.where(m_top, tl.sum(tl.where(m_at, b_f, 0.0), 1), b_f1)
        b_i1 = tl.where(m_top, v0 + b_targ.to(tl.int64), b_i1)
        b_mn = tl.maximum(b_m1, b_tmax)
        b_z1 = b_z1 * tl.exp(b_m1 - b_mn) + tl.sum(tl.exp(b_l - b_mn[:, None]), 1)
        b_m1 = b_mn
        # the joining column lies before this tile's: it wins a tie by index against the running argmax only
        b_i2 = tl.where((b_jv > b_m2) | ((b_jv == b_m2) & (b_ji < b_i2) & (b_jv > float("-inf"))), b_ji, b_i2)
        b_mn = tl.maximum(b_m2, b_jv)
        # a reference of 0 where both are -inf: no -inf - -inf is formed
        b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_z2 = b_z2 * tl.exp(b_m2 - b_ref) + tl.exp(b_jv - b_ref)
        b_m2 = b_mn
        b_tmax = tl.max(b_fx, 1)
        b_i2 = tl.where(b_tmax > b_m2, v0 + tl.argmax(b_fx, 1).to(tl.int64), b_i2)
        b_mn = tl.maximum(b_m2, b_tmax)
        b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_z2 = b_z2 * tl.exp(b_m2 - b_ref) + tl.sum(tl.exp(b_fx - b_ref[:, None]), 1)
        b_m2 = b_mn
    p_part = o_r * S + i_s
    tl.store(PART_M1 + p_part, b_m1, mask=m_r)
    tl.store(PART_Z1 + p_part, b_z1, mask=m_r)
    tl.store(PART_I1 + p_part, b_i1, mask=m_r)
    tl.store(PART_F1 + p_part, b_f1, mask=m_r)
    tl.store(PART_M2 + p_part, b_m2, mask=m_r)
    tl.store(PART_Z2 + p_part, b_z2, mask=m_r)
    tl.store(PART_I2 + p_part, b_i2, mask=m_r)


@triton.jit
def _head_credit_fuse_merge_kernel(
    PART_M1, PART_Z1, PART_I1, PART_F1, PART_M2, PART_Z2, PART_I2, CREDIT, BOOST, PROPOSAL, CONFIDENCE,
    R, V, S,
    alpha, gamma,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_s = tl.arange(0, BLOCK_S)
    m_r = o_r < R
    m_rs = m_r[:, None] & (o_s < S)[None, :]
    p_part = o_r[:, None] * S + o_s[None, :]
    # the raw top-1: the first split holding the max holds the lowest index among equal maxima
    b_m1 = tl.load(PART_M1 + p_part, mask=m_rs, other=float("-inf"))  # [BLOCK_R, BLOCK_S]
    b_max1 = tl.where(m_r, tl.max(b_m1, 1), 0.0)  # [BLOCK_R]
    b_top = tl.argmax(b_m1, 1).to(tl.int64)
    b_v1 = tl.load(PART_I1 + o_r * S + b_top, mask=m_r, other=0)
    b_z1 = tl.where(m_r, tl.sum(tl.load(PART_Z1 + p_part, mask=m_rs, other=0.0) * tl.exp(b_m1 - b_max1[:, None]), 1),
                    1.0)
    # each split's fused set over every column but v1: its own set, plus its raw argmax unless that is v1
    b_f1 = tl.load(PART_F1 + p_part, mask=m_rs & (o_s[None, :] != b_top[:, None]), other=float("-inf"))
    b_i1 = tl.load(PART_I1 + p_part, mask=m_rs, other=V)
    b_m2 = tl.load(PART_M2 + p_part, mask=m_rs, other=float("-inf"))
    b_z2 = tl.load(PART_Z2 + p_part, mask=m_rs, other=0.0)
    b_i2 = tl.load(PART_I2 + p_part, mask=m_rs, other=V)
    b_i2 = tl.where((b_f1 > b_m2) | ((b_f1 == b_m2) & (b_i1 < b_i2) & (b_f1 > float("-inf"))), b_i1, b_i2)
    b_mn = tl.maximum(b_m2, b_f1)
    b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    b_z2 = b_z2 * tl.exp(b_m2 - b_ref) + tl.exp(b_f1 - b_ref)
    b_max2 = tl.max(b_mn, 1)
    b_arg2 = tl.min(tl.where(b_mn == b_max2[:, None], b_i2, V), 1)
    b_ref2 = tl.where(b_max2 == float("-inf"), 0.0, b_max2)
    b_sum2 = tl.sum(b_z2 * tl.exp(b_mn - b_ref2[:, None]), 1)
    # the boost: p1 ** gamma, p1 = 1 / z1 (the top-1's max-shifted exponential is 1)
    boost = tl.load(BOOST + o_r, mask=m_r, other=0) != 0
    p_c = CREDIT + o_r * V + b_v1
    b_c = tl.load(p_c, mask=m_r, other=0.0) + tl.where(boost, tl.exp(gamma * tl.log(1.0 / b_z1)), 0.0)
    tl.store(p_c, b_c, mask=m_r & boost)
    # v1's fused value after the boost, against the best of the rest (ties to the lower index)
    b_fv = b_max1 + alpha * tl.log(b_c + 1.0)
    wins = (b_fv > b_max2) | ((b_fv == b_max2) & (b_v1 < b_arg2))
    b_mx = tl.maximum(b_max2, b_fv)
    b_z = b_sum2 * tl.exp(b_ref2 - b_mx) + tl.exp(b_fv - b_mx)
    tl.store(PROPOSAL + o_r, tl.where(wins, b_v1, b_arg2), mask=m_r)
    # softmax(fused)[proposal] = exp(0) / z
    tl.store(CONFIDENCE + o_r, 1.0 / b_z, mask=m_r)


def head_credit_fuse_triton(hidden: torch.Tensor, weight: torch.Tensor, credit: torch.Tensor, boost: torch.Tensor,
                            fresh: torch.Tensor, alpha: float, gamma: float, beta: float, split_v: int | None = None,
                            config: int | None = None) -> tuple:
    """Triton ``head_credit_fuse`` (same contract as ``head_credit_fuse_ref``: ``credit`` is updated in place); inputs
    are validated by ``tracelock.ops``. ``split_v`` overrides the columns per split (tests force several splits with
    it); ``config`` launches ``CONFIGS[config]`` instead of autotuning."""
    R, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    proposal = torch.empty(R, dtype=torch.int64, device=dev)
    confidence = torch.empty(R, dtype=torch.float32, device=dev)
    if R == 0:
        return proposal, confidence
    BLOCK_R, row_tiles, split_v, S = plan(R, V, dev, split_v)
    f32 = dict(dtype=torch.float32, device=dev)
    m1, z1, f1, m2, z2 = (torch.empty((R, S), **f32) for _ in range(5))
    i1, i2 = (torch.empty((R, S), dtype=torch.int64, device=dev) for _ in range(2))
    kernel, chosen = with_config(_head_credit_fuse_kernel, CONFIGS, config)
    kernel[(row_tiles, S)](
        hidden, weight, credit, fresh, m1, z1, i1, f1, m2, z2, i2, R, V, D, S, split_v, hidden.stride(0),
        float(alpha), float(beta), DOT_NATIVE=dot_native(hidden.dtype, weight.dtype), BLOCK_R=BLOCK_R, **chosen,
    )
    BLOCK_S = triton.next_power_of_2(S)
    rows = merge_rows(R, BLOCK_S)
    _head_credit_fuse_merge_kernel[(triton.cdiv(R, rows),)](
        m1, z1, i1, f1, m2, z2, i2, credit, boost, proposal, confidence, R, V, S, float(alpha), float(gamma),
        BLOCK_R=rows, BLOCK_S=BLOCK_S,
    )
    return proposal, confidence
