"""head_topk_js: Triton (interpreter on CPU) against head_topk_js_ref: vocabularies that are not a multiple of the
tile, several splits (forced with split_v) and two row tiles, splits holding fewer than K columns, ties at the K-th
and inside the top-K across tiles and splits, rows with and without a previous pass, K other than 8, fp32 and bf16
inputs, R = 0, each autotune config, poisoned outputs, and the dispatcher."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import head_topk_js_ref, topk_js_ref
from tracelock.testing import assert_close

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# both compute in fp32 from exact upcasts; the head's sums over D and the softmax's over V run in another order
RTOL, ATOL = 1e-5, 1e-5
# (R, D, V, split_v): as test_kernel_head_credit_fuse's
SHAPES = [(1, 32, 1000, None), (5, 48, 1031, 256), (9, 16, 300, 128), (70, 16, 1000, 384)]


def make_head(R, D, V, dtype):
    hidden = torch.randn(R, D, device=DEVICE).to(dtype)
    weight = (torch.randn(V, D, device=DEVICE) * 3 / D**0.5).to(dtype)
    return hidden, weight


def exact_head(logits, D=16):
    """(hidden, weight) whose product is exactly ``logits`` [R, V] (R <= D), so ties stay ties."""
    R, V = logits.shape
    hidden = torch.eye(R, D, device=DEVICE)
    weight = torch.zeros(V, D, device=DEVICE)
    weight[:, :R] = logits.T
    return hidden, weight


def previous(logits, K):
    """A previous top-K per row: that of nearby logits; none in every third row (garbage ids there)."""
    R, V = logits.shape
    no = torch.zeros(R, dtype=torch.bool, device=DEVICE)
    ids, probs, _ = topk_js_ref(logits + 0.5 * torch.randn(R, V, device=DEVICE), torch.zeros(R, K, dtype=torch.int64,
                                device=DEVICE), torch.zeros(R, K, device=DEVICE), no)
    has_prev = torch.arange(R, device=DEVICE) % 3 != 1
    ids[~has_prev] = -7
    return ids, probs, has_prev


def run_both(hidden, weight, K=8, split_v=None, config=None, prev=None):
    """Both implementations on the same previous top-K; the ids must be equal where the row's top K + 1 logits are
    apart by more than the head's fp32 rounding (then so is its order), the probabilities and JS close there.
    Returns the Triton outputs."""
    from tracelock.kernels.head_topk_js import head_topk_js_triton

    logits = hidden.float() @ weight.float().T
    prev = prev or previous(logits, K)
    ref = head_topk_js_ref(hidden, weight, *prev)
    tri = head_topk_js_triton(hidden, weight, *prev, split_v=split_v, config=config)
    R = hidden.shape[0]
    assert tri[0].dtype == torch.int64 and tri[1].dtype == tri[2].dtype == torch.float32
    assert tri[0].shape == tri[1].shape == (R, K) and tri[2].shape == (R,)
    top = logits.topk(min(K + 1, logits.shape[1]), dim=1).values
    clear = ((top[:, :-1] - top[:, 1:]) > 1e-4).all(1) if top.shape[1] > 1 else torch.ones(R, dtype=torch.bool)
    assert clear.any()
    assert torch.equal(ref[0][clear], tri[0][clear]), (ref[0], tri[0])
    assert_close("probs", ref[1][clear], tri[1][clear], atol=ATOL, rtol=RTOL)
    assert_close("js", ref[2][clear], tri[2][clear], atol=ATOL, rtol=RTOL)
    return ref, tri


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("R, D, V, split_v", SHAPES, ids=[f"R{r}-D{d}-V{v}-split{s}" for r, d, v, s in SHAPES])
def test_head_topk_js_matches_ref(poisoned_empty, R, D, V, split_v, dtype):
    _, tri = run_both(*make_head(R, D, V, dtype), split_v=split_v)
    # drift 1 without a previous pass
    assert (tri[2][1::3] == 1).all()


@pytest.mark.parametrize("K", [1, 3, 13])
def test_head_topk_js_other_k(poisoned_empty, K):
    run_both(*make_head(4, 32, 700, torch.float32), K=K, split_v=256)


def test_head_topk_js_ref_is_topk_js_on_the_head():
    hidden, weight = make_head(5, 32, 300, torch.bfloat16)
    logits = hidden.float() @ weight.float().T
    prev = previous(logits, 8)
    ref = topk_js_ref(logits, *prev)
    assert all(torch.equal(a, b) for a, b in zip(ref, head_topk_js_ref(hidden, weight, *prev)))


def test_head_topk_js_ties_to_lowest_index(poisoned_empty):
    """Exact logits: more tied maxima than K across splits (the lowest K win, listed by index), a tie at the K-th
    across splits, and splits with fewer than K columns (V = 20, split 8: 8, 8 and 4 columns)."""
    from tracelock.kernels.head_topk_js import head_topk_js_triton

    K = 8
    logits = torch.randint(-8, 4, (3, 1031), device=DEVICE).float() / 2
    logits[0, [1030, 900, 700, 513, 512, 300, 129, 128, 5, 3]] = 5.0  # ten tied maxima
    logits[1, [40, 41, 42, 43, 44, 45, 46]] = torch.arange(7, 0, -1, device=DEVICE).float() + 4
    logits[1, [1000, 600, 260]] = 4.5  # the K-th place: three tied, the lowest index wins
    hidden, weight = exact_head(logits)
    prev = previous(logits, K)
    ref = head_topk_js_ref(hidden, weight, *prev)
    tri = head_topk_js_triton(hidden, weight, *prev, split_v=256)
    assert tri[0][0].tolist() == [3, 5, 128, 129, 300, 512, 513, 700]
    assert tri[0][1].tolist() == [40, 41, 42, 43, 44, 45, 46, 260]
    assert torch.equal(ref[0], tri[0])
    assert_close("probs", ref[1], tri[1], atol=ATOL, rtol=RTOL)
    assert_close("js", ref[2], tri[2], atol=ATOL, rtol=RTOL)
    small = torch.randint(-8, 8, (2, 20), device=DEVICE).float() / 2
    small[1] = 1.0  # a flat row: every token ties
    hidden, weight = exact_head(small)
    prev = previous(small, K)
    ref = head_topk_js_ref(hidden, weight, *prev)
    tri = head_topk_js_triton(hidden, weight, *prev, split_v=8)
    assert tri[0][1].tolist() == list(range(8))
    assert torch.equal(ref[0], tri[0])
    assert_close("probs", ref[1], tri[1], atol=ATOL, rtol=RTOL)
    assert_close("js", ref[2], tri[2], atol=ATOL, rtol=RTOL)


def test_head_topk_js_own_previous_has_no_drift(poisoned_empty):
    hidden, weight = make_head(3, 32, 500, torch.float32)
    ids, probs, _ = head_topk_js_ref(hidden, weight, torch.zeros(3, 8, dtype=torch.int64), torch.zeros(3, 8),
                                     torch.zeros(3, dtype=torch.bool))
    _, tri = run_both(hidden, weight, split_v=128, prev=(ids, probs, torch.ones(3, dtype=torch.bool)))
    assert_close("js", torch.zeros(3), tri[2], atol=1e-6)


def test_head_topk_js_empty_and_k_equal_v(poisoned_empty):
    from tracelock.kernels.head_topk_js import head_topk_js_triton

    out = head_topk_js_triton(torch.zeros(0, 16, device=DEVICE), torch.zeros(10, 16, device=DEVICE),
                              torch.zeros(0, 8, dtype=torch.int64, device=DEVICE), torch.zeros(0, 8, device=DEVICE),
                              torch.zeros(0, dtype=torch.bool, device=DEVICE))
    assert out[0].shape == out[1].shape == (0, 8) and out[2].shape == (0,)
    run_both(*make_head(3, 16, 8, torch.float32))


@pytest.mark.parametrize("config", range(3), ids=lambda i: f"cfg{i}")
def test_head_topk_js_every_config(poisoned_empty, config):
    from tracelock.kernels.head_topk_js import CONFIGS

    assert len(CONFIGS) == 3
    run_both(*make_head(66, 32, 700, torch.bfloat16), split_v=320, config=config)


def test_head_topk_js_dispatch():
    hidden, weight = make_head(6, 32, 300, torch.bfloat16)
    logits = hidden.float() @ weight.float().T
    prev = previous(logits, 8)
    ref = head_topk_js_ref(hidden, weight, *prev)
    got = ops.head_topk_js(hidden, weight, *prev, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert ops.IMPLEMENTATIONS["head_topk_js"] == ("triton", "torch")
    assert ops.pick("head_topk_js", None, torch.device(DEVICE)) == "triton"
    tri = ops.head_topk_js(torch.cat([hidden, hidden], 1)[:, :32], weight, *prev, impl="triton")
    assert torch.equal(ref[0], tri[0])
    assert_close("js", ref[2], tri[2], atol=ATOL, rtol=RTOL)


def test_head_topk_js_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_interpret", False)
    hidden, weight = make_head(2, 16, 16, torch.float32)
    prev = previous(hidden @ weight.T, 8)
    with pytest.raises(RuntimeError, match="impl='triton' cannot run head_topk_js: .*TRITON_INTERPRET=1"):
        ops.head_topk_js(hidden, weight, *prev, impl="triton")


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        pytest.param(dict(weight=torch.zeros(0, 8)), ValueError, r"weight must be \[V, D\] with V >= 1", id="no-vocab"),
        pytest.param(dict(prev_ids=torch.zeros(2, 3)), TypeError, "prev_ids must be int64", id="ids-dtype"),
        pytest.param(dict(prev_ids=torch.zeros(2, 11, dtype=torch.int64), prev_probs=torch.zeros(2, 11)), ValueError,
                     r"prev_ids must be \[R, K\] with R = 2 .* 1 <= K <= V = 10", id="k-above-v"),
        pytest.param(dict(prev_probs=torch.zeros(2, 4)), ValueError, r"prev_probs must have shape \[2, 3\]",
                     id="probs-shape"),
        pytest.param(dict(has_prev=torch.ones(2)), TypeError, "has_prev must be bool", id="has-prev-dtype"),
    ],
)
def test_head_topk_js_validation(bad, exc, match):
    args = dict(hidden=torch.zeros(2, 8), weight=torch.zeros(10, 8), prev_ids=torch.zeros(2, 3, dtype=torch.int64),
                prev_probs=torch.zeros(2, 3), has_prev=torch.ones(2, dtype=torch.bool)) | bad
    with pytest.raises(exc, match=match):
        ops.head_topk_js(**args, impl="torch")


def test_head_topk_js_triton_caps_k():
    hidden, weight = make_head(2, 16, 100, torch.float32)
    K = ops.MAX_TOPK + 1
    prev = (torch.zeros(2, K, dtype=torch.int64), torch.zeros(2, K), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=f"K = {K}; the Triton head_topk_js .* at most {ops.MAX_TOPK}"):
        ops.head_topk_js(hidden.to(DEVICE), weight.to(DEVICE), *(t.to(DEVICE) for t in prev), impl="triton")
