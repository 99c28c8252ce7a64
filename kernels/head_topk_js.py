# Copyright (c) 2025 the tracelock authors.
# LESS's drift fused into the LM head: each program runs hidden @ weight.T over its split of the vocabulary tile by
# tile (head_logits_tile) and keeps per row the online max and sum beside a running top-K of the logits with their
# ids (as topk_js: a tile's best live element replaces the set's worst while it beats it, ties to the lowest index;
# here for all the tile's rows at once, as long as any row's does). The merge launch, one program per row, takes the
# top-K of the S·K candidates (ties to the lowest index), their probabilities from the merged log-normalizer, and the
# order and the JS of topk_js's epilogue (store_topk_js). The [R, V] logits never leave registers. IO: reads V·D
# weights once + R·D hidden per split + R·K·12 bytes of the previous top-K, writes R·S·(8 + 12·K) bytes of partials +
# R·(12·K + 4) bytes. Spec: head_topk_js_ref in kernels/ref.py; see kernels/README.md.

import torch

from tracelock._triton import autotune_configs, triton
from tracelock.kernels.head_logits import head_logits_tile, plan
from tracelock.kernels.tap_project import dot_native, with_config
from tracelock.kernels.topk_js import store_topk_js

tl = triton.language

# (BLOCK_V, BLOCK_D, warps, stages): the top-K's while loop keeps a live mask of the tile beside the logits; these
# three compile for sm_90 without spills at 64 and 32 rows (ptxas -v: 128-218 registers), where 4-warp configs
# spilled at one of them (tests/test_kernels_compile.py). Not swept on a GPU.
CONFIGS = [
    triton.Config({"BLOCK_V": 128, "BLOCK_D": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_V": 128, "BLOCK_D": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_V": 64, "BLOCK_D": 32}, num_warps=8, num_stages=4),
]
# a row's S·BLOCK_K candidates are one tile of the merge program
MAX_CANDIDATES = 4096


@triton.jit
def _worst_rows(s_v, s_i, m_k, o_k, BLOCK_K: tl.constexpr):
    """Each row's lowest-ranked slot of the set: the lowest logit, among equal ones the highest index."""
    w_v = tl.min(tl.where(m_k[None, :], s_v, float("inf")), 1)
    w_i = tl.max(tl.where(m_k[None, :] & (s_v == w_v[:, None]), s_i, -1), 1)
    w_k = tl.min(tl.where(m_k[None, :] & (s_i == w_i[:, None]), o_k[None, :], BLOCK_K), 1)
    return w_v, w_i, w_k


@triton.jit
def _best_rows(b_l, b_live, o_v, none):
    """Each row's best live element of the tile: the highest logit, the lowest index among equal ones."""
    c_v = tl.max(tl.where(b_live, b_l, float("-inf")), 1)
    c_i = tl.min(tl.where(b_live & (b_l == c_v[:, None]), o_v[None, :], none), 1)
    return c_v, c_i


@triton.autotune(configs=autotune_configs(CONFIGS), key=["V", "D", "BLOCK_R", "BLOCK_K", "DOT_NATIVE"])
@triton.jit
def _head_topk_js_kernel(
    H, W, PART_M, PART_Z, PART_V, PART_I,
    R, V, D, S, SPLIT_V, K,
    stride_h,
    DOT_NATIVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_r, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < R
    v_start = i_s * SPLIT_V
    v_end = tl.minimum(v_start + SPLIT_V, V)
    o = tl.arange(0, BLOCK_V)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    # the running top-K, unsorted: empty slots hold -inf at an index past the vocabulary (the merge never picks them);
    # `none` (past every such index) marks a row of the tile with no live element left
    s_v = tl.full([BLOCK_R, BLOCK_K], float("-inf"), dtype=tl.float32)
    s_i = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.int64) + (V + o_k.to(tl.int64))[None, :]
    none = V + BLOCK_K
    w_v, w_i, w_k = _worst_rows(s_v, s_i, m_k, o_k, BLOCK_K)
    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_z = tl.zeros([BLOCK_R], dtype=tl.float32)
    for v0 in range(v_start, v_end, BLOCK_V):
        o_v = (v0 + o).to(tl.int64)
        m_v = o_v < v_end
        b_l = head_logits_tile(H, W, o_r, m_r, o_v, m_v, D, stride_h, DOT_NATIVE, BLOCK_R, BLOCK_V, BLOCK_D)
        b_mn = tl.maximum(b_m, tl.max(b_l, 1))
        b_z = b_z * tl.exp(b_m - b_mn) + tl.sum(tl.exp(b_l - b_mn[:, None]), 1)
        b_m = b_mn
        # top-K merge; padding rows and columns are never live
        b_live = m_r[:, None] & m_v[None, :]
        c_v, c_i = _best_rows(b_l, b_live, o_v, none)
        beats = (c_v > w_v) | ((c_v == w_v) & (c_i < w_i))
        while tl.max(beats.to(tl.int32), 0) > 0:
            take = beats[:, None] & (o_k[None, :] == w_k[:, None])
            s_v = tl.where(take, c_v[:, None], s_v)
            s_i = tl.where(take, c_i[:, None], s_i)
            b_live = b_live & ~(beats[:, None] & (o_v[None, :] == c_i[:, None]))
            w_v, w_i, w_k = _worst_rows(s_v, s_i, m_k, o_k, BLOCK_K)
            c_v, c_i = _best_rows(b_l, b_live, o_v, none)
            beats = (c_v > w_v) | ((c_v == w_v) & (c_i < w_i))
    p_part = o_r * S + i_s
    tl.store(PART_M + p_part, b_m, mask=m_r)
    tl.store(PART_Z + p_part, b_z, mask=m_r)
    p_set = p_part[:, None] * BLOCK_K + o_k[None, :]
    tl.store(PART_V + p_set, s_v, mask=m_r[:, None])
    tl.store(PART_I + p_set, s_i, mask=m_r[:, None])


