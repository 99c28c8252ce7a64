"""The optional C++/CUDA extension ``tracelock._C``, imported once, with a torch fallback when it is missing.

Importing ``_C`` registers its ops as ``torch.ops.tracelock.*``; this module adds their fake (meta)
implementations so torch.compile and CUDA graphs can trace them.
"""

import importlib

# torch first: _C links against libc10/libtorch, which only import torch puts in the process
import torch

# the ops this version of the sources registers; a _C built from older sources lacks some and counts as missing
OPS = ("apply_commits", "skip_finished_blocks")

try:
    # import_module, not `from tracelock import _C`: while tracelock/__init__ is still running, the latter
    # reports a missing _C as "partially initialized module (most likely due to a circular import)"
    _C = importlib.import_module("tracelock._C")
except ImportError as err:
    _C = None
    _IMPORT_ERROR = f"{type(err).__name__}: {err}"
else:
    _IMPORT_ERROR = None
    if missing := [op for op in OPS if not hasattr(torch.ops.tracelock, op)]:
        _C, _IMPORT_ERROR = None, f"tracelock._C is out of date (it has no {', '.join(missing)}): rebuild it"

if _C is not None:
    @torch.library.register_fake("tracelock::apply_commits")
    def _apply_commits_fake(x, state, proposal, commit, end_ids, fill_id, stop_at_eot):
        return x.new_empty((x.shape[0],), dtype=torch.int64)

    @torch.library.register_fake("tracelock::skip_finished_blocks")
    def _skip_finished_blocks_fake(state, block_idx, region_step, region_initial, steps, rows, prompt_len, block,
                                   num_regions, steps_per_block, idle_steps):
        return None


def has_cpp() -> bool:
    """Whether ``tracelock._C`` imported, i.e. the C++ (CPU) ops are available."""
    return _C is not None


def has_cuda_ext() -> bool:
    """Whether ``tracelock._C`` imported and was built with its CUDA kernels."""
    return _C is not None and _C.with_cuda()


def ext_error() -> str | None:
    """The text of the error raised by ``from tracelock import _C``, or None when it imported."""
    return _IMPORT_ERROR
