"""Triton kernels that check themselves: the first time a default-chosen Triton op runs in a process on a device,
dtype and shape class (which optional arguments are given, the flags), it runs on a small input
(`tracelock.selfcheck_inputs`) beside its torch spec. A mismatch or a failure to compile or run sends that op, on that
key, to the spec for the rest of the process, with one warning naming the op. ``TRACELOCK_SELFCHECK=0`` turns the
check off (the kernels then run unchecked). An explicit ``impl="triton"`` (or ``TRACELOCK_IMPL``) is never checked:
it is obeyed, so a kernel's own parity tests see the kernel. Inside a compiled graph or a CUDA-graph capture no check
runs: the verdict taken before (the engine's warm-up step) holds, else the kernel runs.
"""

import importlib
import os
import warnings

import torch

from tracelock.selfcheck_inputs import BUILDERS

# per dtype of the checked call: (rtol, atol relative to the reference's scale); wide enough for a GPU's TF32 or a
# different accumulation order, far below what a wrong kernel gives
TOLERANCE = {torch.float64: (1e-4, 1e-4), torch.float32: (2e-3, 2e-3), torch.float16: (1e-2, 1e-2),
             torch.bfloat16: (5e-2, 5e-2)}
_VERDICTS: dict = {}  # (op, device, dtype, shape class) -> True (the kernel runs) or False (the spec runs)
_WHY: dict = {}  # the same keys -> what the check found
_WARNED: set = set()


def enabled() -> bool:
    return os.environ.get("TRACELOCK_SELFCHECK", "1").strip().lower() not in ("0", "false", "off")


def shape_class(args) -> tuple:
    """What a call's arguments select in a kernel besides dtype and widths: None-ness, booleans, strings, zero ints."""
    return tuple(a if type(a) in (bool, str) else a != 0 if type(a) is int else a is None for a in args)


def reset() -> None:
    """Forget every verdict and warning (tests)."""
    _VERDICTS.clear()
    _WHY.clear()
    _WARNED.clear()


def _spec(op: str):
    from tracelock.kernels import ref

    return getattr(ref, f"{op}_ref")


def run(op: str, kernel, args: tuple):
    """``kernel(*args)``, or its spec's when the op failed its check on this key (checked here on first use)."""
    key = (op, args[0].device, args[0].dtype, shape_class(args))
    ok = _VERDICTS.get(key)
    if ok is None:
        ok = _first_use(op, kernel, args, key)
    return kernel(*args) if ok else _spec(op)(*args)


def guarded(op: str, kernel):
    """``kernel`` with its check (for graphs, which hold the implementation itself)."""

    def checked(*args):
        return run(op, kernel, args)

    return checked


def _first_use(op, kernel, args, key) -> bool:
    device = args[0].device
    if not enabled() or op not in BUILDERS or torch.compiler.is_compiling() or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return True
    ok, why = compare(op, kernel, BUILDERS[op](args, torch.Generator().manual_seed(0), device, args[0].dtype))
    _VERDICTS[key], _WHY[key] = ok, why
    if not ok and op not in _WARNED:
        _WARNED.add(op)
        warnings.warn(f"tracelock: the Triton {op} kernel failed its check against {op}_ref on {device} "
                      f"({args[0].dtype}): {why}; {op} runs its torch spec instead in this process "
                      "(TRACELOCK_SELFCHECK=0 turns the check off)", RuntimeWarning, stacklevel=4)
    return ok


def _tensors(out, args) -> list:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return outs + [a for a in args if isinstance(a, torch.Tensor)]


def _clone(args) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def compare(op: str, kernel, args: tuple) -> tuple:
    """(passed, what was found): ``kernel`` against the op's spec on ``args`` (each on its own copy), every output and
    every argument the two wrote in place; discrete values exactly, floats within `TOLERANCE` of the call's dtype."""
    ref_args, got_args = _clone(args), _clone(args)
    ref = _tensors(_spec(op)(*ref_args), ref_args)
    try:
        got = _tensors(kernel(*got_args), got_args)
    except Exception as err:  # a kernel that cannot compile or launch on this device: the spec runs
        return False, f"{type(err).__name__}: {str(err)[:200]}"
    rtol, atol = TOLERANCE.get(args[0].dtype, TOLERANCE[torch.float32])
    for i, (r, t) in enumerate(zip(ref, got)):
        if not isinstance(t, torch.Tensor) or t.shape != r.shape:
            return False, f"output {i} has shape {getattr(t, 'shape', None)}, the spec's {tuple(r.shape)}"
        r, t = r.cpu(), t.cpu()
        if not r.is_floating_point():
            if not torch.equal(r, t.to(r.dtype)):
                return False, f"output {i} differs at {int((r != t).sum())} of {r.numel()} elements"
            continue
        r, t = r.double(), t.double()
        scale = max(1.0, float(r[r.isfinite()].abs().max())) if r.isfinite().any() else 1.0
        close = ((t - r).abs() <= atol * scale + rtol * r.abs()) | (r.isnan() & t.isnan()) | (r == t)
        if not bool(close.all()):
            return False, f"output {i} off by up to {float((t - r).abs().nan_to_num(float('inf')).max()):.3g}"
    return True, "passed"


def check(op: str, device, dtype, kernel=None) -> tuple:
    """(passed, what was found) of ``op``'s Triton kernel (or ``kernel``) on its default small input (``tracelock
    env``, the benchmark of the check's cost); recorded as the verdict of that key."""
    if kernel is None:
        kernel = getattr(importlib.import_module(f"tracelock.kernels.{op}"), f"{op}_triton")
    args = BUILDERS[op](None, torch.Generator().manual_seed(0), torch.device(device), dtype)
    ok, why = compare(op, kernel, args)
    key = (op, args[0].device, args[0].dtype, shape_class(args))
    _VERDICTS[key], _WHY[key] = ok, why
    return ok, why


def verdicts() -> dict:
    """{(op, device, dtype, shape class): what its check found} of this process so far."""
    return dict(_WHY)
