# Copyright (c) 2025 the tracelock authors.
# A decode step's matrix products at a few rows (M = batch x query rows, usually <= 32): out = x @ W.T with the
# epilogue fused (bias, then silu(gate) * up, then the residual). Weight-streaming and stream-K: the P programs (a
# multiple of the SM count) share the (tile, K-step) units equally, every program streams one contiguous run of
# them, and the last program to finish a tile split across programs (an atomic counter per tile) sums the fp32
# partials in program order and runs the epilogue: one launch, no reduce kernel. IO: reads N·K weights once,
# M·K·N/BLOCK_N of x (L2), writes M·N outputs + at most 2·P·M·BLOCK_N fp32 partials. Spec: linear_rows_ref.

import torch

from tracelock._triton import autotune_configs, triton
from tracelock.kernels.tap_project import dot_native, with_config

tl = triton.language

# (BLOCK_N, BLOCK_K, PER_SM, SWAP_AB, warps, stages); the first is the safe default of the interpreter and
# TRACELOCK_SKIP_AUTOTUNE. BLOCK_M comes from the launcher (all rows in one tile up to 64, so the weights stream
# through once). PER_SM programs per SM set the grid. SWAP_AB computes (W @ x.T).T so that the weight tile is the
# MMA's 64- or 128-row operand (Hopper's warp-group MMA at any M); else x is, padded to 16 rows. Every config fits
# sm_90's shared memory at BLOCK_M = 64 with the gate/up pair (tests/test_kernels_compile.py); the GPU session
# (bench/studies/gpu_gemm.py) times each.
CONFIGS = [
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 64, "PER_SM": 2, "SWAP_AB": False}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 128, "PER_SM": 2, "SWAP_AB": False}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 64, "PER_SM": 1, "SWAP_AB": False}, num_warps=8, num_stages=5),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 128, "PER_SM": 2, "SWAP_AB": True}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 64, "PER_SM": 1, "SWAP_AB": True}, num_warps=8, num_stages=5),
]
# programs per "SM" without a GPU (the interpreter pays per program instance, so a handful)
CPU_SMS = 4


@triton.jit
def _mma(b_x, b_w, b_acc, DOT_NATIVE: tl.constexpr, SWAP_AB: tl.constexpr):
    # b_acc += b_x @ b_w.T, or its transpose (b_w @ b_x.T) with SWAP_AB; 16-bit tiles as loaded on the tensor cores,
    # else fp32 tiles (exact upcasts) with the IEEE fp32 dot
    if not DOT_NATIVE:
        b_x, b_w = b_x.to(tl.float32), b_w.to(tl.float32)
    if SWAP_AB:
        if DOT_NATIVE:
            b_acc = tl.dot(b_w, tl.trans(b_x), b_acc)  # [BLOCK_N, BLOCK_M]
        else:
            b_acc = tl.dot(b_w, tl.trans(b_x), b_acc, input_precision="ieee")
    else:
        if DOT_NATIVE:
            b_acc = tl.dot(b_x, tl.trans(b_w), b_acc)  # [BLOCK_M, BLOCK_N]
        else:
            b_acc = tl.dot(b_x, tl.trans(b_w), b_acc, input_precision="ieee")
    return b_acc


