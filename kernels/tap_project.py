# Copyright (c) 2025 the tracelock authors.
# Fold the three hidden-state taps into controller inputs in one pass: out = h1 @ A0 + h2 @ A1 + h3 @ A2 + c.
# The deltas (h2 - h1, h3 - h2) and the per-tap codes are folded into A on the host, so nothing but the
# [T, N] result is written. IO: reads 3·T·D taps + 3·D·N weights (once per T tile, L2-resident) + N bias,
# writes T·N fp32. Spec: tap_project_ref in kernels/ref.py; budget at LLaDA-8B shape in kernels/README.md.

import torch

from tracelock._triton import autotune_configs, triton, triton_interpret

tl = triton.language

# (BLOCK_T, BLOCK_N, BLOCK_D, warps, stages); the first is the safe default the interpreter and
# TRACELOCK_SKIP_AUTOTUNE use. All tiles >= 16 so every tl.dot compiles for sm_80/sm_90 (K >= 16).
# The last two are the larger tiles of a bf16 GEMM on sm_90 (T = B x 384 canvas rows reaches 12288 at B = 32, where
# the op leans to compute): 128-row tiles for warp-group MMA, within sm_90's shared memory
# (tests/test_kernels_compile.py).
CONFIGS = [
    triton.Config({"BLOCK_T": 64, "BLOCK_N": 64, "BLOCK_D": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 32, "BLOCK_N": 64, "BLOCK_D": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 64, "BLOCK_N": 128, "BLOCK_D": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_N": 128, "BLOCK_D": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_N": 64, "BLOCK_D": 32}, num_warps=4, num_stages=4),
]


# T_BUCKET (the row count's power of two) is in the key only: the best tile height follows the rows. Keyed without
# it, the tiles tuned at B = 1 served B = 8 and 32 too, where a 64-row tile ran 1.8x faster (H200, LLaDA-8B's shape).
@triton.autotune(configs=autotune_configs(CONFIGS), key=["N", "D", "T_BUCKET", "DOT_NATIVE"])
@triton.jit
def _tap_project_kernel(
    H1, H2, H3, A, C, OUT,
    T, D, N, T_BUCKET,
    stride_h1, stride_h2, stride_h3,
    DOT_NATIVE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # program 0 varies fastest, so neighbouring programs share one N tile of A while it sits in L2
    i_t, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_t, m_n = o_t < T, o_n < N
    b_acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        m_h = m_t[:, None] & m_d[None, :]
        m_a = m_d[:, None] & m_n[None, :]
        p_a = A + o_d[:, None] * N + o_n[None, :]
        b_h1 = tl.load(H1 + o_t[:, None] * stride_h1 + o_d[None, :], mask=m_h, other=0.0)  # [BLOCK_T, BLOCK_D]
        b_h2 = tl.load(H2 + o_t[:, None] * stride_h2 + o_d[None, :], mask=m_h, other=0.0)
        b_h3 = tl.load(H3 + o_t[:, None] * stride_h3 + o_d[None, :], mask=m_h, other=0.0)
        b_a0 = tl.load(p_a, mask=m_a, other=0.0)  # [BLOCK_D, BLOCK_N]
        b_a1 = tl.load(p_a + D * N, mask=m_a, other=0.0)
        b_a2 = tl.load(p_a + 2 * D * N, mask=m_a, other=0.0)
        if DOT_NATIVE:
            # one 16-bit dtype for taps and weights: tensor-core dot with fp32 accumulation (products are exact)
            b_acc = tl.dot(b_h1, b_a0, b_acc)
            b_acc = tl.dot(b_h2, b_a1, b_acc)
            b_acc = tl.dot(b_h3, b_a2, b_acc)
        else:
            b_acc = tl.dot(b_h1.to(tl.float32), b_a0.to(tl.float32), b_acc, input_precision="ieee")
            b_acc = tl.dot(b_h2.to(tl.float32), b_a1.to(tl.float32), b_acc, input_precision="ieee")
            b_acc = tl.dot(b_h3.to(tl.float32), b_a2.to(tl.float32), b_acc, input_precision="ieee")
    b_c = tl.load(C + o_n, mask=m_n, other=0.0).to(tl.float32)  # [BLOCK_N]
    b_acc += b_c[None, :]
    tl.store(OUT + o_t[:, None] * N + o_n[None, :], b_acc, mask=m_t[:, None] & m_n[None, :])


def dot_native(*dtypes: torch.dtype) -> bool:
    """Whether the kernels may feed tl.dot their tiles as loaded: all operands share one 16-bit dtype and the
    interpreter is off (its bf16 tl.dot is wrong in triton 3.6/3.7, see tracelock._triton); else they upcast
    to fp32 (exact) and use an IEEE fp32 dot."""
    return not triton_interpret and len(set(dtypes)) == 1 and dtypes[0] in (torch.float16, torch.bfloat16)


def with_config(kernel, configs: list, index: int | None) -> tuple:
    """(what to launch, its extra launch arguments): ``kernel`` (autotuned) for None, else the JIT function under
    the autotuner with ``configs[index]``'s block sizes, warps and stages."""
    if index is None:
        return kernel, {}
    config = configs[index]
    return kernel.fn, dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def tap_project_triton(h1: torch.Tensor, h2: torch.Tensor, h3: torch.Tensor, A: torch.Tensor,
                       c: torch.Tensor, config: int | None = None) -> torch.Tensor:
    """Triton ``tap_project`` (same contract as ``tap_project_ref``); inputs are validated by ``tracelock.ops``.
    ``config`` launches ``CONFIGS[config]`` instead of autotuning (tests check each; benchmarks time each)."""
    T, D = h1.shape
    N = A.shape[2]
    out = torch.empty((T, N), dtype=torch.float32, device=h1.device)
    if T == 0 or N == 0:
        return out
    if D == 0:
        return out.copy_(c.float().expand(T, N))

    def grid(meta):
        return triton.cdiv(T, meta["BLOCK_T"]), triton.cdiv(N, meta["BLOCK_N"])

    kernel, chosen = with_config(_tap_project_kernel, CONFIGS, config)
    kernel[grid](
        h1, h2, h3, A, c, out, T, D, N, triton.next_power_of_2(T), h1.stride(0), h2.stride(0), h3.stride(0),
        DOT_NATIVE=dot_native(h1.dtype, h2.dtype, h3.dtype, A.dtype), **chosen,
    )
    return out
