"""The public ops: one checked function per op (each takes ``impl=`` and otherwise runs the fastest available
implementation), the one chooser (`tracelock.ops.chooser`) and the one op object a decode runs (`OpSet`, built by
`op_set`). Triton is imported lazily (through ``tracelock._triton``), so ``import tracelock`` never loads it.
"""

from tracelock.ops.bookkeeping import apply_commits, skip_finished_blocks
from tracelock.ops.chooser import IMPLEMENTATIONS, IMPLS, MODES, PER_LAYER, check_impl, choose, pick
from tracelock.ops.commit import commit_step
from tracelock.ops.head import tap_project, window_logits_stats
from tracelock.ops.layers import ACTIVATIONS, MAX_NORM_WIDTH, add_rms_norm, linear_rows, rope_qkv, silu_mul
from tracelock.ops.memory import MAX_TOPK, credit_fuse, head_credit_fuse, head_step_kl, head_topk_js, step_kl, topk_js
from tracelock.ops.op_set import BACKBONES, MATMUL_ROWS, OpSet, op_set, spec_set

__all__ = [
    "ACTIVATIONS", "BACKBONES", "IMPLEMENTATIONS", "IMPLS", "MATMUL_ROWS", "MAX_NORM_WIDTH", "MAX_TOPK", "MODES",
    "PER_LAYER", "OpSet", "add_rms_norm", "apply_commits", "check_impl", "choose", "commit_step", "credit_fuse",
    "head_credit_fuse", "head_step_kl", "head_topk_js", "linear_rows", "op_set", "pick", "rope_qkv", "silu_mul",
    "skip_finished_blocks", "spec_set", "step_kl", "tap_project", "topk_js", "window_logits_stats",
]
