# Copyright (c) 2025 the tracelock authors.
# The residual add and the RMSNorm after it in one pass, one program per row: the sum is written once and normed
# from registers, instead of an add, an fp32 upcast, a square, a mean, an rsqrt, two products and two casts over
# [M, D] tensors. Statistics in fp32; every rounding of the spec (the sum, the normalised row, the scaled row) done
# in the same dtype and order. IO: reads M·D·2 elements (x, residual) and D of weight (from L2 after the first
# rows), writes M·D·2 (normed, summed; M·D without a residual). Spec: add_rms_norm_ref (kernels/ref.py).

import torch

from tracelock._triton import round_to, triton

tl = triton.language


@triton.jit
def _add_rms_norm_kernel(
    X, RES, W, NORMED, SUMMED,
    D,
    stride_x, stride_r,
    eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_s = tl.load(X + i_m * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BLOCK_D]
    if HAS_RESIDUAL:
        b_r = tl.load(RES + i_m * stride_r + o_d, mask=m_d, other=0.0).to(tl.float32)
        # the sum in x's dtype, then upcast again for the statistics
        b_sum = round_to(b_s + b_r, SUMMED.dtype.element_ty)
        tl.store(SUMMED + i_m * D + o_d, b_sum, mask=m_d)
        b_s = b_sum.to(tl.float32)
    # the mean square as torch's CPU mean takes it (sum / D), and rsqrt as 1 / sqrt, each correctly rounded
    b_ms = tl.math.div_rn(tl.sum(b_s * b_s, 0), D * 1.0)
    b_inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(b_ms + eps))
    b_y = round_to(b_s * b_inv, X.dtype.element_ty).to(tl.float32)
    b_w = tl.load(W + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(NORMED + i_m * D + o_d, round_to(b_w * b_y, NORMED.dtype.element_ty), mask=m_d)


def num_warps_for(block_d: int) -> int:
    """Warps per row: 16 elements per thread from BLOCK_D = 2048 on (two 16-byte loads of a 16-bit row), between 4
    and 16 warps (as Liger-Kernel's `calculate_settings`; not swept on a GPU yet)."""
    return min(max(block_d // 512, 4), 16)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple:
    """Triton ``add_rms_norm`` (same contract as ``add_rms_norm_ref``); inputs are validated by ``tracelock.ops``."""
    M, D = x.shape
    normed = torch.empty((M, D), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = x if residual is None else torch.empty((M, D), dtype=x.dtype, device=x.device)
    if M == 0:
        return normed, summed
    block_d = triton.next_power_of_2(D)
    _add_rms_norm_kernel[(M,)](
        x, x if residual is None else residual, weight, normed, summed, D,
        x.stride(0), x.stride(0) if residual is None else residual.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK_D=block_d, num_warps=num_warps_for(block_d),
    )
    return normed, summed
