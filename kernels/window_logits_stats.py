# Copyright (c) 2025 the tracelock authors.
# The LM head on the window's rows fused with one online-softmax pass over the vocabulary: each program runs
# hidden @ weight.T over its split of the vocabulary tile by tile and keeps per row the running max, sum of exp,
# sum of exp·(logit - max) (the entropy), the top-2 logits with the argmax and the eos logit; a second launch
# merges the splits. The [R, V] logits never leave registers. IO: reads V·D weights once + R·D hidden per split,
# writes 5·R outputs + 5·R·S split partials. Spec: window_logits_stats_ref in kernels/ref.py; see kernels/README.md.

import torch

from tracelock._triton import autotune_configs, triton
from tracelock.kernels.tap_project import dot_native, with_config

tl = triton.language

# (BLOCK_V, BLOCK_D, warps, stages); the first is the safe default of the interpreter and TRACELOCK_SKIP_AUTOTUNE.
# BLOCK_R comes from the launcher (the window's rows, so the weights stream through once). The last two are for the
# real shapes, with 128-wide steps along D: more bytes in flight per program where the head is memory-bound (a window
# of 32 rows at B = 1), and 8 warps so that neither spills registers at BLOCK_R = 128 on sm_90, where the epilogue's
# [BLOCK_R, BLOCK_V] fp32 tiles beside the accumulator take every register (ptxas -v: 255; 256-column tiles spilled
# 2 KB). Every config fits sm_90's shared memory at BLOCK_R = 128 (tests/test_kernels_compile.py).
CONFIGS = [
    triton.Config({"BLOCK_V": 128, "BLOCK_D": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_V": 64, "BLOCK_D": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_V": 128, "BLOCK_D": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_V": 128, "BLOCK_D": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_V": 64, "BLOCK_D": 128}, num_warps=8, num_stages=3),
]
# a split covers a multiple of this many columns; bounds the split count so the merge is a single [rows, S] tile
SPLIT_ALIGN = 128
MAX_SPLITS = 512


