"""rope_qkv: Triton (interpreter on CPU) against rope_qkv_ref bit for bit in every dtype, both RoPE precisions (LLaDA's
fp32, Dream's in-dtype rounding), with and without a KV cache written in place (padding rows repeating a position
included); the spec against the backbone's apply_rope and cache scatter bit for bit; and the dispatcher."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import rope_qkv_ref

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (B, Q, n_heads, n_kv, head_dim): the smallest head, LLaDA-like (as many k/v heads as q heads), grouped heads with
# an odd half width (3, 9), and Dream-like 128-wide heads spread over two head blocks of a program each
SHAPES = [(1, 1, 1, 1, 2), (1, 7, 4, 4, 8), (2, 5, 6, 2, 6), (3, 9, 5, 1, 18), (1, 3, 20, 4, 128)]
SHAPE_IDS = [f"B{b}-Q{q}-H{h}-KV{k}-hd{d}" for b, q, h, k, d in SHAPES]


def cos_sin(positions, head_dim, theta=10000.0):
    """`models.backbone.rope_cos_sin`'s values (fp32, half-split)."""
    from tracelock.models.backbone import rope_cos_sin

    return rope_cos_sin(positions, head_dim, theta)


def make_inputs(B, Q, H, KV, hd, dtype, Lc=None):
    """qkv, cos, sin at random canvas positions; with ``Lc``, caches of random content and distinct cache positions,
    the last query row repeating the one before (a padded query: same position, same values)."""
    qkv = (torch.randn(B, Q, (H + 2 * KV) * hd) * 2).to(dtype)
    positions = torch.stack([torch.randperm(Lc or 4 * Q + 8)[:Q] for _ in range(B)])
    if Lc and Q > 1:
        positions[:, -1] = positions[:, -2]
        qkv[:, -1] = qkv[:, -2]
    cos, sin = cos_sin(positions, hd)
    out = [qkv, cos, sin]
    if Lc:
        out += [torch.randn(B, KV, Lc, hd).to(dtype), torch.randn(B, KV, Lc, hd).to(dtype), positions]
    return [t.to(DEVICE) for t in out]


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope-fp32", "rope-dtype"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B, Q, H, KV, hd", SHAPES, ids=SHAPE_IDS)
def test_rope_qkv_matches_ref(poisoned_empty, B, Q, H, KV, hd, dtype, rope_fp32):
    from tracelock.kernels.rope_qkv import rope_qkv_triton

    qkv, cos, sin = make_inputs(B, Q, H, KV, hd, dtype)
    ref = rope_qkv_ref(qkv, cos, sin, H, KV, hd, rope_fp32)
    tri = rope_qkv_triton(qkv, cos, sin, H, KV, hd, rope_fp32)
    for name, r, t, heads in zip("qkv", ref, tri, (H, KV, KV)):
        assert t.shape == (B, heads, Q, hd) and t.dtype == dtype and t.is_contiguous(), name
        assert torch.equal(r, t), f"{name} differs"


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope-fp32", "rope-dtype"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("B, Q, H, KV, hd", SHAPES, ids=SHAPE_IDS)
def test_rope_qkv_writes_the_cache_in_place(poisoned_empty, B, Q, H, KV, hd, dtype, rope_fp32):
    from tracelock.kernels.rope_qkv import rope_qkv_triton

    qkv, cos, sin, k_cache, v_cache, index = make_inputs(B, Q, H, KV, hd, dtype, Lc=Q + 5)
    ref_k, ref_v, tri_k, tri_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    ref = rope_qkv_ref(qkv, cos, sin, H, KV, hd, rope_fp32, ref_k, ref_v, index)
    tri = rope_qkv_triton(qkv, cos, sin, H, KV, hd, rope_fp32, tri_k, tri_v, index)
    assert tri[1] is tri_k and tri[2] is tri_v
    assert torch.equal(ref[0], tri[0]), "q differs"
    assert torch.equal(ref_k, tri_k) and torch.equal(ref_v, tri_v), "caches differ"
    # positions no row names keep their old keys and values
    untouched = torch.ones(B, Q + 5, dtype=torch.bool, device=DEVICE).scatter_(1, index, False)
    assert torch.equal(tri_k.transpose(1, 2)[untouched], k_cache.transpose(1, 2)[untouched])
    assert torch.equal(tri_v.transpose(1, 2)[untouched], v_cache.transpose(1, 2)[untouched])