@triton.jit
def _head_topk_js_merge_kernel(
    PART_M, PART_Z, PART_V, PART_I, PREV_IDS, PREV_PROBS, HAS_PREV, IDS, PROBS, JS,
    V, K, S,
    BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < S
    b_m = tl.load(PART_M + i_n * S + o_s, mask=m_s, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(b_m, 0)
    z = tl.sum(tl.load(PART_Z + i_n * S + o_s, mask=m_s, other=0.0) * tl.exp(b_m - m), 0)
    # the splits' sets as one row of S·BLOCK_K candidates; picked best first, each by its position (an empty slot's
    # index repeats across splits), so the K picks are the K largest logits, ties to the lowest index
    o_c = tl.arange(0, BLOCK_C)
    c_live = o_c < S * BLOCK_K
    c_v = tl.load(PART_V + i_n * S * BLOCK_K + o_c, mask=c_live, other=float("-inf"))  # [BLOCK_C]
    c_i = tl.load(PART_I + i_n * S * BLOCK_K + o_c, mask=c_live, other=V + BLOCK_K)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    s_v = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)
    s_i = V + o_k.to(tl.int64)
    for k in range(0, K):
        b_v = tl.max(tl.where(c_live, c_v, float("-inf")), 0)
        b_i = tl.min(tl.where(c_live & (c_v == b_v), c_i, V + BLOCK_K), 0)
        b_at = tl.min(tl.where(c_live & (c_v == b_v) & (c_i == b_i), o_c, BLOCK_C), 0)
        c_live = c_live & (o_c != b_at)
        s_v = tl.where(o_k == k, b_v, s_v)
        s_i = tl.where(o_k == k, b_i, s_i)
    s_p = tl.where(m_k, tl.exp(s_v - m) / z, 0.0)  # [BLOCK_K]
    store_topk_js(s_p, s_i, m_k, o_k, i_n, K, PREV_IDS, PREV_PROBS, HAS_PREV, IDS, PROBS, JS)


def head_topk_js_triton(hidden: torch.Tensor, weight: torch.Tensor, prev_ids: torch.Tensor, prev_probs: torch.Tensor,
                        has_prev: torch.Tensor, split_v: int | None = None, config: int | None = None) -> tuple:
    """Triton ``head_topk_js`` (same contract as ``head_topk_js_ref``); inputs are validated by ``tracelock.ops``
    (1 <= K <= V). ``split_v`` overrides the columns per split (tests force several splits with it); ``config``
    launches ``CONFIGS[config]`` instead of autotuning."""
    R, D = hidden.shape
    V, K = weight.shape[0], prev_ids.shape[1]
    dev = hidden.device
    ids = torch.empty((R, K), dtype=torch.int64, device=dev)
    probs = torch.empty((R, K), dtype=torch.float32, device=dev)
    js = torch.empty(R, dtype=torch.float32, device=dev)
    if R == 0:
        return ids, probs, js
    BLOCK_K = triton.next_power_of_2(K)
    BLOCK_R, row_tiles, split_v, S = plan(R, V, dev, split_v, max_splits=MAX_CANDIDATES // BLOCK_K)
    part_m, part_z = (torch.empty((R, S), dtype=torch.float32, device=dev) for _ in range(2))
    part_v = torch.empty((R, S, BLOCK_K), dtype=torch.float32, device=dev)
    part_i = torch.empty((R, S, BLOCK_K), dtype=torch.int64, device=dev)
    kernel, chosen = with_config(_head_topk_js_kernel, CONFIGS, config)
    kernel[(row_tiles, S)](
        hidden, weight, part_m, part_z, part_v, part_i, R, V, D, S, split_v, K, hidden.stride(0),
        DOT_NATIVE=dot_native(hidden.dtype, weight.dtype), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, **chosen,
    )
    BLOCK_S = triton.next_power_of_2(S)
    _head_topk_js_merge_kernel[(R,)](
        part_m, part_z, part_v, part_i, prev_ids, prev_probs, has_prev, ids, probs, js, V, K, S,
        BLOCK_K=BLOCK_K, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_S * BLOCK_K,
    )
    return ids, probs, js