@triton.autotune(configs=autotune_configs(CONFIGS), key=["V", "D", "BLOCK_R", "DOT_NATIVE"])
@triton.jit
def _window_logits_stats_kernel(
    H, W, PART_M, PART_Z, PART_W, PART_T2, PART_I1, EOS_LOGIT,
    R, V, D, S, SPLIT_V, eos_id,
    stride_h,
    HAS_EOS: tl.constexpr, DOT_NATIVE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_r, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < R
    v_start = i_s * SPLIT_V
    v_end = tl.minimum(v_start + SPLIT_V, V)
    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_z = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_w = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_t2 = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_i1 = tl.zeros([BLOCK_R], dtype=tl.int64)
    b_eos = tl.zeros([BLOCK_R], dtype=tl.float32)
    for v0 in range(v_start, v_end, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < v_end
        b_l = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_d = o_d < D
            b_h = tl.load(H + o_r[:, None] * stride_h + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0)
            b_wt = tl.load(W + o_v[:, None] * D + o_d[None, :], mask=m_v[:, None] & m_d[None, :], other=0.0)
            if DOT_NATIVE:
                b_l = tl.dot(b_h, tl.trans(b_wt), b_l)  # [BLOCK_R, BLOCK_V]
            else:
                b_l = tl.dot(b_h.to(tl.float32), tl.trans(b_wt.to(tl.float32)), b_l, input_precision="ieee")
        b_l = tl.where(m_v[None, :], b_l, float("-inf"))
        if HAS_EOS:
            # first, so the raw logits are dead once the shifted ones below exist (fewer live tiles, fewer registers)
            b_eos += tl.sum(tl.where(o_v[None, :] == eos_id, b_l, 0.0), 1)
        # top-2 of the tile; argmax takes the first maximum, and a later tile must be strictly larger to win,
        # so ties go to the lowest index as in torch.argmax
        b_tmax = tl.max(b_l, 1)  # [BLOCK_R]
        b_targ = tl.argmax(b_l, 1)
        b_tsec = tl.max(tl.where(tl.arange(0, BLOCK_V)[None, :] == b_targ[:, None], float("-inf"), b_l), 1)
        m_new_top = b_tmax > b_m
        b_t2 = tl.where(m_new_top, tl.maximum(b_m, b_tsec), tl.maximum(b_t2, b_tmax))
        b_i1 = tl.where(m_new_top, v0 + b_targ.to(tl.int64), b_i1)
        # rescale the running sums to the new max; sum q·d picks up (old max - new max)·z
        b_mn = tl.maximum(b_m, b_tmax)
        b_alpha = tl.exp(b_m - b_mn)
        b_w = b_alpha * (b_w + tl.where(b_z > 0, b_m - b_mn, 0.0) * b_z)
        b_z = b_alpha * b_z
        # padding columns get d = 0, q = 0 rather than -inf, 0 (no 0·(-inf) is formed); a -inf logit still has
        # q = 0, and the where keeps its 0·(-inf) at the limit, 0
        b_d = tl.where(m_v[None, :], b_l - b_mn[:, None], 0.0)
        b_q = tl.where(m_v[None, :], tl.exp(b_d), 0.0)
        b_z += tl.sum(b_q, 1)
        b_w += tl.sum(tl.where(b_q > 0, b_q * b_d, 0.0), 1)
        b_m = b_mn
    p_part = o_r * S + i_s
    tl.store(PART_M + p_part, b_m, mask=m_r)
    tl.store(PART_Z + p_part, b_z, mask=m_r)
    tl.store(PART_W + p_part, b_w, mask=m_r)
    tl.store(PART_T2 + p_part, b_t2, mask=m_r)
    tl.store(PART_I1 + p_part, b_i1, mask=m_r)
    if HAS_EOS:
        # exactly one split holds the eos column
        tl.store(EOS_LOGIT + o_r, b_eos, mask=m_r & (eos_id >= v_start) & (eos_id < v_end))


@triton.jit
def _window_logits_stats_merge_kernel(
    PART_M, PART_Z, PART_W, PART_T2, PART_I1, EOS_LOGIT,
    PROPOSAL, MAX_PROB, SECOND_PROB, NEG_ENTROPY, EOS_PROB,
    R, S,
    HAS_EOS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_s = tl.arange(0, BLOCK_S)
    m_r = o_r < R
    m_rs = m_r[:, None] & (o_s < S)[None, :]
    p_part = o_r[:, None] * S + o_s[None, :]
    b_m = tl.load(PART_M + p_part, mask=m_rs, other=float("-inf"))  # [BLOCK_R, BLOCK_S]
    b_z = tl.load(PART_Z + p_part, mask=m_rs, other=0.0)
    b_w = tl.load(PART_W + p_part, mask=m_rs, other=0.0)
    # padding rows get max 0 and sum 1 instead of -inf and 0, so they form no nan or division by zero
    b_max = tl.where(m_r, tl.max(b_m, 1), 0.0)  # [BLOCK_R]
    # the first split holding the max holds the lowest index among equal maxima
    b_top = tl.argmax(b_m, 1).to(tl.int64)
    b_i1 = tl.load(PART_I1 + o_r * S + b_top, mask=m_r, other=0)
    b_t2 = tl.load(PART_T2 + o_r * S + b_top, mask=m_r, other=float("-inf"))
    b_t2 = tl.maximum(b_t2, tl.max(tl.where(o_s[None, :] == b_top[:, None], float("-inf"), b_m), 1))
    b_alpha = tl.exp(b_m - b_max[:, None])
    b_zt = tl.where(m_r, tl.sum(b_alpha * b_z, 1), 1.0)
    b_wt = tl.sum(b_alpha * (b_w + tl.where(b_z > 0, b_m - b_max[:, None], 0.0) * b_z), 1)
    tl.store(PROPOSAL + o_r, b_i1, mask=m_r)
    tl.store(MAX_PROB + o_r, 1.0 / b_zt, mask=m_r)
    tl.store(SECOND_PROB + o_r, tl.exp(b_t2 - b_max) / b_zt, mask=m_r)
    tl.store(NEG_ENTROPY + o_r, b_wt / b_zt - tl.log(b_zt), mask=m_r)
    if HAS_EOS:
        b_eos = tl.load(EOS_LOGIT + o_r, mask=m_r, other=0.0)
        tl.store(EOS_PROB + o_r, tl.exp(b_eos - b_max) / b_zt, mask=m_r)
    else:
        tl.store(EOS_PROB + o_r, tl.zeros([BLOCK_R], dtype=tl.float32), mask=m_r)


def block_rows(R: int) -> int:
    """All the window's rows in one tile (16..128), so each program streams its weight split once."""
    return min(128, max(16, triton.next_power_of_2(R)))


def split_columns(V: int, row_tiles: int, device: torch.device) -> int:
    """Columns per split: enough splits for two programs per SM on a GPU; two under the interpreter, which
    pays per program instance rather than per tile."""
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    splits = max(1, programs // row_tiles)
    split_v = triton.cdiv(triton.cdiv(V, splits), SPLIT_ALIGN) * SPLIT_ALIGN
    return max(split_v, triton.cdiv(triton.cdiv(V, MAX_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN)


def window_logits_stats_triton(hidden: torch.Tensor, weight: torch.Tensor, eos_id: int | None,
                               split_v: int | None = None, config: int | None = None) -> tuple:
    """Triton ``window_logits_stats`` (same contract as ``window_logits_stats_ref``); inputs are validated by
    ``tracelock.ops``. ``split_v`` overrides the columns per split (tests use it to force several splits);
    ``config`` launches ``CONFIGS[config]`` instead of autotuning (tests check each; benchmarks time each)."""
    R, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    proposal = torch.empty(R, dtype=torch.int64, device=dev)
    max_prob, second_prob, neg_entropy, eos_prob = (torch.empty(R, **f32) for _ in range(4))
    outs = (proposal, max_prob, second_prob, neg_entropy, eos_prob)
    if R == 0:
        return outs
    BLOCK_R = block_rows(R)
    row_tiles = triton.cdiv(R, BLOCK_R)
    split_v = split_v or split_columns(V, row_tiles, dev)
    S = triton.cdiv(V, split_v)
    if S > MAX_SPLITS:
        raise ValueError(f"split_v={split_v} gives {S} splits of V={V}, more than {MAX_SPLITS}; raise split_v")
    parts = [torch.empty((R, S), **f32) for _ in range(4)] + [torch.empty((R, S), dtype=torch.int64, device=dev)]
    eos_logit = torch.empty(R, **f32)
    has_eos = eos_id is not None
    kernel, chosen = with_config(_window_logits_stats_kernel, CONFIGS, config)
    kernel[(row_tiles, S)](
        hidden, weight, *parts, eos_logit, R, V, D, S, split_v, eos_id if has_eos else 0, hidden.stride(0),
        HAS_EOS=has_eos, DOT_NATIVE=dot_native(hidden.dtype, weight.dtype), BLOCK_R=BLOCK_R, **chosen,
    )
    BLOCK_S = triton.next_power_of_2(S)
    # rows per merge program: a [rows, BLOCK_S] tile of about 4096 elements
    merge_rows = max(1, min(triton.next_power_of_2(R), 4096 // BLOCK_S))
    _window_logits_stats_merge_kernel[(triton.cdiv(R, merge_rows),)](
        *parts, eos_logit, *outs, R, S, HAS_EOS=has_eos, BLOCK_R=merge_rows, BLOCK_S=BLOCK_S,
    )
    return outs
