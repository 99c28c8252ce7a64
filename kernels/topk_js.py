# Copyright (c) 2025 the tracelock authors.
# LESS's drift in one launch and one pass over the logits, one program per slot (row): an online softmax (per-lane
# running max and sum) beside a running top-K of the logits, merged tile by tile (a tile's best live element replaces
# the set's worst while it beats it: a higher logit, or an equal one at a lower index, so ties go to the lowest
# index; after the first tiles almost no element beats the set, and a tile costs two reductions). The epilogue turns
# the K logits into probabilities, stores them sorted (descending, ties to the lowest index) and computes the
# Jensen-Shannon divergence against the previous top-K over at most 2K + 1 buckets (the union of the two id sets and
# one rest bucket each). IO per row: reads V logits once + K·12 bytes of the previous top-K + 1, writes K·12 + 4
# bytes. Spec: topk_js_ref in kernels/ref.py.

import torch

from tracelock._triton import triton
from tracelock.kernels.credit_fuse import block_columns, num_warps_for

tl = triton.language


@triton.jit
def _worst(s_v, s_i, m_k, o_k, BLOCK_K: tl.constexpr):
    """The set's lowest-ranked slot: the lowest logit, among equal ones the highest index; its (logit, index, slot)."""
    w_v = tl.min(tl.where(m_k, s_v, float("inf")), 0)
    w_i = tl.max(tl.where(m_k & (s_v == w_v), s_i, -1), 0)
    w_k = tl.min(tl.where(m_k & (s_i == w_i), o_k, BLOCK_K), 0)
    return w_v, w_i, w_k


@triton.jit
def _best(b_x, b_live, o_v, none):
    """The tile's best live element: the highest logit, the lowest index among equal ones (``none``: no live one)."""
    c_v = tl.max(tl.where(b_live, b_x, float("-inf")), 0)
    c_i = tl.min(tl.where(b_live & (b_x == c_v), o_v, none), 0)
    return c_v, c_i


@triton.jit
def _kl_terms(a, m):
    # a (log a - log m) where a > 0, else 0 (0 log 0 = 0); m clamped as the spec does
    return tl.where(a > 0, a * (tl.log(tl.where(a > 0, a, 1.0)) - tl.log(tl.maximum(m, 1e-30))), 0.0)


@triton.jit
def store_topk_js(s_p, s_i, m_k, o_k, i_n, K, PREV_IDS, PREV_PROBS, HAS_PREV, IDS, PROBS, JS):
    """Row ``i_n``'s epilogue: its top-K (the unsorted set ``s_i`` with probabilities ``s_p``, slots past ``m_k``
    empty) stored sorted, and its JS drift from the previous top-K (1 without a previous pass). Shared with
    head_topk_js's merge."""
    # sorted as the spec sorts the probabilities: descending, ties to the lowest index
    r_beat = (s_p[:, None] > s_p[None, :]) | ((s_p[:, None] == s_p[None, :]) & (s_i[:, None] < s_i[None, :]))
    rank = tl.sum((r_beat & m_k[:, None]).to(tl.int32), 0)
    p_out = i_n * K + rank
    tl.store(IDS + p_out, s_i, mask=m_k)
    tl.store(PROBS + p_out, s_p, mask=m_k)
    # JS over [previous ids | this step's ids not among them | rest]: P the previous distribution, Q this one
    p_prev = i_n * K + o_k
    q_i = tl.load(PREV_IDS + p_prev, mask=m_k, other=-1)
    q_p = tl.load(PREV_PROBS + p_prev, mask=m_k, other=0.0).to(tl.float32)
    same = (q_i[:, None] == s_i[None, :]) & m_k[:, None] & m_k[None, :]  # [previous slot, this slot]
    b_pa = tl.maximum(q_p, 0.0)
    b_qa = tl.maximum(tl.sum(tl.where(same, s_p[None, :], 0.0), 1), 0.0)
    b_qb = tl.where(tl.sum(same.to(tl.int32), 0) == 0, s_p, 0.0)
    r_p = tl.maximum(1.0 - tl.sum(q_p, 0), 0.0)
    r_q = tl.maximum(1.0 - tl.sum(s_p, 0), 0.0)
    b_ma = (b_pa + b_qa) / 2
    r_m = (r_p + r_q) / 2
    kl_p = tl.sum(_kl_terms(b_pa, b_ma), 0) + _kl_terms(r_p, r_m)
    kl_q = tl.sum(_kl_terms(b_qa, b_ma) + _kl_terms(b_qb, b_qb / 2), 0) + _kl_terms(r_q, r_m)
    has_prev = tl.load(HAS_PREV + i_n) != 0
    tl.store(JS + i_n, tl.where(has_prev, (kl_p + kl_q) / 2, 1.0))


