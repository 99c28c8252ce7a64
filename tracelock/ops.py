"""Public op dispatchers. Each op takes ``impl=`` and otherwise picks the fastest available implementation.

Order: explicit ``impl=`` > ``TRACELOCK_IMPL`` > "cuda" when ``tracelock._C`` has CUDA and the tensors are
on CUDA > "cpp" when ``tracelock._C`` imported and the tensors are on CPU > "triton" when triton is installed
and the tensors are on CUDA or ``TRITON_INTERPRET=1`` was set before importing tracelock > "torch" (the
``*_ref`` spec). Triton is imported lazily (through ``tracelock._triton``), so ``import tracelock`` never loads it.
An explicit or environment choice is obeyed or fails with the fix; it never silently falls back.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from tracelock import _ext, selfcheck

IMPLS = ("torch", "triton", "cpp", "cuda")
_REBUILD = "`pip install -e . --no-build-isolation` (with a C++ compiler, TRACELOCK_BUILD_EXT unset)"
_REBUILD_CUDA = "`TRACELOCK_BUILD_CUDA=1 pip install -e . --no-build-isolation`"


def _triton_state(device: torch.device) -> str | None:
    """None when Triton can run on ``device``, else why not (with the fix)."""
    from tracelock import _triton

    if not _triton.triton_available:
        return "triton is not installed; `pip install triton==3.7.1` (Linux)"
    if device.type != "cuda" and not _triton.triton_interpret:
        return (f"it runs on CUDA tensors, or on CPU under the interpreter, got {device} without TRITON_INTERPRET=1 "
                "(set it before importing tracelock); use impl='torch'")
    return None


def requested_impl(impl: str | None) -> str | None:
    """``impl``, else ``TRACELOCK_IMPL``, else None; an unknown name is an error that lists the known ones."""
    impl = impl or os.environ.get("TRACELOCK_IMPL") or None
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r} (from impl= or TRACELOCK_IMPL); known impls: {', '.join(IMPLS)}")
    return impl


def check_impl(impl: str | None, device) -> None:
    """``impl`` (or ``TRACELOCK_IMPL``) as `fused_generate` takes it, a family of op implementations: an error
    naming it and the fix when it cannot run on ``device``, before any decoding starts."""
    requested = requested_impl(impl)
    if requested in (None, "torch"):
        return
    device = torch.device(device)
    source = "" if impl else " (from TRACELOCK_IMPL)"
    why = None
    if requested == "cpp":
        if not _ext.has_cpp():
            why = f"it needs tracelock._C, which failed to import ({_ext.ext_error()}); rebuild with {_REBUILD}"
        elif device.type != "cpu":
            why = f"its ops run on CPU tensors and the model is on {device}; use impl='cuda' or leave impl unset"
    elif requested == "cuda" and device.type != "cuda":
        why = f"its ops run on a CUDA device and the model is on {device}"
    elif requested == "cuda" and not _ext.has_cuda_ext():
        built = "was built without CUDA" if _ext.has_cpp() else f"failed to import ({_ext.ext_error()})"
        why = f"it needs tracelock._C with CUDA, but it {built}; rebuild with {_REBUILD_CUDA}"
    if why is None and requested in ("triton", "cuda"):
        state = _triton_state(device)
        if state is not None and device.type != "cuda" and "not installed" not in state:
            state = (f"Triton kernels run on a CUDA device and the model is on {device} (on a CPU only under "
                     "TRITON_INTERPRET=1, set before importing tracelock: the tests' slow interpreter)")
        why = state
    if why is not None:
        raise ValueError(f"impl={requested!r}{source} cannot run here: {why}; use impl='torch' (CLI: --impl torch), "
                         "or leave it unset for the fastest implementation that runs")


def _check_available(op: str, impl: str, device: torch.device, impls: tuple[str, ...]) -> None:
    """Raise with the fix when ``impl`` cannot run ``op`` on ``device``."""
    if impl not in impls:
        raise ValueError(f"{op} has no {impl!r} implementation; available: {', '.join(impls)}")
    if impl == "cpp":
        if not _ext.has_cpp():
            raise RuntimeError(f"impl='cpp' needs tracelock._C, which failed to import ({_ext.ext_error()}); "
                               f"rebuild with {_REBUILD}")
        if device.type != "cpu":
            raise RuntimeError(f"impl='cpp' runs on CPU tensors, got {device}; use impl='cuda' or 'torch'")
    if impl == "cuda":
        if device.type != "cuda":
            raise RuntimeError(f"impl='cuda' runs on CUDA tensors, got {device}; use impl='cpp' or 'torch'")
        if not _ext.has_cuda_ext():
            why = "was built without CUDA" if _ext.has_cpp() else f"failed to import ({_ext.ext_error()})"
            raise RuntimeError(f"impl='cuda' needs tracelock._C with CUDA, but it {why}; rebuild with {_REBUILD_CUDA}")
    if impl == "triton" and (why := _triton_state(device)) is not None:
        raise RuntimeError(f"impl='triton' cannot run {op}: {why}")


# The one dispatch table: every op's implementations, in the order the default prefers them where they can run
# (cuda: tracelock._C built with CUDA and CUDA tensors; cpp: tracelock._C and CPU tensors; triton: see
# `_triton_state`; torch: always). `fused_generate`, the engine and the public ops below all choose from it.
IMPLEMENTATIONS = {
    "apply_commits": ("cuda", "cpp", "torch"),
    "skip_finished_blocks": ("cpp", "torch"),
    "window_logits_stats": ("triton", "torch"),
    "tap_project": ("triton", "torch"),
    "commit_step": ("triton", "torch"),
    "add_rms_norm": ("triton", "torch"),
    "rope_qkv": ("triton", "torch"),
    "silu_mul": ("triton", "torch"),
    "linear_rows": ("triton", "torch"),
    "credit_fuse": ("triton", "torch"),
    "step_kl": ("triton", "torch"),
    "topk_js": ("triton", "torch"),
    "head_credit_fuse": ("triton", "torch"),
    "head_topk_js": ("triton", "torch"),
    "head_step_kl": ("triton", "torch"),
}
# what a family of `fused_generate(impl=...)` runs for an op that lacks that member: its nearest one (the kernels
# have no C++ version, the bookkeeping no Triton one, the block advance no CUDA one)
_NEAREST = {"torch": ("torch",), "cpp": ("cpp", "torch"), "triton": ("triton", "torch"),
            "cuda": ("cuda", "triton", "torch")}


def _can_run(impl: str, device: torch.device, graph: bool) -> bool:
    if impl == "cuda":
        return device.type == "cuda" and _ext.has_cuda_ext()
    if impl == "cpp":
        return device.type == "cpu" and _ext.has_cpp()
    if impl == "triton":
        # a graph (the engine) never runs the CPU interpreter: too slow for whole decodes, and not traceable
        return _triton_state(device) is None and (device.type == "cuda" or not graph)
    return True


def _pick_impl(op: str, impl: str | None, device: torch.device, *, graph: bool = False) -> str:
    """The implementation of ``op`` that runs: ``impl`` (or ``TRACELOCK_IMPL``) when given, checked, else the first
    of `IMPLEMENTATIONS` that can run on ``device``. ``graph`` (the engine: no env, no interpreter) ignores both."""
    impls = IMPLEMENTATIONS[op]
    requested = None if graph else requested_impl(impl)
    if requested is not None:
        _check_available(op, requested, device, impls)
        return requested
    return next(name for name in impls if _can_run(name, device, graph))


def family_impl(op: str, impl: str | None) -> str | None:
    """The member of `fused_generate`'s ``impl`` family (or ``TRACELOCK_IMPL``'s) that ``op`` has; None: the op's
    default."""
    requested = requested_impl(impl)
    if requested is None:
        return None
    return next(name for name in _NEAREST[requested] if name in IMPLEMENTATIONS[op])


def _raw(op: str, impl: str):
    """The implementation function itself (no input checks), for graphs."""
    if impl in ("cpp", "cuda"):
        # the same torch op; the tensors' device selects the kernel
        return getattr(torch.ops.tracelock, op)
    if impl == "triton":
        import importlib

        return getattr(importlib.import_module(f"tracelock.kernels.{op}"), f"{op}_triton")
    if op == "skip_finished_blocks":
        from tracelock.kernels.skip_finished_blocks import skip_finished_blocks_torch

        return skip_finished_blocks_torch
    from tracelock.kernels import ref

    return getattr(ref, f"{op}_ref")


def _run(op: str, impl: str | None, chosen: str, *args):
    """``op``'s ``chosen`` implementation on ``args``; a Triton kernel the default chose (no ``impl=``, no
    ``TRACELOCK_IMPL``) runs through its check (`tracelock.selfcheck`)."""
    fn = _raw(op, chosen)
    if chosen == "triton" and not (impl or os.environ.get("TRACELOCK_IMPL")):
        return selfcheck.run(op, fn, args)
    return fn(*args)


def _graph_fn(op: str, impl: str):
    """The implementation itself for a graph; a Triton kernel with its check (`tracelock.selfcheck.guarded`)."""
    fn = _raw(op, impl)
    return selfcheck.guarded(op, fn) if impl == "triton" else fn


@dataclass(frozen=True)
class OpSet:
    """The per-step ops of one decode, each bound to its implementation (``impls``: op -> name)."""

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
    impls: dict


def op_set(impl: str | None, device, *, graph: bool = False, inductor: bool = False) -> OpSet:
    """The ops a decode runs on ``device``. The eager loop (``graph=False``) gets the checked dispatchers below with
    ``impl``'s family member fixed per op; a graph (the engine) gets the implementations themselves, each op's
    default where it is traceable (no input checks, no host sync, no CPU interpreter; ``impl`` not used). A graph
    that inductor compiles (``inductor``) takes the torch bookkeeping instead of the C++/CUDA ops: inductor fuses
    it, and it scheduled reads of a custom op's in-place outputs after the op (a compiled CPU engine logged zero
    commits per step with the C++ apply_commits; torch 2.13)."""
    device = torch.device(device)
    impls, fns = {}, {}
    for op in IMPLEMENTATIONS:
        if graph:
            impls[op] = _pick_impl(op, None, device, graph=True)
            if inductor and impls[op] in ("cpp", "cuda"):
                impls[op] = "torch"
            fns[op] = _graph_fn(op, impls[op])
        else:
            chosen = family_impl(op, impl)
            impls[op] = chosen or _pick_impl(op, None, device)
            fns[op] = partial(globals()[op], impl=chosen)
    return OpSet(**fns, impls=impls)


# what a backbone forward can run per layer (`backbone_kernels`); "kernels" is the default
BACKBONES = ("kernels", "specs", "kernels+matmul")
# the Triton products stream their weight for a few rows (a decode step); a refresh's thousands of rows take cuBLAS
MATMUL_ROWS = 64


class BackboneKernels:
    """The per-layer ops a backbone forward runs (`tracelock.models.backbone.Kernels` is their spec): add_rms_norm,
    rope_qkv, silu_mul, linear (``x @ weight.T + bias``, with ``epilogues`` also its residual and SiLU x mul);
    ``impls`` says which implementation each is."""

    def __init__(self, fns: dict, epilogues: bool, impls: dict):
        self.add_rms_norm, self.rope_qkv, self.silu_mul = fns["add_rms_norm"], fns["rope_qkv"], fns["silu_mul"]
        self.linear, self.epilogues, self.impls = fns["linear"], epilogues, impls


def _cublas_linear(x, weight, bias=None, residual=None, activation=None):
    """nn.Linear's product (cuBLAS on CUDA); it takes no epilogue (``BackboneKernels.epilogues`` is False)."""
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


