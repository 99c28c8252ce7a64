"""topk_js: Triton (interpreter on CPU) against topk_js_ref: the running top-K merged across vocabulary tiles (a
vocabulary that is not a multiple of the tile), ties to the lowest index (more tied maxima than K, across tiles),
-inf logits inside the top-K, rows with and without a previous pass, previous top-Ks that overlap this one fully,
partly or not at all, K other than 8, poisoned outputs, and the dispatcher."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import topk_js_ref
from tracelock.testing import assert_close

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K = 8
# both compute in fp32 from exact upcasts; the softmax's sum runs in another order
RTOL, ATOL = 1e-5, 1e-6
JS_ATOL = 1e-5
# (N, V, block_v): V a multiple of no tile (several tiles, the last ragged), one exact tile, the launcher's tile,
# V = K
SHAPES = [(5, 1000, 256), (6, 300, 128), (3, 64, None), (5, 1031, None), (2, K, None)]


def previous(logits, N):
    """A previous top-K per row: none (row 1; garbage ids), this step's own (row 0: JS 0), this step's shifted by
    half (row 2), random ids (the rest); probabilities from a nearby distribution."""
    V = logits.shape[1]
    ids, probs, _ = topk_js_ref(logits, torch.zeros(N, K, dtype=torch.int64, device=DEVICE),
                                torch.zeros(N, K, device=DEVICE), torch.zeros(N, dtype=torch.bool, device=DEVICE))
    prev_ids = torch.randint(0, V, (N, K), device=DEVICE)
    prev_probs = torch.rand(N, K, device=DEVICE).sort(1, descending=True).values / K
    prev_ids[0], prev_probs[0] = ids[0], probs[0]
    if N > 2:
        prev_ids[2, :K // 2] = ids[2, K // 2:]
    has_prev = torch.ones(N, dtype=torch.bool, device=DEVICE)
    if N > 1:
        has_prev[1] = False
        prev_ids[1] = -7
    return prev_ids, prev_probs, has_prev


def make_inputs(N, V, dtype):
    logits = (torch.randn(N, V, device=DEVICE) * 3).to(dtype)
    if N > 3:
        logits[3, V // 3] = float("-inf")
    return (logits, *previous(logits, N))


def run_both(logits, prev_ids, prev_probs, has_prev, block_v=None):
    from tracelock.kernels.topk_js import topk_js_triton

    ref = topk_js_ref(logits, prev_ids, prev_probs, has_prev)
    tri = topk_js_triton(logits, prev_ids, prev_probs, has_prev, block_v=block_v)
    N, k = prev_ids.shape
    assert tri[0].dtype == torch.int64 and tri[1].dtype == tri[2].dtype == torch.float32
    assert tri[0].shape == tri[1].shape == (N, k) and tri[2].shape == (N,)
    assert torch.equal(ref[0], tri[0]), (ref[0], tri[0])
    assert_close("probs", ref[1], tri[1], atol=ATOL, rtol=RTOL)
    assert_close("js", ref[2], tri[2], atol=JS_ATOL, rtol=RTOL)
    return tri


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N, V, block_v", SHAPES, ids=[f"N{n}-V{v}-tile{b}" for n, v, b in SHAPES])
def test_topk_js_matches_ref(poisoned_empty, N, V, block_v, dtype):
    tri = run_both(*make_inputs(N, V, dtype), block_v)
    if N > 1:
        # this step's own top-K: no drift; no previous pass: drift 1
        assert abs(float(tri[2][0])) < 1e-6 and float(tri[2][1]) == 1.0


@pytest.mark.parametrize("k", [1, 3, 13], ids=lambda k: f"K{k}")
def test_topk_js_other_k(poisoned_empty, k):
    logits = torch.randn(4, 300, device=DEVICE) * 3
    prev_ids = torch.randint(0, 300, (4, k), device=DEVICE)
    prev_ids[0] = logits[0].topk(k).indices
    prev_probs = torch.rand(4, k, device=DEVICE) / k
    run_both(logits, prev_ids, prev_probs, torch.tensor([True, True, False, True], device=DEVICE), block_v=128)


def test_topk_js_ties_to_lowest_index(poisoned_empty):
    """Small-integer logits: more maxima than K spread over the tiles (the lowest K indices win, in index order),
    ties inside the top-K, a flat row, and a row with fewer finite logits than K (the top-K ends in -inf logits of
    probability 0, lowest indices first)."""
    N, V = 5, 300
    logits = torch.randint(-4, 3, (N, V), device=DEVICE).float()
    logits[0, [299, 250, 3, 130, 128, 127, 5, 200, 1, 64, 255]] = 5.0
    logits[1, [10, 140, 20]] = 6.0
    logits[1, [280, 7, 129, 150, 2, 260]] = 5.0
    logits[2] = 0.0
    logits[3] = float("-inf")
    logits[3, [290, 17, 150]] = torch.tensor([1.0, 2.0, 1.0], device=DEVICE)
    logits[4, 129:] = 9.0  # every maximum is in a later tile than the first
    prev_ids, prev_probs, has_prev = previous(logits, N)
    tri = run_both(logits, prev_ids, prev_probs, has_prev, block_v=128)
    assert tri[0].tolist() == [[1, 3, 5, 64, 127, 128, 130, 200], [10, 20, 140, 2, 7, 129, 150, 260],
                               list(range(8)), [17, 150, 290, 0, 1, 2, 3, 4], list(range(129, 137))]
    assert tri[1][3, 3:].tolist() == [0.0] * 5


def test_topk_js_drift_over_steps(poisoned_empty):
    """Each step compared with the top-K the step before returned: small drift for small changes of the logits, and
    the same drift from both implementations."""
    from tracelock.kernels.topk_js import topk_js_triton

    N, V = 3, 500
    logits = torch.randn(N, V, device=DEVICE) * 3
    ids, probs = torch.zeros(N, K, dtype=torch.int64, device=DEVICE), torch.zeros(N, K, device=DEVICE)
    has_prev = torch.zeros(N, dtype=torch.bool, device=DEVICE)
    for step in range(3):
        step_logits = logits + 0.2 * step * torch.randn(N, V, device=DEVICE)
        ref = topk_js_ref(step_logits, ids, probs, has_prev)
        ids, probs, js = topk_js_triton(step_logits, ids, probs, has_prev, block_v=128)
        assert torch.equal(ref[0], ids)
        assert_close("probs", ref[1], probs, atol=ATOL, rtol=RTOL)
        assert_close("js", ref[2], js, atol=JS_ATOL, rtol=RTOL)
        assert bool((js == 1).all()) if step == 0 else bool((js < 0.1).all())
        has_prev = torch.ones_like(has_prev)


def test_topk_js_strided_logits():
    # the slots' rows as a view of a wider buffer: rows strided, each row contiguous
    logits, prev_ids, prev_probs, has_prev = make_inputs(5, 1031, torch.bfloat16)
    wide = torch.randn(5, 1500, device=DEVICE).to(torch.bfloat16)
    wide[:, :1031] = logits
    ref = topk_js_ref(logits, prev_ids, prev_probs, has_prev)
    tri = ops.topk_js(wide[:, :1031], prev_ids, prev_probs, has_prev, impl="triton")
    assert torch.equal(ref[0], tri[0])
    assert_close("probs", ref[1], tri[1], atol=ATOL, rtol=RTOL)
    assert_close("js", ref[2], tri[2], atol=JS_ATOL, rtol=RTOL)


def test_topk_js_empty(poisoned_empty):
    from tracelock.kernels.topk_js import topk_js_triton

    ids, probs, js = topk_js_triton(torch.zeros(0, 10, device=DEVICE), torch.zeros(0, K, dtype=torch.int64),
                                    torch.zeros(0, K), torch.zeros(0, dtype=torch.bool))
    assert ids.shape == probs.shape == (0, K) and js.shape == (0,)


def test_topk_js_dispatch_torch_is_the_spec():
    args = make_inputs(6, 300, torch.bfloat16)
    ref = topk_js_ref(*args)
    got = ops.topk_js(*args, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert ops.IMPLEMENTATIONS["topk_js"] == ("triton", "torch")
    assert ops.pick("topk_js", None, torch.device(DEVICE)) == "triton"
    tri = ops.topk_js(*args, impl="triton")
    assert torch.equal(ref[0], tri[0])
    assert_close("js", ref[2], tri[2], atol=JS_ATOL, rtol=RTOL)


def test_topk_js_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_interpret", False)
    args = [t.cpu() for t in make_inputs(2, 16, torch.float32)]
    with pytest.raises(RuntimeError, match="impl='triton' cannot run topk_js: .*TRITON_INTERPRET=1"):
        ops.topk_js(*args, impl="triton")


def test_topk_js_triton_refuses_a_large_k():
    logits = torch.zeros(2, 100)
    args = (torch.zeros(2, ops.MAX_TOPK + 1, dtype=torch.int64), torch.zeros(2, ops.MAX_TOPK + 1),
            torch.ones(2, dtype=torch.bool))
    assert ops.topk_js(logits, *args, impl="torch")[0].shape == (2, ops.MAX_TOPK + 1)
    with pytest.raises(ValueError, match=f"at most {ops.MAX_TOPK}: use impl='torch'"):
        ops.topk_js(logits, *args, impl="triton")


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        pytest.param(dict(logits=torch.zeros(2, 9, dtype=torch.int64)), TypeError, "logits must be float32",
                     id="logits-dtype"),
        pytest.param(dict(logits=torch.zeros(9)), ValueError, r"logits must be \[N, V\]", id="logits-1d"),
        pytest.param(dict(logits=torch.zeros(2, 4)), ValueError, r"1 <= K <= V = 4", id="k-above-v"),
        pytest.param(dict(prev_ids=torch.zeros(2, 0, dtype=torch.int64), prev_probs=torch.zeros(2, 0)), ValueError,
                     r"prev_ids must be \[N, K\] with N = 2", id="k-zero"),
        pytest.param(dict(prev_ids=torch.zeros(3, K, dtype=torch.int64)), ValueError,
                     r"prev_ids must be \[N, K\] with N = 2 \(logits' rows\)", id="prev-ids-rows"),
        pytest.param(dict(prev_ids=torch.zeros(2, K, dtype=torch.int32)), TypeError, "prev_ids must be int64",
                     id="prev-ids-dtype"),
        pytest.param(dict(prev_probs=torch.zeros(2, K, dtype=torch.float64)), TypeError, "prev_probs must be float32",
                     id="prev-probs-dtype"),
        pytest.param(dict(prev_probs=torch.zeros(2, K + 1)), ValueError, r"prev_probs must have shape \[2, 8\]",
                     id="prev-probs-shape"),
        pytest.param(dict(prev_probs=torch.zeros(K, 2).t()), ValueError, "prev_probs must be contiguous",
                     id="prev-probs-noncontig"),
        pytest.param(dict(has_prev=torch.ones(2, dtype=torch.uint8)), TypeError, "has_prev must be bool",
                     id="has-prev-dtype"),
        pytest.param(dict(has_prev=torch.ones(2, 1, dtype=torch.bool)), ValueError, r"has_prev must have shape \[2\]",
                     id="has-prev-shape"),
        pytest.param(dict(prev_ids=torch.zeros(2, K, dtype=torch.int64, device="meta")), ValueError,
                     "prev_ids must be on cpu like logits", id="prev-ids-device"),
    ],
)
def test_topk_js_validation(bad, exc, match):
    args = dict(logits=torch.zeros(2, 9), prev_ids=torch.zeros(2, K, dtype=torch.int64), prev_probs=torch.zeros(2, K),
                has_prev=torch.ones(2, dtype=torch.bool)) | bad
    with pytest.raises(exc, match=match):
        ops.topk_js(**args, impl="torch")