@triton.autotune(configs=autotune_configs(CONFIGS), key=["N", "K", "BLOCK_M", "SILU_MUL", "DOT_NATIVE"])
@triton.jit
def _linear_rows_kernel(
    X, W, BIAS, RES, OUT, PART, COUNT,
    M, N, K,
    stride_x, stride_r,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, DOT_NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_SM: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    # N is the output width: F of a gate/up weight [2F, K] under SILU_MUL, whose up rows start at row N
    i_p = tl.program_id(0).to(tl.int64)
    P = tl.num_programs(0).to(tl.int64)
    # int64 from here on (an int argument equal to 1 arrives as a constant)
    m_tiles = i_p * 0 + tl.cdiv(M, BLOCK_M)
    KI = i_p * 0 + tl.cdiv(K, BLOCK_K)
    U = m_tiles * tl.cdiv(N, BLOCK_N) * KI
    # units [u_start, u_end) of this program; the launcher keeps P <= U, so no program is empty
    u_start = i_p * U // P
    u_end = (i_p + 1) * U // P
    t_first = u_start // KI
    o_bm, o_bn, o_bk = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    o_mn = (o_bm[:, None] * BLOCK_N + o_bn[None, :]).to(tl.int64)  # [BLOCK_M, BLOCK_N]
    for t in range(t_first, (u_end - 1) // KI + 1):
        # row tiles vary fastest, so programs working at once on one N tile share its weights in L2
        i_m, i_n = t % m_tiles, t // m_tiles
        j0 = tl.maximum(u_start - t * KI, 0)
        j1 = tl.minimum(u_end - t * KI, KI)
        o_m, o_n = i_m * BLOCK_M + o_bm, i_n * BLOCK_N + o_bn
        m_m, m_n = o_m < M, o_n < N
        m_mn = m_m[:, None] & m_n[None, :]
        if SWAP_AB:
            b_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            b_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            b_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            b_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in range(j0, j1):
            o_k = j * BLOCK_K + o_bk
            m_k = o_k < K
            m_w = m_n[:, None] & m_k[None, :]
            b_x = tl.load(X + o_m[:, None] * stride_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(W + o_n[:, None] * K + o_k[None, :], mask=m_w, other=0.0)  # [BLOCK_N, BLOCK_K]
            b_g = _mma(b_x, b_w, b_g, DOT_NATIVE, SWAP_AB)
            if SILU_MUL:
                # the up rows, N rows below the gate rows
                b_w = tl.load(W + (o_n[:, None] + N) * K + o_k[None, :], mask=m_w, other=0.0)
                b_u = _mma(b_x, b_w, b_u, DOT_NATIVE, SWAP_AB)
        if SWAP_AB:
            b_g = tl.trans(b_g)  # [BLOCK_M, BLOCK_N]
            b_u = tl.trans(b_u)
        finish = (j0 == 0) & (j1 == KI)
        if (j0 > 0) | (j1 < KI):
            # a tile split across programs p_first..p_last (consecutive): each one's share is the first or the
            # last run of units of its range, kept in its slot 0 or 1 of the workspace
            p_first = ((t * KI + 1) * P + U - 1) // U - 1
            p_last = ((t * KI + KI) * P + U - 1) // U - 1
            p_part = PART + (i_p * 2 + (t != t_first)) * (2 * BLOCK_M * BLOCK_N) + o_mn
            tl.store(p_part, b_g, mask=m_mn)
            if SILU_MUL:
                tl.store(p_part + BLOCK_M * BLOCK_N, b_u, mask=m_mn)
            # every thread's partial is written before the counter says so (release); the last arrival sums
            tl.debug_barrier()
            arrived = tl.atomic_add(COUNT + t, 1, sem="acq_rel")
            finish = arrived == p_last - p_first
            if finish:
                tl.store(COUNT + t, 0)
                # all shares (this program's read back too) in program order, whichever program came last, so
                # the sum is the same on every call
                b_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                b_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for q in range(p_first, p_last + 1):
                    p_q = PART + (q * 2 + ((q * U // P) // KI != t)) * (2 * BLOCK_M * BLOCK_N) + o_mn
                    b_g += tl.load(p_q, mask=m_mn, other=0.0, cache_modifier=".cg")
                    if SILU_MUL:
                        b_u += tl.load(p_q + BLOCK_M * BLOCK_N, mask=m_mn, other=0.0, cache_modifier=".cg")
        if finish:
            _epilogue(b_g, b_u, BIAS, RES, OUT, o_m, o_n, m_mn, N, stride_r, HAS_BIAS, HAS_RES, SILU_MUL)


@triton.jit
def _epilogue(b_g, b_u, BIAS, RES, OUT, o_m, o_n, m_mn, N, stride_r,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr):
    """A finished tile's fp32 sums [BLOCK_M, BLOCK_N] (gate ``b_g``, up ``b_u``): bias, SiLU x mul, residual, one
    rounding to the output's dtype."""
    m_n = o_n < N
    if HAS_BIAS:
        b_g += tl.load(BIAS + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            b_u += tl.load(BIAS + N + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        b_g = b_g / (1.0 + tl.exp(-b_g)) * b_u
    if HAS_RES:
        b_g += tl.load(RES + o_m[:, None] * stride_r + o_n[None, :], mask=m_mn, other=0.0).to(tl.float32)
    tl.store(OUT + o_m[:, None] * N + o_n[None, :], b_g.to(OUT.dtype.element_ty), mask=m_mn)


def block_rows(M: int) -> int:
    """Rows per tile: all of them up to 64 (16 at least, the MMA's smallest), so the weights stream through once."""
    return min(64, max(16, triton.next_power_of_2(M)))


def sm_count(device: torch.device) -> int:
    """The grid's unit: the SMs of a GPU (132 on an H100 or H200 SXM), `CPU_SMS` without one."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else CPU_SMS


def units(M: int, N: int, K: int, block_m: int, block_n: int, block_k: int) -> int:
    """The (tile, K-step) units of one call: the work the programs share."""
    return triton.cdiv(M, block_m) * triton.cdiv(N, block_n) * triton.cdiv(K, block_k)


# per device: (fp32 partials, int32 tile counters); counters start at zero and every call leaves them so
_WORKSPACES: dict = {}


def workspace(device: torch.device, partials: int, tiles: int) -> tuple:
    """The device's workspace, grown to ``partials`` floats and ``tiles`` counters. Growing it allocates (and zeroes
    the counters), which a CUDA-graph capture cannot do: run one call at the shape before capturing."""
    part, count = _WORKSPACES.get(device, (None, None))
    if part is None or part.numel() < partials or count.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("linear_rows: its workspace must grow during a CUDA-graph capture; call linear_rows "
                               "once at this shape before capturing (a warm-up step does)")
        part = torch.empty(max(partials, 0 if part is None else part.numel()), dtype=torch.float32, device=device)
        count = torch.zeros(max(tiles, 1024, 0 if count is None else count.numel()), dtype=torch.int32,
                            device=device)
        _WORKSPACES[device] = (part, count)
    return part, count


def linear_rows_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       residual: torch.Tensor | None = None, activation: str | None = None,
                       programs: int | None = None, config: int | None = None) -> torch.Tensor:
    """Triton ``linear_rows`` (same contract as ``linear_rows_ref``); inputs are validated by ``tracelock.ops``.
    ``programs`` overrides the grid (tests use it to force every way of splitting a tile); ``config`` launches
    ``CONFIGS[config]`` instead of autotuning (tests check each; benchmarks time each)."""
    M, K = x.shape
    silu_mul = activation == "silu_mul"
    N = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        from tracelock.kernels.ref import linear_rows_ref

        return out.copy_(linear_rows_ref(x, weight, bias, residual, activation))
    BLOCK_M = block_rows(M)
    sms = sm_count(x.device)
    configs = autotune_configs(CONFIGS) if config is None else [CONFIGS[config]]

    def grid_size(kw: dict) -> int:
        return min(programs or sms * kw["PER_SM"], units(M, N, K, BLOCK_M, kw["BLOCK_N"], kw["BLOCK_K"]))

    part, count = workspace(
        x.device, max(grid_size(c.kwargs) * 2 * 2 * BLOCK_M * c.kwargs["BLOCK_N"] for c in configs),
        max(triton.cdiv(M, BLOCK_M) * triton.cdiv(N, c.kwargs["BLOCK_N"]) for c in configs))
    kernel, chosen = with_config(_linear_rows_kernel, CONFIGS, config)
    kernel[lambda meta: (grid_size(meta),)](
        x, weight, x if bias is None else bias, x if residual is None else residual, out, part, count,
        M, N, K, x.stride(0), 0 if residual is None else residual.stride(0),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, SILU_MUL=silu_mul,
        DOT_NATIVE=dot_native(x.dtype, weight.dtype), BLOCK_M=BLOCK_M, **chosen,
    )
    return out