def backbone_kernels(device, backbone: str = "kernels", *, graph: bool = False, impl: str | None = None):
    """The per-layer ops of a backbone forward on ``device`` (`BackboneKernels`): "kernels", each op's default
    without the CPU interpreter (the Triton kernels on CUDA, the specs on a CPU) and cuBLAS's products; "specs", the
    plain-PyTorch specs (inductor fuses them in a compiled step); "kernels+matmul", also the Triton weight-streaming
    products with their epilogues (`linear_rows`). The eager loop (``graph=False``) gets checked dispatchers, with
    ``impl`` (or ``TRACELOCK_IMPL``) obeyed where given; a graph gets the implementations themselves."""
    if backbone not in BACKBONES:
        raise ValueError(f"backbone={backbone!r} must be one of {', '.join(BACKBONES)}")
    device = torch.device(device)
    ops = ["add_rms_norm", "rope_qkv", "silu_mul"] + (["linear_rows"] if backbone == "kernels+matmul" else [])
    fns, impls = {}, {}
    for op in ops:
        chosen = None if graph or backbone == "specs" else family_impl(op, impl)
        impls[op] = "torch" if backbone == "specs" else chosen or _pick_impl(op, None, device, graph=True)
        # the eager loop's default Triton kernels go through the dispatcher unnamed, so they are checked
        eager_impl = None if impls[op] == "triton" and chosen is None else impls[op]
        fns[op] = _graph_fn(op, impls[op]) if graph else partial(globals()[op], impl=eager_impl)
    epilogues = backbone == "kernels+matmul"
    fns["linear"] = _rows_linear(fns["linear_rows"]) if epilogues else _cublas_linear
    return BackboneKernels(fns, epilogues, impls)


