# Copyright (c) 2025 the tracelock authors.
# SwiGLU's elementwise half in one pass: out = silu(gate) * up from the fused gate/up projection's output [M, 2F],
# instead of a silu and a product over two [M, F] views with an [M, F] temporary between them. silu as torch
# computes it (fp32 x / (1 + exp(-x)), rounded to the dtype), then the product rounded. Grid (rows, F tiles).
# IO: reads M·2F elements, writes M·F. Spec: silu_mul_ref (kernels/ref.py).

import torch

from tracelock._triton import round_to, triton

tl = triton.language

# columns per program: 8 per thread with 4 warps (16-byte loads of a 16-bit row; not swept on a GPU yet)
BLOCK_F = 1024


@triton.jit
def _silu_mul_kernel(
    GU, OUT,
    F,
    stride_m,
    BLOCK_F: tl.constexpr,
):
    i_m, i_f = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    m_f = o_f < F
    p_g = GU + i_m * stride_m + o_f
    b_g = tl.load(p_g, mask=m_f, other=0.0).to(tl.float32)  # [BLOCK_F]
    b_u = tl.load(p_g + F, mask=m_f, other=0.0).to(tl.float32)
    b_silu = round_to(tl.math.div_rn(b_g, 1.0 + tl.exp(-b_g)), OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + i_m * F + o_f, round_to(b_silu * b_u, OUT.dtype.element_ty), mask=m_f)


def num_warps_for(block_f: int) -> int:
    """4 warps for a full column tile, fewer for a narrow one (at least 8 columns per thread above one warp)."""
    return max(1, min(4, block_f // 256))


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton ``silu_mul`` (same contract as ``silu_mul_ref``); inputs are validated by ``tracelock.ops``."""
    M, F2 = gate_up.shape
    F = F2 // 2
    out = torch.empty((M, F), dtype=gate_up.dtype, device=gate_up.device)
    if M == 0 or F == 0:
        return out
    block_f = min(BLOCK_F, triton.next_power_of_2(F))
    _silu_mul_kernel[(M, triton.cdiv(F, block_f))](gate_up, out, F, gate_up.stride(0), BLOCK_F=block_f,
                                                  num_warps=num_warps_for(block_f))
    return out
