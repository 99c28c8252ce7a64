# Copyright (c) 2025 the tracelock authors.
# KLASS's step in one launch, one program per slot (row): pass 1 runs an online softmax over the logits for the
# row's max, argmax and sum of exponentials; pass 2 forms each probability p, adds p·(log(p + eps) - log(prev + eps))
# to the KL and overwrites prev with p. Computed in prev's dtype (fp32 on a GPU; fp64 where prev is fp64, as the
# spec). IO per row: reads V logits twice (2·V elements) + V elements of prev, writes V elements of prev + 8 bytes +
# two values of prev's dtype. Spec: step_kl_ref in kernels/ref.py.

import torch

from tracelock._triton import triton
from tracelock.kernels.credit_fuse import block_columns, num_warps_for, online_softmax_finish, online_softmax_update

tl = triton.language


@triton.jit
def _step_kl_kernel(
    LOGITS, PREV, PROPOSAL, CONFIDENCE, KL,
    V,
    stride_l,
    BLOCK_V: tl.constexpr,
):
    dt = PREV.dtype.element_ty
    i_n = tl.program_id(0).to(tl.int64)
    p_l = LOGITS + i_n * stride_l
    p_p = PREV + i_n * V
    o = tl.arange(0, BLOCK_V)
    # pass 1: the softmax's max, argmax and sum
    b_m = tl.full([BLOCK_V], float("-inf"), dtype=dt)
    b_z = tl.zeros([BLOCK_V], dtype=dt)
    b_i = tl.zeros([BLOCK_V], dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + o
        b_x = tl.load(p_l + o_v, mask=o_v < V, other=float("-inf")).to(dt)
        b_m, b_z, b_i = online_softmax_update(b_m, b_z, b_i, b_x, o_v.to(tl.int64))
    m, proposal, z = online_softmax_finish(b_m, b_z, b_i, V)
    # pass 2: p, the KL against the stored distribution, which p replaces
    b_kl = tl.zeros([BLOCK_V], dtype=dt)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + o
        m_v = o_v < V
        b_x = tl.load(p_l + o_v, mask=m_v, other=float("-inf")).to(dt)
        b_prev = tl.load(p_p + o_v, mask=m_v, other=0.0).to(dt)
        b_p = tl.exp(b_x - m) / z
        b_kl += tl.where(m_v, b_p * (tl.log(b_p + 1e-12) - tl.log(b_prev + 1e-12)), 0.0)
        tl.store(p_p + o_v, b_p, mask=m_v)
    tl.store(PROPOSAL + i_n, proposal)
    # the top probability: exp(0) / z
    tl.store(CONFIDENCE + i_n, 1.0 / z)
    tl.store(KL + i_n, tl.sum(b_kl, 0))


def step_kl_triton(logits: torch.Tensor, prev: torch.Tensor, block_v: int | None = None) -> tuple:
    """Triton ``step_kl`` (same contract as ``step_kl_ref``: ``prev`` is overwritten in place, and the confidence and
    KL come back in its dtype); inputs are validated by ``tracelock.ops``. ``block_v`` overrides the vocabulary tile
    (a power of two)."""
    N, V = logits.shape
    proposal = torch.empty(N, dtype=torch.int64, device=logits.device)
    confidence = torch.empty(N, dtype=prev.dtype, device=logits.device)
    kl = torch.empty(N, dtype=prev.dtype, device=logits.device)
    if N == 0:
        return proposal, confidence, kl
    block_v = block_columns(V, block_v)
    _step_kl_kernel[(N,)](logits, prev, proposal, confidence, kl, V, logits.stride(0), BLOCK_V=block_v,
                          num_warps=num_warps_for(block_v))
    return proposal, confidence, kl