def test_rope_qkv_strided_inputs(poisoned_empty):
    """qkv as a view into a wider buffer and cos/sin broadcast over the batch (stride 0)."""
    from tracelock.kernels.rope_qkv import rope_qkv_triton

    B, Q, H, KV, hd = 3, 5, 6, 2, 6
    qkv = torch.randn(B, Q + 2, (H + 2 * KV) * hd + 4, dtype=torch.bfloat16, device=DEVICE)[:, 1:-1, 4:]
    cos, sin = (t.expand(B, Q, hd) for t in cos_sin(torch.arange(Q, device=DEVICE)[None], hd))
    for rope_fp32 in (True, False):
        ref = rope_qkv_ref(qkv, cos, sin, H, KV, hd, rope_fp32)
        tri = rope_qkv_triton(qkv, cos, sin, H, KV, hd, rope_fp32)
        assert all(torch.equal(r, t) for r, t in zip(ref, tri))
    # caches as views of wider buffers (spare positions, an extra head) and a transposed index: the graph path,
    # which skips the dispatcher's checks, takes any strides but the last
    Lc = 9
    k_buf = torch.randn(B, KV + 1, Lc + 3, hd, dtype=torch.bfloat16, device=DEVICE)
    v_buf = torch.randn(B, KV, Lc, hd + 2, dtype=torch.bfloat16, device=DEVICE)
    index = torch.stack([torch.randperm(Lc)[:Q] for _ in range(B)], dim=1).to(DEVICE).T
    ref_k_buf, ref_v_buf = k_buf.clone(), v_buf.clone()
    ref = rope_qkv_ref(qkv, cos, sin, H, KV, hd, True, ref_k_buf[:, 1:, 2:-1], ref_v_buf[..., 1:-1], index)
    tri = rope_qkv_triton(qkv, cos, sin, H, KV, hd, True, k_buf[:, 1:, 2:-1], v_buf[..., 1:-1], index)
    # nothing outside the views moves
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref_k_buf, k_buf) and torch.equal(ref_v_buf, v_buf)


