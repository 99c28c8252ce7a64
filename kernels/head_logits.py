# Copyright (c) 2025 the tracelock authors.
# What the LM-head kernels of the rules that remember share (head_credit_fuse, head_topk_js, head_step_kl): one
# [BLOCK_R, BLOCK_V] tile of logits = hidden @ weight.T computed by a D-loop of dots (as window_logits_stats does),
# and the launch plan: all the window's rows in one row tile, the vocabulary cut into splits that a second launch
# merges. IO of a tile: BLOCK_V·D weights (HBM once per call) + BLOCK_R·D hidden (L2) per tile; nothing is written.

from tracelock._triton import triton
from tracelock.kernels.window_logits_stats import MAX_SPLITS, block_rows, split_columns

tl = triton.language


@triton.jit
def head_logits_tile(H, W, o_r, m_r, o_v, m_v, D, stride_h,
                     DOT_NATIVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """Logits of rows ``o_r`` at columns ``o_v`` in fp32, -inf at the columns outside ``m_v`` (so no reduction picks
    them). 16-bit tiles go to the dot as loaded where ``DOT_NATIVE``, else upcast to fp32 with an IEEE dot."""
    b_l = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_h = tl.load(H + o_r[:, None] * stride_h + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0)
        b_w = tl.load(W + o_v[:, None] * D + o_d[None, :], mask=m_v[:, None] & m_d[None, :], other=0.0)
        if DOT_NATIVE:
            b_l = tl.dot(b_h, tl.trans(b_w), b_l)  # [BLOCK_R, BLOCK_V]
        else:
            b_l = tl.dot(b_h.to(tl.float32), tl.trans(b_w.to(tl.float32)), b_l, input_precision="ieee")
    return tl.where(m_v[None, :], b_l, float("-inf"))


# rows per tile: window_logits_stats's 128 spilled registers on sm_90 in every config of these kernels, whose
# epilogues hold more [BLOCK_R, BLOCK_V] tiles (tests/test_kernels_compile.py); 64 rows still take Hopper's
# warp-group MMA, and where R > 64 (a compute-bound head) the row tiles of one split run side by side, sharing its
# weight tile in L2
MAX_BLOCK_R = 64


def plan(R: int, V: int, device, split_v: int | None = None, max_splits: int = MAX_SPLITS) -> tuple:
    """(BLOCK_R, row tiles, columns per split, splits S): window_logits_stats's plan with at most `MAX_BLOCK_R` rows
    per tile (``split_v`` overrides the columns per split, as tests do to force several splits); at most
    ``max_splits`` splits, so the merge's tile of a row's partials fits a program."""
    block_r = min(MAX_BLOCK_R, block_rows(R))
    row_tiles = triton.cdiv(R, block_r)
    split_v = split_v or max(split_columns(V, row_tiles, device), triton.cdiv(triton.cdiv(V, max_splits), 128) * 128)
    S = triton.cdiv(V, split_v)
    if S > max_splits:
        raise ValueError(f"split_v={split_v} gives {S} splits of V={V}, more than {max_splits}; raise split_v")
    return block_r, row_tiles, split_v, S


def merge_rows(R: int, block_s: int) -> int:
    """Rows per merge program: a [rows, BLOCK_S] tile of about 4096 elements (window_logits_stats's merge)."""
    return max(1, min(triton.next_power_of_2(R), 4096 // block_s))