@triton.jit
def _topk_js_kernel(
    LOGITS, PREV_IDS, PREV_PROBS, HAS_PREV, IDS, PROBS, JS,
    V, K,
    stride_l,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    p_l = LOGITS + i_n * stride_l
    o = tl.arange(0, BLOCK_V)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    # the running top-K, unsorted: empty slots hold -inf at an index past the vocabulary, so that any element, a -inf
    # logit too, beats them; `none` (past every such index) marks a tile with no live element left
    s_v = tl.full([BLOCK_K], float("-inf"), dtype=tl.float32)
    s_i = V + o_k.to(tl.int64)
    none = V + BLOCK_K
    w_v, w_i, w_k = _worst(s_v, s_i, m_k, o_k, BLOCK_K)
    b_m = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    b_z = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        o_v = (v0 + o).to(tl.int64)
        b_live = o_v < V
        b_x = tl.load(p_l + o_v, mask=b_live, other=float("-inf")).to(tl.float32)
        # per-lane online softmax (no -inf - -inf is formed)
        b_mn = tl.maximum(b_m, b_x)
        b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_z = b_z * tl.exp(b_m - b_ref) + tl.exp(b_x - b_ref)
        b_m = b_mn
        # top-K merge: the tile's best element replaces the set's worst while it beats it
        c_v, c_i = _best(b_x, b_live, o_v, none)
        beats = (c_v > w_v) | ((c_v == w_v) & (c_i < w_i))
        while beats:
            s_v = tl.where(o_k == w_k, c_v, s_v)
            s_i = tl.where(o_k == w_k, c_i, s_i)
            b_live = b_live & (o_v != c_i)
            w_v, w_i, w_k = _worst(s_v, s_i, m_k, o_k, BLOCK_K)
            c_v, c_i = _best(b_x, b_live, o_v, none)
            beats = (c_v > w_v) | ((c_v == w_v) & (c_i < w_i))
    m = tl.max(b_m, 0)
    z = tl.sum(tl.where(b_m == float("-inf"), 0.0, b_z * tl.exp(b_m - m)), 0)
    s_p = tl.where(m_k, tl.exp(s_v - m) / z, 0.0)  # [BLOCK_K]
    store_topk_js(s_p, s_i, m_k, o_k, i_n, K, PREV_IDS, PREV_PROBS, HAS_PREV, IDS, PROBS, JS)


def topk_js_triton(logits: torch.Tensor, prev_ids: torch.Tensor, prev_probs: torch.Tensor, has_prev: torch.Tensor,
                   block_v: int | None = None) -> tuple:
    """Triton ``topk_js`` (same contract as ``topk_js_ref``); inputs are validated by ``tracelock.ops`` (1 <= K <= V).
    ``block_v`` overrides the vocabulary tile (a power of two)."""
    N, V = logits.shape
    K = prev_ids.shape[1]
    ids = torch.empty((N, K), dtype=torch.int64, device=logits.device)
    probs = torch.empty((N, K), dtype=torch.float32, device=logits.device)
    js = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return ids, probs, js
    block_v = block_columns(V, block_v)
    _topk_js_kernel[(N,)](logits, prev_ids, prev_probs, has_prev, ids, probs, js, V, K, logits.stride(0),
                          BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(K), num_warps=num_warps_for(block_v))
    return ids, probs, js
