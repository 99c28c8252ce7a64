# Copyright (c) 2025 the tracelock authors.
# CreditDecoding's step in one launch, one program per slot (row): pass 1 runs an online softmax over the logits
# for the top-1 probability p1 and its token v1; pass 2 decays the row's credit (or restarts it), adds p1 ** gamma at
# v1 for a boosted row, writes the credit back, fuses it into the logits (logits + alpha·log(C + 1)) and runs a
# second online softmax over the fused row for its argmax and confidence. Neither the softmax nor the fused logits
# are ever written. Running maxima, argmaxima and sums are kept per lane and reduced once per pass.
# IO per row: reads V logits twice (2·V elements) + V·4 bytes of credit (not at all for a fresh row), writes V·4 bytes
# of credit + 12 bytes. Spec: credit_fuse_ref in kernels/ref.py.

import torch

from tracelock._triton import triton

tl = triton.language

# vocabulary columns per tile: 8 per thread at 16 warps (16-byte loads of a 16-bit row). The loop's loads are not
# software-pipelined (they feed no dot), so a program has one tile in flight: a wide tile keeps 8 KB of a bf16 row in
# flight where a window of 32 slots runs 32 programs. ptxas (sm_90): 54-114 registers, no spills. Not swept on a GPU.
BLOCK_V = 4096


@triton.jit
def online_softmax_update(b_m, b_z, b_i, b_x, o_v):
    """One tile of a per-lane online softmax: running max ``b_m``, its first index ``b_i`` (a later tile must be
    strictly larger, so ties keep the lowest index), and ``b_z``, the sum of exp(x - b_m). A lane that has seen only
    -inf keeps max -inf and sum 0 (no -inf - -inf is formed)."""
    b_i = tl.where(b_x > b_m, o_v, b_i)
    b_mn = tl.maximum(b_m, b_x)
    b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)
    b_z = b_z * tl.exp(b_m - b_ref) + tl.exp(b_x - b_ref)
    return b_mn, b_z, b_i


@triton.jit
def online_softmax_finish(b_m, b_z, b_i, V):
    """The row's max, argmax (the lowest index among equal maxima) and sum of exp(x - max) from the lanes'."""
    m = tl.max(b_m, 0)
    i = tl.min(tl.where(b_m == m, b_i, V), 0)
    z = tl.sum(tl.where(b_m == float("-inf"), 0.0, b_z * tl.exp(b_m - m)), 0)
    return m, i, z


@triton.jit
def _credit_fuse_kernel(
    LOGITS, CREDIT, BOOST, FRESH, PROPOSAL, CONFIDENCE,
    V,
    stride_l,
    alpha, gamma, beta,
    BLOCK_V: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    p_l = LOGITS + i_n * stride_l
    p_c = CREDIT + i_n * V
    o = tl.arange(0, BLOCK_V)
    # pass 1: (p1, v1), the top-1 of softmax(logits)
    b_m = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    b_z = tl.zeros([BLOCK_V], dtype=tl.float32)
    b_i = tl.zeros([BLOCK_V], dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + o
        b_x = tl.load(p_l + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
        b_m, b_z, b_i = online_softmax_update(b_m, b_z, b_i, b_x, o_v.to(tl.int64))
    _, v1, z1 = online_softmax_finish(b_m, b_z, b_i, V)
    # p1 ** gamma, p1 = 1 / z1 (the max-shifted exponential of the top-1 is 1), times 0 or 1 for the boost
    b_add = tl.exp(gamma * tl.log(1.0 / z1)) * (tl.load(BOOST + i_n) != 0).to(tl.float32)
    fresh = tl.load(FRESH + i_n) != 0
    # pass 2: the credit, written back, and the fused logits' softmax
    b_m = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    b_z = tl.zeros([BLOCK_V], dtype=tl.float32)
    b_i = tl.zeros([BLOCK_V], dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + o
        m_v = o_v < V
        b_x = tl.load(p_l + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
        # a fresh row's credit is not read: it restarts from zero
        b_c = tl.where(fresh, 0.0, tl.load(p_c + o_v, mask=m_v & ~fresh, other=0.0) * beta)
        b_c = tl.where(o_v == v1, b_c + b_add, b_c)
        tl.store(p_c + o_v, b_c, mask=m_v)
        b_f = tl.where(m_v, b_x + alpha * tl.log(b_c + 1.0), float("-inf"))
        b_m, b_z, b_i = online_softmax_update(b_m, b_z, b_i, b_f, o_v.to(tl.int64))
    _, proposal, z = online_softmax_finish(b_m, b_z, b_i, V)
    tl.store(PROPOSAL + i_n, proposal)
    # softmax(fused)[proposal] = exp(0) / z
    tl.store(CONFIDENCE + i_n, 1.0 / z)


def block_columns(V: int, block_v: int | None = None) -> int:
    """The vocabulary tile: ``block_v`` (tests force several tiles with it), else `BLOCK_V` or the next power of two
    of a smaller vocabulary."""
    return block_v or min(BLOCK_V, triton.next_power_of_2(V))


def num_warps_for(block_v: int) -> int:
    """8 columns per thread, 1 to 16 warps."""
    return max(1, min(16, block_v // 256))


def credit_fuse_triton(logits: torch.Tensor, credit: torch.Tensor, boost: torch.Tensor, fresh: torch.Tensor,
                       alpha: float, gamma: float, beta: float, block_v: int | None = None) -> tuple:
    """Triton ``credit_fuse`` (same contract as ``credit_fuse_ref``: ``credit`` is updated in place); inputs are
    validated by ``tracelock.ops``. ``block_v`` overrides the vocabulary tile (a power of two)."""
    N, V = logits.shape
    proposal = torch.empty(N, dtype=torch.int64, device=logits.device)
    confidence = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return proposal, confidence
    block_v = block_columns(V, block_v)
    _credit_fuse_kernel[(N,)](
        logits, credit, boost, fresh, proposal, confidence, V, logits.stride(0), float(alpha), float(gamma),
        float(beta), BLOCK_V=block_v, num_warps=num_warps_for(block_v),
    )
    return proposal, confidence
