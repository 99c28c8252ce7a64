"""A backbone layer's ops: the residual add with its norm, the rotary split of q/k/v, SwiGLU, the few-row product."""

import torch

from tracelock.ops.checks import FLOATS, check_arg, check_dims, check_index_range
from tracelock.ops.chooser import call, pick

# the Triton add_rms_norm holds a row in registers (one program per row)
MAX_NORM_WIDTH = 65536


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                 impl: str | None = None) -> tuple:
    """The residual add and the RMSNorm after it in one pass (spec: ``add_rms_norm_ref``; the backbone's
    ``RMSNorm`` of ``x + residual``): ``summed = x + residual`` in x's dtype, ``normed = weight * (s * rsqrt(mean(s²)
    + eps)).to(x.dtype)`` with ``s = summed`` upcast to fp32 for the statistics.

    Args:
        x (torch.Tensor): [M, D] rows, fp32, fp16 or bf16; rows may be strided (each row contiguous).
        residual (torch.Tensor, optional): [M, D] in x's dtype, rows likewise; None: ``summed`` is ``x`` itself.
        weight (torch.Tensor): [D] the norm's scale, the model's dtype (any float dtype: torch's promotion).
        eps (float): added to the mean square, >= 0.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (normed [M, D] in x's dtype (promoted with weight's), summed [M, D] in x's dtype).
    """
    check_arg("x", x, FLOATS, strided_rows=True)
    check_dims("x", x, "[M, D]")
    M, D = x.shape
    if D == 0:
        raise ValueError(f"x must be [M, D] with D >= 1 columns to normalise, got shape {list(x.shape)}")
    like = ("x", x)
    if residual is not None:
        check_arg("residual", residual, (x.dtype,), (M, D), like, strided_rows=True)
    check_arg("weight", weight, FLOATS, (D,), like)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0 (the norm's epsilon, e.g. 1e-5), got {eps!r}")
    chosen = pick("add_rms_norm", impl, x.device)
    if chosen == "triton" and D > MAX_NORM_WIDTH:
        raise ValueError(f"x has D = {D} columns; the Triton add_rms_norm holds a row in registers, at most "
                         f"{MAX_NORM_WIDTH}: use impl='torch'")
    return call("add_rms_norm", impl, chosen, x, residual, weight, float(eps))


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
             rope_fp32: bool, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
             index: torch.Tensor | None = None, *, impl: str | None = None) -> tuple:
    """Split the fused q/k/v projection's output into heads and apply RoPE to q and k in one pass (spec:
    ``rope_qkv_ref``; the backbone's ``apply_rope``), writing k and v straight into a KV cache when one is given.

    Args:
        qkv (torch.Tensor): [B, Q, (n_heads + 2·n_kv)·head_dim], fp32, fp16 or bf16: q's heads, then k's, then v's;
            any strides but a contiguous last dimension.
        cos, sin (torch.Tensor): [B, Q, head_dim] fp32 (``models.backbone.rope_cos_sin``), last dimension contiguous.
        n_heads, n_kv, head_dim (int): query heads, key/value heads, head width (even).
        rope_fp32 (bool): rotate in fp32 (LLaDA) or in the dtype, cos and sin cast to it (Dream).
        k_cache, v_cache (torch.Tensor, optional): [B, n_kv, Lc, head_dim] in qkv's dtype, last dimension contiguous:
            the rotated k and v are written in place at ``index`` and the caches are returned. Give the three together
            or none.
        index (torch.Tensor, optional): [B, Q] int64 cache positions of the rows, in [0, Lc) (checked on a CPU,
            outside a compiled graph; on a GPU the kernel drops a write outside); a row may repeat a position only
            with equal values (padding).
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (q [B, n_heads, Q, head_dim] contiguous, k and v [B, n_kv, Q, head_dim] contiguous or the caches), qkv's dtype.
    """
    check_arg("qkv", qkv, FLOATS, strided_rows=True)
    check_dims("qkv", qkv, "[B, Q, (n_heads + 2 n_kv) head_dim]")
    for name, value in (("n_heads", n_heads), ("n_kv", n_kv), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates the two halves of a head), got {head_dim}")
    B, Q, N = qkv.shape
    if N != (n_heads + 2 * n_kv) * head_dim:
        raise ValueError(f"qkv must have (n_heads + 2 n_kv) head_dim = ({n_heads} + 2·{n_kv})·{head_dim} = "
                         f"{(n_heads + 2 * n_kv) * head_dim} columns (the fused q/k/v projection), got {N}")
    like = ("qkv", qkv)
    check_arg("cos", cos, (torch.float32,), (B, Q, head_dim), like, strided_rows=True)
    check_arg("sin", sin, (torch.float32,), (B, Q, head_dim), like, strided_rows=True)
    if not isinstance(rope_fp32, bool):
        raise TypeError(f"rope_fp32 must be a bool, got {rope_fp32!r}")
    given = [name for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("index", index)) if t is not None]
    if given and len(given) < 3:
        raise ValueError(f"k_cache, v_cache and index go together (a cached step writes its keys and values at "
                         f"index); got only {', '.join(given)}")
    if given:
        check_arg("k_cache", k_cache, (qkv.dtype,), like=like, strided_rows=True)
        if k_cache.dim() != 4 or tuple(k_cache.shape[:2]) != (B, n_kv) or k_cache.shape[3] != head_dim or \
                k_cache.shape[2] == 0:
            raise ValueError(f"k_cache must be [B, n_kv, Lc, head_dim] = [{B}, {n_kv}, Lc >= 1, {head_dim}], got "
                             f"shape {list(k_cache.shape)}")
        check_arg("v_cache", v_cache, (qkv.dtype,), tuple(k_cache.shape), like, strided_rows=True)
        check_arg("index", index, (torch.int64,), (B, Q), like, strided_rows=True)
        check_index_range(index, k_cache.shape[2])
    return call("rope_qkv", impl, pick("rope_qkv", impl, qkv.device), qkv, cos, sin, n_heads, n_kv, head_dim,
                rope_fp32, k_cache, v_cache, index)


