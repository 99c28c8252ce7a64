# Copyright (c) 2025 the tracelock authors.
# Split the fused q/k/v projection's output into heads, rotate q and k (half-split RoPE, LLaDA's fp32 or Dream's
# in-dtype rounding, bit for bit but for a zero's sign) and write q, k and v in one pass: k and v straight into the KV
# cache at their canvas positions when a cache is given (no scatter copy of the cache), else into fresh tensors.
# Grid (query rows, head blocks); each program holds BLOCK_H heads of one row as two [BLOCK_H, HEAD_DIM / 2] halves.
# IO: reads B·Q·(H + 2·KV)·hd elements and B·Q·hd·2 fp32 of cos/sin, writes the same elements once.
# Spec: rope_qkv_ref (kernels/ref.py).

import torch

from tracelock._triton import mul_rn, round_to, triton

tl = triton.language


@triton.jit
def _in_dtype(x, LIKE):
    """fp32 ``x`` rounded to the element dtype of the pointer ``LIKE``, as fp32 again."""
    return round_to(x, LIKE.dtype.element_ty).to(tl.float32)


@triton.jit
def _rope_qkv_kernel(
    QKV, COS, SIN, INDEX, Q_OUT, K_OUT, V_OUT,
    Q, H, KV, L_KV,
    stride_xb, stride_xq, stride_cb, stride_cq, stride_sb, stride_sq, stride_ib, stride_iq,
    stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
    ROPE_FP32: tl.constexpr, HAS_INDEX: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    i_bq, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_q = i_bq // Q, i_bq % Q
    # the row's heads in the fused layout: H query heads, then KV key heads, then KV value heads
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_HALF)
    m_d = o_d < HALF
    m_x = (o_h < H + 2 * KV)[:, None] & m_d[None, :]
    p_x = QKV + i_b * stride_xb + i_q * stride_xq + o_h[:, None] * HEAD_DIM + o_d[None, :]
    b_t1 = tl.load(p_x, mask=m_x, other=0.0)  # [BLOCK_H, BLOCK_HALF]
    b_t2 = tl.load(p_x + HALF, mask=m_x, other=0.0)
    b_x1, b_x2 = b_t1.to(tl.float32), b_t2.to(tl.float32)
    p_c = COS + i_b * stride_cb + i_q * stride_cq + o_d
    p_s = SIN + i_b * stride_sb + i_q * stride_sq + o_d
    b_c1 = tl.load(p_c, mask=m_d, other=0.0)[None, :]  # [1, BLOCK_HALF]
    b_c2 = tl.load(p_c + HALF, mask=m_d, other=0.0)[None, :]
    b_s1 = tl.load(p_s, mask=m_d, other=0.0)[None, :]
    b_s2 = tl.load(p_s + HALF, mask=m_d, other=0.0)[None, :]
    # t * cos + rotate_half(t) * sin with rotate_half(t) = [-t2, t1], each product and the sum rounded: to fp32
    # (rope_fp32, then cast to the dtype), or to the dtype with cos and sin cast to it first (a product of two 16-bit
    # values is exact in fp32, so it rounds once, as in torch)
    if ROPE_FP32:
        b_o1 = mul_rn(b_x1, b_c1) - mul_rn(b_x2, b_s1)
        b_o2 = mul_rn(b_x2, b_c2) + mul_rn(b_x1, b_s2)
    else:
        b_c1, b_c2 = _in_dtype(b_c1, QKV), _in_dtype(b_c2, QKV)
        b_s1, b_s2 = _in_dtype(b_s1, QKV), _in_dtype(b_s2, QKV)
        b_o1 = _in_dtype(mul_rn(b_x1, b_c1), QKV) - _in_dtype(mul_rn(b_x2, b_s1), QKV)
        b_o2 = _in_dtype(mul_rn(b_x2, b_c2), QKV) + _in_dtype(mul_rn(b_x1, b_s2), QKV)
    b_o1 = round_to(b_o1, Q_OUT.dtype.element_ty)  # [BLOCK_H, BLOCK_HALF]
    b_o2 = round_to(b_o2, Q_OUT.dtype.element_ty)

    # destinations: q [B, H, Q, hd]; k and v [B, KV, L_KV, hd] (any strides but the last) at canvas position
    # INDEX[b, q] (the cache) or at q
    if HAS_INDEX:
        i_pos = tl.load(INDEX + i_b * stride_ib + i_q * stride_iq)
    else:
        i_pos = i_q
    m_pos = (i_pos >= 0) & (i_pos < L_KV)
    is_q = o_h < H
    is_k = (o_h >= H) & (o_h < H + KV) & m_pos
    is_v = (o_h >= H + KV) & (o_h < H + 2 * KV) & m_pos
    p_q = Q_OUT + ((i_b * H + o_h[:, None]) * Q + i_q) * HEAD_DIM + o_d[None, :]
    p_k = K_OUT + i_b * stride_kb + (o_h[:, None] - H) * stride_kh + i_pos * stride_kl + o_d[None, :]
    p_v = V_OUT + i_b * stride_vb + (o_h[:, None] - H - KV) * stride_vh + i_pos * stride_vl + o_d[None, :]
    m_q, m_k, m_v = m_x & is_q[:, None], m_x & is_k[:, None], m_x & is_v[:, None]
    tl.store(p_q, b_o1, mask=m_q)
    tl.store(p_q + HALF, b_o2, mask=m_q)
    tl.store(p_k, b_o1, mask=m_k)
    tl.store(p_k + HALF, b_o2, mask=m_k)
    tl.store(p_v, b_t1, mask=m_v)
    tl.store(p_v + HALF, b_t2, mask=m_v)


def block_heads(n_heads_total: int, head_dim: int) -> int:
    """Heads per program: tiles of about 1024 elements per half (two 16-byte loads per thread with 4 warps at
    head_dim 128, 16 heads), fewer when the row has fewer heads (not swept on a GPU yet)."""
    half = triton.next_power_of_2(max(head_dim // 2, 1))
    return min(triton.next_power_of_2(n_heads_total), max(1024 // half, 1))


def rope_qkv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int,
                    head_dim: int, rope_fp32: bool, k_cache: torch.Tensor | None = None,
                    v_cache: torch.Tensor | None = None, index: torch.Tensor | None = None) -> tuple:
    """Triton ``rope_qkv`` (same contract as ``rope_qkv_ref``); inputs are validated by ``tracelock.ops``."""
    B, Q, _ = qkv.shape
    q = torch.empty((B, n_heads, Q, head_dim), dtype=qkv.dtype, device=qkv.device)
    if k_cache is None:
        k = torch.empty((B, n_kv, Q, head_dim), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty((B, n_kv, Q, head_dim), dtype=qkv.dtype, device=qkv.device)
    else:
        k, v = k_cache, v_cache
    if B * Q == 0:
        return q, k, v
    heads = n_heads + 2 * n_kv
    block_h = block_heads(heads, head_dim)
    grid = (B * Q, triton.cdiv(heads, block_h))
    index_strides = (0, 0) if index is None else (index.stride(0), index.stride(1))
    _rope_qkv_kernel[grid](
        qkv, cos, sin, qkv if index is None else index, q, k, v,
        Q, n_heads, n_kv, k.shape[2],
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), *index_strides,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        ROPE_FP32=bool(rope_fp32), HAS_INDEX=index is not None, HEAD_DIM=head_dim, BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(max(head_dim // 2, 1)), num_warps=4,
    )
    return q, k, v