def _check_tensor(name: str, t, dtype: torch.dtype, shape: tuple | None = None, device=None) -> None:
    """Check one argument; ``shape`` and ``device`` (those of x) are compared only when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)} like x, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like x, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def apply_commits(
    x: torch.Tensor,
    state: torch.Tensor,
    proposal: torch.Tensor,
    commit: torch.Tensor,
    end_ids: torch.Tensor,
    fill_id: int,
    stop_at_eot: bool,
    *,
    impl: str | None = None,
) -> torch.Tensor:
    """Apply one decode step's commits to the canvas, in place (spec: ``tracelock.kernels.ref.apply_commits_ref``).

    Committed ACTIVE positions take their proposal and become LOCKED, or EOT for an end token; with
    ``stop_at_eot`` the still-active tail after a row's first EOT becomes EOT filled with ``fill_id``.

    Args:
        x (torch.Tensor): [B, L] int64 canvas tokens. Modified in place.
        state (torch.Tensor): [B, L] uint8 position states (``tracelock.states``). Modified in place.
        proposal (torch.Tensor): [B, L] int64 proposed tokens.
        commit (torch.Tensor): [B, L] bool positions chosen by the policy; ignored where not ACTIVE.
        end_ids (torch.Tensor): [E] int64 end tokens (eos and end-of-turn); E may be 0.
        fill_id (int): pad token written after the first EOT under ``stop_at_eot``.
        stop_at_eot (bool): fill the still-active tail of a row once it holds an EOT.
        impl (str, optional): "torch", "cpp" or "cuda". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        first_active (torch.Tensor): [B] int64 index of the first ACTIVE position per row, or L if none.
    """
    _check_tensor("x", x, torch.int64)
    if x.dim() != 2:
        raise ValueError(f"x must be [B, L], got shape {list(x.shape)}")
    shape, device = tuple(x.shape), x.device
    _check_tensor("state", state, torch.uint8, shape, device)
    _check_tensor("proposal", proposal, torch.int64, shape, device)
    _check_tensor("commit", commit, torch.bool, shape, device)
    _check_tensor("end_ids", end_ids, torch.int64, device=device)
    if end_ids.dim() != 1:
        raise ValueError(f"end_ids must be 1-D [E], got shape {list(end_ids.shape)}")
    chosen = _pick_impl("apply_commits", impl, device)
    return _raw("apply_commits", chosen)(x, state, proposal, commit, end_ids, int(fill_id), bool(stop_at_eot))


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def skip_finished_blocks(state, block_idx, region_step, region_initial, steps, rows, prompt_len: int, block: int,
                         num_regions: int, steps_per_block: int, idle_steps: bool, *, impl: str | None = None) -> None:
    """Move the selected rows past their finished semi-AR blocks, in place (spec:
    ``tracelock.kernels.ref.skip_finished_blocks_ref``): the block schedule's per-step advance.

    Args:
        state (torch.Tensor): [B, L] uint8 position states.
        block_idx, region_step, region_initial (torch.Tensor): [B] int64 row counters. Modified in place.
        steps (torch.Tensor): [B] int64 forwards spent on each row.
        rows (torch.Tensor): [B] bool rows to advance.
        prompt_len, block, num_regions, steps_per_block (int), idle_steps (bool): the schedule.
        impl (str, optional): "torch" (the spec without its loop and host sync, `kernels/skip_finished_blocks.py`)
            or "cpp" (CPU). Default: ``TRACELOCK_IMPL``, else the fastest available.
    """
    _check_tensor("state", state, torch.uint8)
    if state.dim() != 2:
        raise ValueError(f"state must be [B, L], got shape {list(state.shape)}")
    device, rows_shape = state.device, (state.shape[0],)
    for name, t in (("block_idx", block_idx), ("region_step", region_step), ("region_initial", region_initial),
                    ("steps", steps)):
        _check_tensor(name, t, torch.int64, rows_shape, device)
    _check_tensor("rows", rows, torch.bool, rows_shape, device)
    args = (state, block_idx, region_step, region_initial, steps, rows, int(prompt_len), int(block),
            int(num_regions), int(steps_per_block), bool(idle_steps))
    return _run("skip_finished_blocks", impl, _pick_impl("skip_finished_blocks", impl, device), *args)


def _check_arg(name: str, t, dtypes: tuple, shape: tuple | None = None, like: tuple | None = None,
               strided_rows: bool = False) -> None:
    """Check one argument of the kernel ops: type, dtype, then ``shape`` and the device of ``like`` (a pair
    ``(name, tensor)`` of the argument that sets the device) when given. ``strided_rows`` accepts a tensor whose
    rows (last dimension) are strided (a view into a wider buffer, a broadcast) as long as each row is contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if like is not None and t.device != like[1].device:
        raise ValueError(f"{name} must be on {like[1].device} like {like[0]}, got {t.device}")
    if strided_rows and t.dim() >= 1 and (t.stride(-1) == 1 or t.shape[-1] <= 1):
        return
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _check_dims(name: str, t: torch.Tensor, dims: str) -> None:
    if t.dim() != dims.count(",") + 1:
        raise ValueError(f"{name} must be {dims}, got shape {list(t.shape)}")