def silu_mul(gate_up: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """SwiGLU's elementwise half in one pass (spec: ``silu_mul_ref``): ``silu(gate) * up`` in the dtype, from the
    fused gate/up projection's output, gate columns first.

    Args:
        gate_up (torch.Tensor): [M, 2F], fp32, fp16 or bf16; rows may be strided (each row contiguous).
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        out (torch.Tensor): [M, F] contiguous, gate_up's dtype.
    """
    check_arg("gate_up", gate_up, FLOATS, strided_rows=True)
    check_dims("gate_up", gate_up, "[M, 2F]")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [M, 2F] (gate columns, then as many up columns), got an odd width "
                         f"{gate_up.shape[1]}")
    return call("silu_mul", impl, pick("silu_mul", impl, gate_up.device), gate_up)


ACTIVATIONS = (None, "silu_mul")


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, activation: str | None = None, *,
                impl: str | None = None) -> torch.Tensor:
    """A decode step's matrix product at a few rows with its epilogue fused (spec: ``linear_rows_ref``):
    ``y = x @ weight.T + bias``, then ``silu(y[:, :F]) * y[:, F:]`` with ``activation="silu_mul"`` (the fused
    gate/up weight, gate rows first), then ``+ residual``; fp32 accumulation and epilogue, one rounding to x's dtype.
    The Triton path streams the weight once per call in one launch, its K split across a grid of a multiple of the
    SM count (kernels/README.md, "linear_rows").

    Args:
        x (torch.Tensor): [M, K] rows (M = batch x query rows), fp32, fp16 or bf16; rows may be strided (each row
            contiguous).
        weight (torch.Tensor): [N, K] contiguous in x's dtype (nn.Linear's layout); [2F, K] with ``"silu_mul"``.
        bias (torch.Tensor, optional): [N] any float dtype, added before the activation. Default: None.
        residual (torch.Tensor, optional): [M, N] ([M, F] with ``"silu_mul"``), any float dtype, rows may be strided;
            added last. Default: None.
        activation (str, optional): None or ``"silu_mul"``. Default: None.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        out (torch.Tensor): [M, N] ([M, F] with ``"silu_mul"``) contiguous, x's dtype.
    """
    check_arg("x", x, FLOATS, strided_rows=True)
    check_dims("x", x, "[M, K]")
    M, K = x.shape
    like = ("x", x)
    check_arg("weight", weight, FLOATS, like=like)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must be {str(x.dtype).removeprefix('torch.')} like x, got "
                        f"{str(weight.dtype).removeprefix('torch.')} (cast one with .to())")
    if weight.dim() != 2 or weight.shape[1] != K or weight.shape[0] == 0:
        raise ValueError(f"weight must be [N, K] with N >= 1 and K = {K} (x's width), got shape {list(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    N = weight.shape[0]
    if activation == "silu_mul" and N % 2:
        raise ValueError(f"activation='silu_mul' needs the fused gate/up weight [2F, K] (gate rows, then as many up "
                         f"rows), got an odd N = {N}")
    if bias is not None:
        check_arg("bias", bias, FLOATS, (N,), like)
    if residual is not None:
        check_arg("residual", residual, FLOATS, (M, N // 2 if activation == "silu_mul" else N), like,
                   strided_rows=True)
    return call("linear_rows", impl, pick("linear_rows", impl, x.device), x, weight, bias, residual, activation)
