"""The one op object of a decode: every op bound once by `choose`, and the backbone's per-layer ops among them."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tracelock.ops.chooser import IMPLEMENTATIONS, PER_LAYER, choose

# what a backbone forward runs per layer: "kernels" (the default), "specs" or "kernels+matmul"
BACKBONES = ("kernels", "specs", "kernels+matmul")
# the Triton products stream their weight for a few rows (a decode step); a refresh's thousands of rows take cuBLAS
MATMUL_ROWS = 64


@dataclass(frozen=True)
class OpSet:
    """The ops of one decode, each bound to its implementation (``impls``: op -> name). ``fused``: the loop runs the
    fused paths (the head's signals in the forward, the commit rule in `commit_step`); False for the spec set, which
    is the reference path. ``linear`` is the backbone's matrix product (``x @ weight.T + bias``; with ``epilogues``
    also its residual and SiLU x mul), ``add_rms_norm``, ``rope_qkv`` and ``silu_mul`` its other per-layer ops
    (`tracelock.models.backbone.Kernels` is their spec)."""

    apply_commits: Callable
    skip_finished_blocks: Callable
    window_logits_stats: Callable
    tap_project: Callable
    commit_step: Callable
    add_rms_norm: Callable
    rope_qkv: Callable
    silu_mul: Callable
    linear_rows: Callable
    credit_fuse: Callable
    step_kl: Callable
    topk_js: Callable
    head_credit_fuse: Callable
    head_topk_js: Callable
    head_step_kl: Callable
    linear: Callable
    epilogues: bool
    fused: bool
    impls: dict


def op_set(device, mode: str = "eager", *, impl: str | None = None, backbone: str = "kernels") -> OpSet:
    """The ops a decode runs on ``device``, each chosen by `choose` in ``mode`` ("eager": the loop, ``impl``'s family
    obeyed; "graph" / "inductor": the engine; "specs": the reference). ``backbone`` picks the per-layer ops:
    "kernels", each op's choice and cuBLAS's products; "specs", the plain-PyTorch specs (inductor fuses them in a
    compiled step); "kernels+matmul", also the Triton weight-streaming products with their epilogues
    (`linear_rows`), more than `MATMUL_ROWS` rows (a refresh) taking cuBLAS."""
    if backbone not in BACKBONES:
        raise ValueError(f"backbone={backbone!r} must be one of {', '.join(BACKBONES)}")
    device = torch.device(device)
    chosen = {op: choose(op, device, "specs" if backbone == "specs" and op in PER_LAYER else mode, impl)
              for op in IMPLEMENTATIONS}
    epilogues = backbone == "kernels+matmul"
    linear = _rows_linear(chosen["linear_rows"].fn) if epilogues else _cublas_linear
    return OpSet(**{op: c.fn for op, c in chosen.items()}, linear=linear, epilogues=epilogues,
                 fused=mode != "specs", impls={op: c.name for op, c in chosen.items()})


_SPECS = None


def spec_set() -> OpSet:
    """The plain-PyTorch specs of every op (`op_set` "specs"): the reference path, and a backbone forward's default."""
    global _SPECS
    if _SPECS is None:
        _SPECS = op_set("cpu", "specs")
    return _SPECS


def _cublas_linear(x, weight, bias=None, residual=None, activation=None):
    """nn.Linear's product (cuBLAS on CUDA); it takes no epilogue (``OpSet.epilogues`` is False)."""
    if residual is not None or activation is not None:
        raise ValueError("the cuBLAS product runs no epilogue: hand the residual / SiLU x mul to the next op")
    return torch.nn.functional.linear(x, weight, bias)


def _epilogue_in_dtype(x, weight, bias=None, residual=None, activation=None):
    """linear_rows' result by separate ops in the model's dtype (cuBLAS, then the SiLU x mul and the residual add):
    what a refresh's many rows take instead of the weight-streaming kernel."""
    y = torch.nn.functional.linear(x, weight, bias)
    if activation == "silu_mul":
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    return y if residual is None else y + residual


def _rows_linear(fn):
    """``fn`` (linear_rows) on [..., K] inputs: leading dimensions flattened into rows; more than `MATMUL_ROWS` rows
    (a refresh) take `_epilogue_in_dtype` instead."""

    def linear(x, weight, bias=None, residual=None, activation=None):
        lead, K = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, K)
        if rows.shape[0] > MATMUL_ROWS:
            return _epilogue_in_dtype(x, weight, bias, residual, activation)
        res = None if residual is None else residual.reshape(rows.shape[0], -1)
        return fn(rows, weight, bias, res, activation).view(*lead, -1)

    return linear