def tap_project(h1: torch.Tensor, h2: torch.Tensor, h3: torch.Tensor, A: torch.Tensor, c: torch.Tensor, *,
                impl: str | None = None) -> torch.Tensor:
    """Fold the three hidden-state taps into controller inputs in one pass (spec: ``tap_project_ref``).

    ``out = h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c`` in fp32 from upcast inputs; with ``A`` holding the encoders'
    folded code matrices the same call writes the trace codes, without materialising deltas or codes.

    Args:
        h1, h2, h3 (torch.Tensor): [T, D] taps, fp32, fp16 or bf16; rows may be strided, each row contiguous.
        A (torch.Tensor): [3, D, N] folded weights, fp32; in the taps' 16-bit dtype for the tensor-core path on GPU.
        c (torch.Tensor): [N] bias, any float dtype above.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        out (torch.Tensor): [T, N] fp32.
    """
    _check_arg("h1", h1, _FLOATS, strided_rows=True)
    _check_dims("h1", h1, "[T, D]")
    like = ("h1", h1)
    _check_arg("h2", h2, _FLOATS, h1.shape, like, strided_rows=True)
    _check_arg("h3", h3, _FLOATS, h1.shape, like, strided_rows=True)
    _check_arg("A", A, _FLOATS, like=like)
    if A.dim() != 3 or A.shape[0] != 3 or A.shape[1] != h1.shape[1]:
        raise ValueError(f"A must be [3, D, N] with D = {h1.shape[1]} (the taps' width), got shape {list(A.shape)}")
    _check_arg("c", c, _FLOATS, (A.shape[2],), like)
    return _run("tap_project", impl, _pick_impl("tap_project", impl, h1.device), h1, h2, h3, A, c)


