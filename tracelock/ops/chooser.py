"""The one chooser: which implementation of an op runs, from the one table `IMPLEMENTATIONS`.

``pick`` names it (what a direct call of a checked op runs); ``choose`` binds it for a whole decode, in one of the
`MODES` an op set is built in (`tracelock.ops.op_set`). Order: explicit ``impl=`` > ``TRACELOCK_IMPL`` > "cuda" when
``tracelock._C`` has CUDA and the tensors are on CUDA > "cpp" when ``tracelock._C`` imported and the tensors are on
CPU > "triton" when triton is installed and the tensors are on CUDA or ``TRITON_INTERPRET=1`` was set before importing
tracelock > "torch" (the ``*_ref`` spec). An explicit or environment choice is obeyed or fails with the fix; it never
silently falls back.
"""

import importlib
import os
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from tracelock import _ext, selfcheck

IMPLS = ("torch", "triton", "cpp", "cuda")
_REBUILD = "`pip install -e . --no-build-isolation` (with a C++ compiler, TRACELOCK_BUILD_EXT unset)"
_REBUILD_CUDA = "`TRACELOCK_BUILD_CUDA=1 pip install -e . --no-build-isolation`"

# The one table: every op's implementations, in the order the default prefers them where they can run. Adding a
# kernel: its spec in kernels/ref.py, its kernel in kernels/<op>.py, its checked function in tracelock/ops/, one entry.
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
# the ops a backbone forward runs once per layer: in a whole decode their default never runs the CPU interpreter
PER_LAYER = ("add_rms_norm", "rope_qkv", "silu_mul", "linear_rows")
# what a family of `fused_generate(impl=...)` runs for an op that lacks that member: its nearest one (the kernels
# have no C++ version, the bookkeeping no Triton one, the block advance no CUDA one)
_NEAREST = {"torch": ("torch",), "cpp": ("cpp", "torch"), "triton": ("triton", "torch"),
            "cuda": ("cuda", "triton", "torch")}
# eager: the checked dispatchers (the loop); graph: the implementations themselves, traceable (the engine);
# inductor: a graph whose bookkeeping inductor fuses; specs: the plain-PyTorch specs (the reference)
MODES = ("eager", "graph", "inductor", "specs")


class Choice(NamedTuple):
    name: str  # the implementation: one of IMPLS
    fn: Callable


def requested_impl(impl: str | None) -> str | None:
    """``impl``, else ``TRACELOCK_IMPL``, else None; an unknown name is an error that lists the known ones."""
    impl = impl or os.environ.get("TRACELOCK_IMPL") or None
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r} (from impl= or TRACELOCK_IMPL); known impls: {', '.join(IMPLS)}")
    return impl


def _triton_state(device: torch.device) -> str | None:
    """None when Triton can run on ``device``, else why not."""
    from tracelock import _triton

    if not _triton.triton_available:
        return "triton is not installed; `pip install triton==3.7.1` (Linux)"
    if device.type != "cuda" and not _triton.triton_interpret:
        return (f"it runs on CUDA tensors, or on CPU under the interpreter, got {device} without TRITON_INTERPRET=1 "
                "(set it before importing tracelock: the tests' slow interpreter)")
    return None


def why_not(impl: str, device) -> str | None:
    """None when implementation ``impl`` can run on ``device``, else why not, with the fix."""
    device = torch.device(device)
    if impl == "cpp":
        if not _ext.has_cpp():
            return f"it needs tracelock._C, which failed to import ({_ext.ext_error()}); rebuild with {_REBUILD}"
        if device.type != "cpu":
            return f"its ops run on CPU tensors, got {device}; use impl='cuda' or leave impl unset"
    if impl == "cuda":
        if device.type != "cuda":
            return f"its ops run on a CUDA device (CUDA tensors), got {device}"
        if not _ext.has_cuda_ext():
            built = "was built without CUDA" if _ext.has_cpp() else f"failed to import ({_ext.ext_error()})"
            return f"it needs tracelock._C with CUDA, but it {built}; rebuild with {_REBUILD_CUDA}"
    if impl == "triton":
        return _triton_state(device)
    return None


def check_impl(impl: str | None, device) -> None:
    """``impl`` (or ``TRACELOCK_IMPL``) as `fused_generate` takes it, a family of op implementations: an error
    naming it and the fix when it cannot run on ``device``, before any decoding starts."""
    requested = requested_impl(impl)
    if requested in (None, "torch"):
        return
    why = why_not(requested, device)
    if why is None and requested == "cuda":  # the cuda family scores with the Triton kernels
        why = _triton_state(torch.device(device))
    if why is None:
        return
    source = "" if impl else " (from TRACELOCK_IMPL)"
    raise ValueError(f"impl={requested!r}{source} cannot run here: {why}; use impl='torch' (CLI: --impl torch), "
                     "or leave it unset for the fastest implementation that runs")


