"""The argument checks the ops share: each error names the argument and what it must be."""

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name: str, t, dtype: torch.dtype, shape: tuple | None = None, device=None) -> None:
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



def check_arg(name: str, t, dtypes: tuple, shape: tuple | None = None, like: tuple | None = None,
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


def check_dims(name: str, t: torch.Tensor, dims: str) -> None:
    if t.dim() != dims.count(",") + 1:
        raise ValueError(f"{name} must be {dims}, got shape {list(t.shape)}")


def check_finite(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < float("inf"):
            raise ValueError(f"{name} must be a finite number, got {value!r}")


def check_no_nan(active: torch.Tensor, **scores) -> None:
    """A NaN score at an active slot is an error that names it; skipped inside a compiled graph or a CUDA graph
    capture, which cannot read the device (there the spec's rule holds: NaN never commits)."""
    if torch.compiler.is_compiling() or (active.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    for name, t in scores.items():
        if t is not None and bool((t.isnan() & active).any()):
            raise ValueError(f"{name} is NaN at an active slot: the scores that decide a commit must be numbers "
                             "(a NaN usually means the model or the controller overflowed in its dtype; try float32 "
                             "or bfloat16)")



def check_index_range(index: torch.Tensor, Lc: int) -> None:
    """Cache positions outside [0, Lc) are an error, checked on a CPU only (on a GPU it would cost a host sync per
    layer) and not inside a compiled graph (which cannot read the tensor)."""
    if index.is_cuda or torch.compiler.is_compiling() or index.numel() == 0:
        return
    if bool(((index < 0) | (index >= Lc)).any()):
        bad = index[(index < 0) | (index >= Lc)][0].item()
        raise ValueError(f"index holds cache position {bad}, outside [0, {Lc}) (the caches' length): the rows' "
                         "canvas positions must lie in the cache")


def check_head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple:
    """[R, D] hidden rows (strided rows allowed) and a [V, D] head weight on their device, V >= 1; returns (R, V)."""
    check_arg("hidden", hidden, FLOATS, strided_rows=True)
    check_dims("hidden", hidden, "[R, D]")
    check_arg("weight", weight, FLOATS, like=("hidden", hidden))
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V, D] with V >= 1 and D = {hidden.shape[1]} (hidden's width), "
                         f"got shape {list(weight.shape)}")
    return hidden.shape[0], weight.shape[0]