def window_logits_stats(hidden: torch.Tensor, weight: torch.Tensor, eos_id: int | None, *,
                        impl: str | None = None) -> tuple:
    """The LM head on the window's rows plus their greedy signals, in one online-softmax pass over the vocabulary
    (spec: ``window_logits_stats_ref``; the same values as ``tracelock.signals.compute_signals`` at T = 0).
    The Triton path never writes the [R, V] logits.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the rows, fp32, fp16 or bf16; rows may be
            strided (each row contiguous).
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16 (the hidden dtype for the tensor-core path).
        eos_id (int, optional): token whose probability goes into ``eos_prob``; None gives zeros.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (proposal [R] int64 argmax (ties to the lowest index), max_prob [R], second_prob [R] (margin =
        max_prob - second_prob), neg_entropy [R] (sum p log p), eos_prob [R]), the last four fp32.
    """
    _check_arg("hidden", hidden, _FLOATS, strided_rows=True)
    _check_dims("hidden", hidden, "[R, D]")
    _check_arg("weight", weight, _FLOATS, like=("hidden", hidden))
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V, D] with V >= 1 and D = {hidden.shape[1]} (hidden's width), "
                         f"got shape {list(weight.shape)}")
    V = weight.shape[0]
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < V):
        raise ValueError(f"eos_id must be None or an int in [0, {V}) (the vocabulary), got {eos_id!r}")
    chosen = _pick_impl("window_logits_stats", impl, hidden.device)
    return _run("window_logits_stats", impl, chosen, hidden, weight, eos_id)


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
    _check_arg("x", x, _FLOATS, strided_rows=True)
    _check_dims("x", x, "[M, D]")
    M, D = x.shape
    if D == 0:
        raise ValueError(f"x must be [M, D] with D >= 1 columns to normalise, got shape {list(x.shape)}")
    like = ("x", x)
    if residual is not None:
        _check_arg("residual", residual, (x.dtype,), (M, D), like, strided_rows=True)
    _check_arg("weight", weight, _FLOATS, (D,), like)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0 (the norm's epsilon, e.g. 1e-5), got {eps!r}")
    chosen = _pick_impl("add_rms_norm", impl, x.device)
    if chosen == "triton" and D > MAX_NORM_WIDTH:
        raise ValueError(f"x has D = {D} columns; the Triton add_rms_norm holds a row in registers, at most "
                         f"{MAX_NORM_WIDTH}: use impl='torch'")
    return _run("add_rms_norm", impl, chosen, x, residual, weight, float(eps))


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
    _check_arg("qkv", qkv, _FLOATS, strided_rows=True)
    _check_dims("qkv", qkv, "[B, Q, (n_heads + 2 n_kv) head_dim]")
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
    _check_arg("cos", cos, (torch.float32,), (B, Q, head_dim), like, strided_rows=True)
    _check_arg("sin", sin, (torch.float32,), (B, Q, head_dim), like, strided_rows=True)
    if not isinstance(rope_fp32, bool):
        raise TypeError(f"rope_fp32 must be a bool, got {rope_fp32!r}")
    given = [name for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("index", index)) if t is not None]
    if given and len(given) < 3:
        raise ValueError(f"k_cache, v_cache and index go together (a cached step writes its keys and values at "
                         f"index); got only {', '.join(given)}")
    if given:
        _check_arg("k_cache", k_cache, (qkv.dtype,), like=like, strided_rows=True)
        if k_cache.dim() != 4 or tuple(k_cache.shape[:2]) != (B, n_kv) or k_cache.shape[3] != head_dim or \
                k_cache.shape[2] == 0:
            raise ValueError(f"k_cache must be [B, n_kv, Lc, head_dim] = [{B}, {n_kv}, Lc >= 1, {head_dim}], got "
                             f"shape {list(k_cache.shape)}")
        _check_arg("v_cache", v_cache, (qkv.dtype,), tuple(k_cache.shape), like, strided_rows=True)
        _check_arg("index", index, (torch.int64,), (B, Q), like, strided_rows=True)
        _check_index_range(index, k_cache.shape[2])
    return _run("rope_qkv", impl, _pick_impl("rope_qkv", impl, qkv.device), qkv, cos, sin, n_heads, n_kv, head_dim,
                rope_fp32, k_cache, v_cache, index)


def _check_index_range(index: torch.Tensor, Lc: int) -> None:
    """Cache positions outside [0, Lc) are an error, checked on a CPU only (on a GPU it would cost a host sync per
    layer) and not inside a compiled graph (which cannot read the tensor)."""
    if index.is_cuda or torch.compiler.is_compiling() or index.numel() == 0:
        return
    if bool(((index < 0) | (index >= Lc)).any()):
        bad = index[(index < 0) | (index >= Lc)][0].item()
        raise ValueError(f"index holds cache position {bad}, outside [0, {Lc}) (the caches' length): the rows' "
                         "canvas positions must lie in the cache")