@pytest.mark.parametrize("rope_fp32", [True, False], ids=["rope-fp32", "rope-dtype"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ref_is_the_backbone_rope(dtype, rope_fp32):
    """The spec is `models.backbone.apply_rope` on the q/k/v projections' heads and the cache scatter the backbone
    did before the kernel (``k_all.scatter(2, index, k)``), bit for bit (CPU)."""
    from tracelock.models.backbone import apply_rope

    B, Q, H, KV, hd, Lc = 2, 5, 4, 2, 8, 11
    qkv, cos, sin, k_cache, v_cache, index = (t.cpu() for t in make_inputs(B, Q, H, KV, hd, dtype, Lc=Lc))
    heads = qkv.view(B, Q, H + 2 * KV, hd).transpose(1, 2)
    q, k, v = heads[:, :H], heads[:, H:H + KV], heads[:, H + KV:]
    want_q, want_k = apply_rope(q, cos, sin, rope_fp32), apply_rope(k, cos, sin, rope_fp32)
    got_q, got_k, got_v = rope_qkv_ref(qkv, cos, sin, H, KV, hd, rope_fp32)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, v)
    where = index[:, None, :, None].expand(-1, KV, -1, hd)
    want_kc, want_vc = k_cache.scatter(2, where, want_k), v_cache.scatter(2, where, v)
    _, got_kc, got_vc = rope_qkv_ref(qkv, cos, sin, H, KV, hd, rope_fp32, k_cache, v_cache, index)
    assert torch.equal(got_kc, want_kc) and torch.equal(got_vc, want_vc)


@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cache"])
def test_rope_qkv_dispatch(cached):
    B, Q, H, KV, hd = 2, 5, 6, 2, 6
    inputs = make_inputs(B, Q, H, KV, hd, torch.bfloat16, Lc=9 if cached else None)
    got = {}
    for impl in ("torch", "triton"):
        args = [t.clone() for t in inputs]
        out = ops.rope_qkv(*args[:3], H, KV, hd, True, *args[3:], impl=impl)
        got[impl] = out
        if cached:
            assert out[1] is args[3] and out[2] is args[4]
    assert all(torch.equal(a, b) for a, b in zip(got["torch"], got["triton"]))
    assert ops.pick("rope_qkv", None, torch.device(DEVICE)) == "triton"


def test_rope_qkv_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_available", False)
    qkv, cos, sin = (t.cpu() for t in make_inputs(1, 2, 2, 1, 4, torch.float32))
    with pytest.raises(RuntimeError, match="impl='triton' cannot run rope_qkv: triton is not installed"):
        ops.rope_qkv(qkv, cos, sin, 2, 1, 4, True, impl="triton")


def _args(**bad):
    B, Q, H, KV, hd, Lc = 2, 3, 4, 2, 4, 7
    args = dict(qkv=torch.zeros(B, Q, (H + 2 * KV) * hd), cos=torch.zeros(B, Q, hd), sin=torch.zeros(B, Q, hd),
                n_heads=H, n_kv=KV, head_dim=hd, rope_fp32=True, k_cache=torch.zeros(B, KV, Lc, hd),
                v_cache=torch.zeros(B, KV, Lc, hd), index=torch.zeros(B, Q, dtype=torch.int64))
    return args | bad


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        pytest.param(dict(qkv=torch.zeros(2, 3, 32, dtype=torch.int32)), TypeError,
                     "qkv must be float32 or float16 or bfloat16", id="qkv-dtype"),
        pytest.param(dict(qkv=torch.zeros(6, 32)), ValueError, r"qkv must be \[B, Q, \(n_heads \+ 2 n_kv\) head_dim\]",
                     id="qkv-2d"),
        pytest.param(dict(qkv=torch.zeros(2, 3, 33)), ValueError,
                     r"= 32 columns \(the fused q/k/v projection\), got 33", id="qkv-width"),
        pytest.param(dict(qkv=torch.zeros(2, 32, 3).transpose(1, 2)), ValueError, "qkv must be contiguous",
                     id="qkv-last-dim-strided"),
        pytest.param(dict(n_kv=0), ValueError, "n_kv must be an int >= 1", id="n-kv-zero"),
        pytest.param(dict(head_dim=4.0), ValueError, "head_dim must be an int >= 1", id="head-dim-float"),
        pytest.param(dict(qkv=torch.zeros(2, 3, 24), head_dim=3), ValueError, "head_dim must be even",
                     id="head-dim-odd"),
        pytest.param(dict(cos=torch.zeros(2, 3, 4, dtype=torch.bfloat16)), TypeError, "cos must be float32",
                     id="cos-dtype"),
        pytest.param(dict(sin=torch.zeros(2, 4, 4)), ValueError, r"sin must have shape \[2, 3, 4\]", id="sin-shape"),
        pytest.param(dict(rope_fp32=1), TypeError, "rope_fp32 must be a bool", id="rope-fp32-int"),
        pytest.param(dict(index=None), ValueError,
                     r"k_cache, v_cache and index go together .*; got only k_cache, v_cache", id="index-missing"),
        pytest.param(dict(k_cache=torch.zeros(2, 2, 7, 4, dtype=torch.float16)), TypeError,
                     "k_cache must be float32, got torch.float16", id="cache-dtype"),
        pytest.param(dict(k_cache=torch.zeros(2, 4, 7, 4)), ValueError,
                     r"k_cache must be \[B, n_kv, Lc, head_dim\] = \[2, 2, Lc >= 1, 4\]", id="cache-heads"),
        pytest.param(dict(k_cache=torch.zeros(2, 2, 4, 7).transpose(2, 3)), ValueError, "k_cache must be contiguous",
                     id="cache-strided"),
        pytest.param(dict(v_cache=torch.zeros(2, 2, 8, 4)), ValueError, r"v_cache must have shape \[2, 2, 7, 4\]",
                     id="v-cache-shape"),
        pytest.param(dict(index=torch.zeros(2, 3, dtype=torch.int32)), TypeError, "index must be int64",
                     id="index-dtype"),
        pytest.param(dict(index=torch.tensor([[0, 1, 2], [3, 7, 6]])), ValueError,
                     r"index holds cache position 7, outside \[0, 7\)", id="index-past-the-cache"),
        pytest.param(dict(index=torch.tensor([[0, -1, 2], [3, 4, 6]])), ValueError,
                     r"index holds cache position -1, outside \[0, 7\)", id="index-negative"),
    ],
)
def test_rope_qkv_validation(bad, exc, match):
    with pytest.raises(exc, match=match):
        ops.rope_qkv(**_args(**bad), impl="torch")