def _can_run(impl: str, device: torch.device, graph: bool) -> bool:
    # a graph never runs the CPU interpreter: too slow for whole decodes, and not traceable
    return why_not(impl, device) is None and not (impl == "triton" and graph and device.type != "cuda")


def pick(op: str, impl: str | None, device, *, graph: bool = False) -> str:
    """The implementation of ``op`` that runs: ``impl`` (or ``TRACELOCK_IMPL``) when given, checked, else the first
    of `IMPLEMENTATIONS` that can run on ``device``. ``graph`` (the engine: no env, no interpreter) ignores both."""
    impls, device = IMPLEMENTATIONS[op], torch.device(device)
    requested = None if graph else requested_impl(impl)
    if requested is None:
        return next(name for name in impls if _can_run(name, device, graph))
    if requested not in impls:
        raise ValueError(f"{op} has no {requested!r} implementation; available: {', '.join(impls)}")
    if (why := why_not(requested, device)) is not None:
        raise RuntimeError(f"impl={requested!r} cannot run {op}: {why}; use impl='torch'")
    return requested


def family_member(op: str, impl: str | None) -> str | None:
    """The member of `fused_generate`'s ``impl`` family (or ``TRACELOCK_IMPL``'s) that ``op`` has; None: the op's
    default."""
    requested = requested_impl(impl)
    if requested is None:
        return None
    return next(name for name in _NEAREST[requested] if name in IMPLEMENTATIONS[op])


def implementation(op: str, impl: str):
    """The implementation function itself (no input checks)."""
    if impl in ("cpp", "cuda"):
        # the same torch op; the tensors' device selects the kernel
        return getattr(torch.ops.tracelock, op)
    if impl == "triton":
        return getattr(importlib.import_module(f"tracelock.kernels.{op}"), f"{op}_triton")
    if op == "skip_finished_blocks":  # the spec without its loop and host sync
        from tracelock.kernels.skip_finished_blocks import skip_finished_blocks_torch

        return skip_finished_blocks_torch
    return spec(op)


def spec(op: str):
    """``op``'s plain-PyTorch spec, ``kernels.ref.<op>_ref``."""
    from tracelock.kernels import ref

    return getattr(ref, f"{op}_ref")


def graph_fn(op: str, impl: str):
    """The implementation itself for a graph; a Triton kernel with its check (`tracelock.selfcheck.guarded`)."""
    fn = implementation(op, impl)
    return selfcheck.guarded(op, fn) if impl == "triton" else fn


def call(op: str, impl: str | None, chosen: str, *args):
    """``op``'s ``chosen`` implementation on ``args``; a Triton kernel the default chose (no ``impl=``, no
    ``TRACELOCK_IMPL``) runs through its check (`tracelock.selfcheck`)."""
    fn = implementation(op, chosen)
    if chosen == "triton" and not (impl or os.environ.get("TRACELOCK_IMPL")):
        return selfcheck.run(op, fn, args)
    return fn(*args)


def choose(op: str, device, mode: str = "eager", impl: str | None = None) -> Choice:
    """``op`` bound for a whole decode on ``device``. "eager": its checked function (`tracelock.ops`) with
    ``impl``'s family member fixed, else its default (for a `PER_LAYER` op one that runs no CPU interpreter);
    "graph": the implementation itself, the default a graph can hold (no input checks, no host sync, no interpreter;
    ``impl`` not used), a Triton kernel with its check (`tracelock.selfcheck.guarded`); "inductor": the same with
    the torch bookkeeping for the C++/CUDA ops (inductor fuses it, and it scheduled reads of a custom op's in-place
    outputs after the op: a compiled CPU engine logged zero commits per step with the C++ apply_commits; torch
    2.13); "specs": the plain-PyTorch spec."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {', '.join(MODES)}")
    if mode == "specs":
        return Choice("torch", spec(op))
    if mode != "eager":
        name = pick(op, None, device, graph=True)
        if mode == "inductor" and name in ("cpp", "cuda"):
            name = "torch"
        return Choice(name, graph_fn(op, name))
    member = family_member(op, impl)
    checked = getattr(importlib.import_module("tracelock.ops"), op)
    if member is not None or op not in PER_LAYER:
        return Choice(member or pick(op, None, device), partial(checked, impl=member))
    name = pick(op, None, device, graph=True)
    # a default Triton kernel goes through the checked function unnamed, so that it runs through its check
    return Choice(name, partial(checked, impl=None if name == "triton" else name))