def silu_mul(gate_up: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """SwiGLU's elementwise half in one pass (spec: ``silu_mul_ref``): ``silu(gate) * up`` in the dtype, from the
    fused gate/up projection's output, gate columns first.

    Args:
        gate_up (torch.Tensor): [M, 2F], fp32, fp16 or bf16; rows may be strided (each row contiguous).
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        out (torch.Tensor): [M, F] contiguous, gate_up's dtype.
    """
    _check_arg("gate_up", gate_up, _FLOATS, strided_rows=True)
    _check_dims("gate_up", gate_up, "[M, 2F]")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [M, 2F] (gate columns, then as many up columns), got an odd width "
                         f"{gate_up.shape[1]}")
    return _run("silu_mul", impl, _pick_impl("silu_mul", impl, gate_up.device), gate_up)


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
    _check_arg("x", x, _FLOATS, strided_rows=True)
    _check_dims("x", x, "[M, K]")
    M, K = x.shape
    like = ("x", x)
    _check_arg("weight", weight, _FLOATS, like=like)
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
        _check_arg("bias", bias, _FLOATS, (N,), like)
    if residual is not None:
        _check_arg("residual", residual, _FLOATS, (M, N // 2 if activation == "silu_mul" else N), like,
                   strided_rows=True)
    return _run("linear_rows", impl, _pick_impl("linear_rows", impl, x.device), x, weight, bias, residual, activation)


def _check_commit_step_args(score, tau, active, proposal, positions, x, state, end_ids, theta, cap, fallback_score,
                            held, inclusive, fill_id, stop_at_eot) -> None:
    """`commit_step`'s argument checks: each names the argument and what it must be."""
    from tracelock.kernels.ref import commit_margin_threshold

    _check_arg("x", x, (torch.int64,))
    _check_dims("x", x, "[B, L]")
    _check_arg("score", score, _FLOATS, like=("x", x))
    _check_dims("score", score, "[B, R]")
    B, L = x.shape
    R = score.shape[1]
    if score.shape[0] != B or R == 0 or L == 0:
        raise ValueError(f"score must be [B, R] with B = {B} (x's rows) and R >= 1, and x must have L >= 1 "
                         f"positions; got score {list(score.shape)}, x {list(x.shape)}")
    like = ("x", x)
    _check_arg("tau", tau, _FLOATS, (B,), like)
    _check_arg("active", active, (torch.bool,), (B, R), like)
    _check_arg("proposal", proposal, (torch.int64,), (B, R), like)
    _check_arg("positions", positions, (torch.int64,), (B, R), like)
    _check_arg("state", state, (torch.uint8,), (B, L), like)
    _check_arg("end_ids", end_ids, (torch.int64,), like=like)
    _check_dims("end_ids", end_ids, "[E]")
    if fallback_score is not None:
        _check_arg("fallback_score", fallback_score, _FLOATS, (B, R), like)
    if held is not None:
        _check_arg("held", held, (torch.bool,), (B, R), like)
    commit_margin_threshold(theta)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"cap must be an int >= 0 (0 = no cap), got {cap!r}")
    for name, value in (("inclusive", inclusive), ("stop_at_eot", stop_at_eot)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if isinstance(fill_id, bool) or not isinstance(fill_id, int):
        raise TypeError(f"fill_id must be an int token id, got {fill_id!r}")


def commit_step(
    score: torch.Tensor,
    tau: torch.Tensor,
    active: torch.Tensor,
    proposal: torch.Tensor,
    positions: torch.Tensor,
    x: torch.Tensor,
    state: torch.Tensor,
    end_ids: torch.Tensor,
    theta: float,
    cap: int = 0,
    *,
    fallback_score: torch.Tensor | None = None,
    held: torch.Tensor | None = None,
    inclusive: bool = False,
    fill_id: int = 0,
    stop_at_eot: bool = False,
    impl: str | None = None,
) -> tuple:
    """The commit rule of one step over the window's slots, in place on the canvas (spec: ``commit_step_ref``, its
    selection ``commit_select_ref``).

    Margin ``m = score - tau``, ``p = sigmoid(m)``: live slots (active, ACTIVE on the canvas, not held) with
    ``p > theta`` (``>=`` with ``inclusive``) commit, at most ``cap`` of them by descending ``p`` (ties to the lowest
    slot); when none passes, the live slot of highest ``fallback_score`` commits (the margin when None). Committed
    positions take their proposal and become EOT (an end token) or LOCKED; with ``stop_at_eot`` a row's still-active
    tail after its first EOT becomes EOT filled with ``fill_id``. No host sync on the device; outside a graph a NaN
    score, tau or fallback score at an active slot is an error (the spec's rule, that NaN never commits, is what a
    graph gets).

    Args:
        score (torch.Tensor): [B, R] controller score at the slots, fp32 (fp16/bf16 upcast).
        tau (torch.Tensor): [B] per-row threshold, fp32 (fp16/bf16 upcast).
        active (torch.Tensor): [B, R] bool slots that may commit.
        proposal (torch.Tensor): [B, R] int64 proposed tokens.
        positions (torch.Tensor): [B, R] int64 canvas positions of the slots (distinct among live slots).
        x (torch.Tensor): [B, L] int64 canvas tokens. Modified in place.
        state (torch.Tensor): [B, L] uint8 position states. Modified in place.
        end_ids (torch.Tensor): [E] int64 end tokens; E may be 0.
        theta (float): commit threshold on ``p``, in [0, 1]. The paper's default is 0.95.
        cap (int): most commits per row and step; 0 = no cap. Default: 0.
        fallback_score (torch.Tensor, optional): [B, R] what the fallback maximises, fp32 (fp16/bf16 upcast): the
            backbone's confidence or neg-entropy for the shipped rule. Default: None (the margin: the paper's rule).
        held (torch.Tensor, optional): [B, R] bool slots held this step (``hold_end``). Default: None.
        inclusive (bool): ``p >= theta``, the reference release's rule. Default: False.
        fill_id (int): the pad token of the tail fill. Default: 0.
        stop_at_eot (bool): fill a row's still-active tail after its first EOT. Default: False.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (first_active [B] int64, the first ACTIVE position per row or L; committed [B] int64, slots committed).
    """
    _check_commit_step_args(score, tau, active, proposal, positions, x, state, end_ids, theta, cap, fallback_score,
                            held, inclusive, fill_id, stop_at_eot)
    B, R = score.shape
    _check_no_nan(active, score=score, tau=tau[:, None].expand(B, R), fallback_score=fallback_score)
    chosen = _pick_impl("commit_step", impl, x.device)
    return _run("commit_step", impl, chosen, score, tau, active, proposal, positions, x, state, end_ids,
                float(theta), cap, fallback_score, held, inclusive, fill_id, stop_at_eot)


def _check_no_nan(active: torch.Tensor, **scores) -> None:
    """A NaN score at an active slot is an error that names it; skipped inside a compiled graph or a CUDA graph
    capture, which cannot read the device (there the spec's rule holds: NaN never commits)."""
    if torch.compiler.is_compiling() or (active.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    for name, t in scores.items():
        if t is not None and bool((t.isnan() & active).any()):
            raise ValueError(f"{name} is NaN at an active slot: the scores that decide a commit must be numbers "
                             "(a NaN usually means the model or the controller overflowed in its dtype; try float32 "
                             "or bfloat16)")


# ---- the vocabulary-wide passes of the rules that remember across steps (credit, klass, less)

# the Triton topk_js keeps the running top-K and a [K, K] comparison tile in registers
MAX_TOPK = 64


def _check_logits(logits: torch.Tensor) -> tuple:
    """[N, V] logits of any float dtype, V >= 1, rows may be strided (each row contiguous); returns (N, V)."""
    _check_arg("logits", logits, _FLOATS + (torch.float64,), strided_rows=True)
    _check_dims("logits", logits, "[N, V]")
    if logits.shape[1] == 0:
        raise ValueError(f"logits must be [N, V] with V >= 1 (the vocabulary), got shape {list(logits.shape)}")
    return tuple(logits.shape)


def _check_finite(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < float("inf"):
            raise ValueError(f"{name} must be a finite number, got {value!r}")


def credit_fuse(logits: torch.Tensor, credit: torch.Tensor, boost: torch.Tensor, fresh: torch.Tensor, alpha: float,
                gamma: float, beta: float, *, impl: str | None = None) -> tuple:
    """CreditDecoding's step (spec: ``credit_fuse_ref``): decay (or, ``fresh``, restart) each slot's credit, add
    ``p1 ** gamma`` at its top-1 token where ``boost``, and score ``logits + alpha * log(credit + 1)``. The Triton
    path reads a row's logits twice in one launch and writes neither softmax nor fused logits.

    Args:
        logits (torch.Tensor): [N, V] the slots' logits, fp32, fp16, bf16 or fp64; rows may be strided (each row
            contiguous).
        credit (torch.Tensor): [N, V] fp32 credit, contiguous. Updated in place.
        boost, fresh (torch.Tensor): [N] bool: the slot is masked (its top-1 gains credit); its credit restarts.
        alpha, gamma, beta (float): the fusion weight, the boost exponent, the decay (finite numbers).
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (proposal [N] int64 argmax of the fused logits, confidence [N] fp32 its fused probability).
    """
    N, V = _check_logits(logits)
    like = ("logits", logits)
    _check_arg("credit", credit, (torch.float32,), (N, V), like)
    _check_arg("boost", boost, (torch.bool,), (N,), like)
    _check_arg("fresh", fresh, (torch.bool,), (N,), like)
    _check_finite(alpha=alpha, gamma=gamma, beta=beta)
    return _run("credit_fuse", impl, _pick_impl("credit_fuse", impl, logits.device), logits, credit, boost, fresh,
                float(alpha), float(gamma), float(beta))


def step_kl(logits: torch.Tensor, prev: torch.Tensor, *, impl: str | None = None) -> tuple:
    """KLASS's step (spec: ``step_kl_ref``): each slot's softmax, its KL against ``prev`` (zeros for a slot with no
    previous pass), and ``prev`` overwritten with it. The Triton path computes in prev's dtype (fp32 on a GPU).

    Args:
        logits (torch.Tensor): [N, V] the slots' logits, fp32, fp16, bf16 or fp64; rows may be strided (each row
            contiguous).
        prev (torch.Tensor): [N, V] fp32 or fp64 previous distribution, contiguous. Updated in place.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (proposal [N] int64 argmax, confidence [N] max probability, kl [N]), the last two in prev's dtype.
    """
    N, V = _check_logits(logits)
    _check_arg("prev", prev, (torch.float32, torch.float64), (N, V), ("logits", logits))
    return _run("step_kl", impl, _pick_impl("step_kl", impl, logits.device), logits, prev)


def topk_js(logits: torch.Tensor, prev_ids: torch.Tensor, prev_probs: torch.Tensor, has_prev: torch.Tensor, *,
            impl: str | None = None) -> tuple:
    """LESS's drift (spec: ``topk_js_ref``): each slot's top-K distribution (plus a rest bucket) and its
    Jensen-Shannon divergence from the previous step's; 1 for a slot without a previous pass. The Triton path reads
    a row's logits once.

    Args:
        logits (torch.Tensor): [N, V] the slots' logits, fp32, fp16, bf16 or fp64; rows may be strided (each row
            contiguous).
        prev_ids (torch.Tensor): [N, K] int64 the previous top-K ids, 1 <= K <= V (at most `MAX_TOPK` for Triton).
        prev_probs (torch.Tensor): [N, K] fp32 their probabilities.
        has_prev (torch.Tensor): [N] bool, the slot had a previous pass.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (ids [N, K] int64 descending (ties to the lowest index), probs [N, K] fp32, js [N] fp32).
    """
    N, V = _check_logits(logits)
    _check_topk_memory(prev_ids, prev_probs, has_prev, ("logits", logits), f"[N, K] with N = {N} (logits' rows) and "
                       f"1 <= K <= V = {V}", N, V)
    chosen = _pick_impl("topk_js", impl, logits.device)
    _check_topk_limit("topk_js", chosen, prev_ids)
    return _run("topk_js", impl, chosen, logits, prev_ids, prev_probs, has_prev)


def _check_topk_memory(prev_ids, prev_probs, has_prev, like: tuple, shape_text: str, rows: int, V: int) -> None:
    """LESS's memory: [rows, K] int64 ids (1 <= K <= V), their [rows, K] fp32 probabilities, [rows] bool has_prev."""
    _check_arg("prev_ids", prev_ids, (torch.int64,), like=like)
    if prev_ids.dim() != 2 or prev_ids.shape[0] != rows or not 1 <= prev_ids.shape[1] <= V:
        raise ValueError(f"prev_ids must be {shape_text}, got shape {list(prev_ids.shape)}")
    _check_arg("prev_probs", prev_probs, (torch.float32,), tuple(prev_ids.shape), like)
    _check_arg("has_prev", has_prev, (torch.bool,), (rows,), like)


def _check_topk_limit(op: str, chosen: str, prev_ids: torch.Tensor) -> None:
    """The Triton top-K kernels keep the top-K in registers: at most `MAX_TOPK`."""
    if chosen == "triton" and prev_ids.shape[1] > MAX_TOPK:
        raise ValueError(f"prev_ids has K = {prev_ids.shape[1]}; the Triton {op} keeps the top-K in registers, at "
                         f"most {MAX_TOPK}: use impl='torch'")


# ---- the same passes fused into the LM head: hidden rows and the head weight in place of the logits


def _check_head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple:
    """[R, D] hidden rows (strided rows allowed) and a contiguous [V, D] head weight, V >= 1; returns (R, V)."""
    _check_arg("hidden", hidden, _FLOATS, strided_rows=True)
    _check_dims("hidden", hidden, "[R, D]")
    _check_arg("weight", weight, _FLOATS, like=("hidden", hidden))
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V, D] with V >= 1 and D = {hidden.shape[1]} (hidden's width), "
                         f"got shape {list(weight.shape)}")
    return hidden.shape[0], weight.shape[0]


def head_credit_fuse(hidden: torch.Tensor, weight: torch.Tensor, credit: torch.Tensor, boost: torch.Tensor,
                     fresh: torch.Tensor, alpha: float, gamma: float, beta: float, *, impl: str | None = None) -> tuple:
    """`credit_fuse` on the LM head's logits ``hidden @ weight.T`` (spec: ``head_credit_fuse_ref``). The Triton path
    computes the head tile by tile over splits of the vocabulary and never writes the [R, V] logits.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the slots, fp32, fp16 or bf16; rows may be
            strided (each row contiguous).
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16 (the hidden dtype for the tensor-core path).
        credit (torch.Tensor): [R, V] fp32 credit, contiguous. Updated in place.
        boost, fresh (torch.Tensor): [R] bool: the slot is masked (its top-1 gains credit); its credit restarts.
        alpha, gamma, beta (float): the fusion weight, the boost exponent, the decay (finite numbers).
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (proposal [R] int64 argmax of the fused logits, confidence [R] fp32 its fused probability).
    """
    R, V = _check_head(hidden, weight)
    like = ("hidden", hidden)
    _check_arg("credit", credit, (torch.float32,), (R, V), like)
    _check_arg("boost", boost, (torch.bool,), (R,), like)
    _check_arg("fresh", fresh, (torch.bool,), (R,), like)
    _check_finite(alpha=alpha, gamma=gamma, beta=beta)
    return _run("head_credit_fuse", impl, _pick_impl("head_credit_fuse", impl, hidden.device), hidden, weight, credit,
                boost, fresh, float(alpha), float(gamma), float(beta))


def head_topk_js(hidden: torch.Tensor, weight: torch.Tensor, prev_ids: torch.Tensor, prev_probs: torch.Tensor,
                 has_prev: torch.Tensor, *, impl: str | None = None) -> tuple:
    """`topk_js` on the LM head's logits ``hidden @ weight.T`` (spec: ``head_topk_js_ref``). The Triton path computes
    the head tile by tile over splits of the vocabulary and never writes the [R, V] logits.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the slots, fp32, fp16 or bf16; rows may be
            strided (each row contiguous).
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16 (the hidden dtype for the tensor-core path).
        prev_ids (torch.Tensor): [R, K] int64 the previous top-K ids, 1 <= K <= V (at most `MAX_TOPK` for Triton).
        prev_probs (torch.Tensor): [R, K] fp32 their probabilities.
        has_prev (torch.Tensor): [R] bool, the slot had a previous pass.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (ids [R, K] int64 descending (ties to the lowest index), probs [R, K] fp32, js [R] fp32).
    """
    R, V = _check_head(hidden, weight)
    _check_topk_memory(prev_ids, prev_probs, has_prev, ("hidden", hidden), f"[R, K] with R = {R} (hidden's rows) and "
                       f"1 <= K <= V = {V} (weight's rows)", R, V)
    chosen = _pick_impl("head_topk_js", impl, hidden.device)
    _check_topk_limit("head_topk_js", chosen, prev_ids)
    return _run("head_topk_js", impl, chosen, hidden, weight, prev_ids, prev_probs, has_prev)


def head_step_kl(hidden: torch.Tensor, weight: torch.Tensor, prev_logits: torch.Tensor, prev_lse: torch.Tensor, *,
                 impl: str | None = None) -> tuple:
    """KLASS's step on the LM head's logits ``hidden @ weight.T`` with the memory kept as the previous step's logits
    and their logsumexp (spec: ``head_step_kl_ref``; ``step_kl`` within V·1e-12). The Triton path computes the head
    tile by tile over splits of the vocabulary and writes no distribution, only this step's logits into the memory.

    Args:
        hidden (torch.Tensor): [R, D] final-normed hidden states of the slots, fp32, fp16 or bf16; rows may be
            strided (each row contiguous).
        weight (torch.Tensor): [V, D] LM-head weight, fp32, fp16 or bf16 (the hidden dtype for the tensor-core path).
        prev_logits (torch.Tensor): [R, V] fp32 the previous step's logits, contiguous. Overwritten in place.
        prev_lse (torch.Tensor): [R] fp32 their logsumexp, +inf for a slot with no previous pass (its logits are not
            read). Overwritten in place.
        impl (str, optional): "torch" or "triton". Default: ``TRACELOCK_IMPL``, else the fastest available.

    Returns:
        (proposal [R] int64 argmax, confidence [R] fp32 max probability, kl [R] fp32).
    """
    R, V = _check_head(hidden, weight)
    like = ("hidden", hidden)
    _check_arg("prev_logits", prev_logits, (torch.float32,), (R, V), like)
    _check_arg("prev_lse", prev_lse, (torch.float32,), (R,), like)
    return _run("head_step_kl", impl, _pick_impl("head_step_kl", impl, hidden.device), hidden, weight, prev_logits,
                prev_lse)
