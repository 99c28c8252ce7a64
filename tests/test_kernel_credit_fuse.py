"""credit_fuse: Triton (interpreter on CPU) against credit_fuse_ref: fresh / decaying rows, boost on and off, ties
within and across vocabulary tiles, a vocabulary that is not a multiple of the tile, the credit carried over steps
(updated in place), poisoned outputs, and the dispatcher."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import credit_fuse_ref
from tracelock.testing import assert_close

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# both compute in fp32 from exact upcasts; the sums run in another order and p1 ** gamma is exp(gamma log p1)
RTOL, ATOL = 1e-5, 1e-6
# (N, V, block_v): V a multiple of no tile (several tiles, the last ragged), one exact tile, the launcher's tile
SHAPES = [(4, 1000, 256), (6, 300, 128), (3, 64, None), (5, 1031, None)]
# (alpha, gamma, beta): dInfer-like settings, a strong fusion with a root boost, and a negative fusion weight
KNOBS = [(0.7, 1.0, 0.9), (2.0, 0.5, 0.5), (-0.5, 2.0, 1.0)]


def make_inputs(N, V, dtype):
    """Logits of a few units (a -inf token in row 0), credit in [0, 1) with a few large entries, and the four
    (boost, fresh) combinations over the rows."""
    logits = (torch.randn(N, V, device=DEVICE) * 3).to(dtype)
    logits[0, V // 3] = float("-inf")
    credit = torch.rand(N, V, device=DEVICE)
    credit[:, ::7] *= 10
    rows = torch.arange(N, device=DEVICE)
    return logits, credit, rows % 2 == 0, rows % 4 >= 2


def run_both(logits, credit, boost, fresh, alpha, gamma, beta, block_v=None):
    """Both implementations from copies of ``credit``: the outputs and the credit each left behind are compared;
    returns the Triton outputs and credit."""
    from tracelock.kernels.credit_fuse import credit_fuse_triton

    ref_credit, tri_credit = credit.clone(), credit.clone()
    ref = credit_fuse_ref(logits, ref_credit, boost, fresh, alpha, gamma, beta)
    tri = credit_fuse_triton(logits, tri_credit, boost, fresh, alpha, gamma, beta, block_v=block_v)
    assert tri[0].dtype == torch.int64 and tri[1].dtype == torch.float32
    assert tri[0].shape == tri[1].shape == (logits.shape[0],)
    assert_close("credit", ref_credit, tri_credit, atol=ATOL, rtol=RTOL)
    assert_close("confidence", ref[1], tri[1], atol=ATOL, rtol=RTOL)
    # the proposals agree wherever the top two fused logits are apart by more than the fp32 rounding of the fusion
    fused = logits.float() + alpha * torch.log(ref_credit + 1)
    top = fused.topk(min(2, fused.shape[1]), dim=1).values
    clear = top[:, 0] - top[:, -1] > 1e-4 * top[:, 0].abs().clamp_min(1) if top.shape[1] > 1 else top[:, 0] == top[:, 0]
    assert clear.any()
    assert torch.equal(ref[0][clear], tri[0][clear]), (ref[0], tri[0])
    return tri, tri_credit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N, V, block_v", SHAPES, ids=[f"N{n}-V{v}-tile{b}" for n, v, b in SHAPES])
def test_credit_fuse_matches_ref(poisoned_empty, N, V, block_v, dtype):
    logits, credit, boost, fresh = make_inputs(N, V, dtype)
    run_both(logits, credit, boost, fresh, 0.7, 1.0, 0.9, block_v)


@pytest.mark.parametrize("alpha, gamma, beta", KNOBS, ids=[f"a{a}-g{g}-b{b}" for a, g, b in KNOBS])
def test_credit_fuse_knobs(poisoned_empty, alpha, gamma, beta):
    logits, credit, boost, fresh = make_inputs(5, 700, torch.float32)
    run_both(logits, credit, boost, fresh, alpha, gamma, beta, block_v=256)


def test_credit_fuse_credit_carries_over_steps(poisoned_empty):
    """A slot's credit across a region: fresh at its first step (its stale credit, NaN here, is never read), then
    decayed and boosted step after step (rows 1 and 3 unmasked after step 0: they only decay); the credit each
    implementation leaves in place is its own next input."""
    from tracelock.kernels.credit_fuse import credit_fuse_triton

    N, V = 4, 500
    logits, _, _, _ = make_inputs(N, V, torch.float32)
    ref_credit = torch.full((N, V), float("nan"), device=DEVICE)
    tri_credit = ref_credit.clone()
    for step in range(3):
        boost = torch.tensor([True, step == 0, True, step == 0], device=DEVICE)
        fresh = torch.full((N,), step == 0, device=DEVICE)
        step_logits = logits + 0.3 * torch.randn(N, V, device=DEVICE)
        ref = credit_fuse_ref(step_logits, ref_credit, boost, fresh, 0.7, 1.0, 0.9)
        tri = credit_fuse_triton(step_logits, tri_credit, boost, fresh, 0.7, 1.0, 0.9, block_v=128)
        assert torch.equal(ref[0], tri[0])
        assert_close("confidence", ref[1], tri[1], atol=ATOL, rtol=RTOL)
        assert_close("credit", ref_credit, tri_credit, atol=ATOL, rtol=RTOL)
    # the boosted rows hold credit at their top-1 tokens only, one to three of them
    assert ((tri_credit > 0).sum(1) <= 3).all() and (tri_credit > 0).any(1).all()


def test_credit_fuse_ties_to_lowest_index(poisoned_empty):
    """Small-integer logits and credit make every value exact: equal maxima resolve to the lowest index, in the
    top-1 that gains the credit and in the fused argmax, within a tile and across tiles."""
    N, V = 4, 300
    logits = torch.randint(-4, 3, (N, V), device=DEVICE).float()
    credit = torch.zeros(N, V, device=DEVICE)
    ties = {0: [200, 20], 1: [7, 5, 6], 2: [130, 290], 3: [0, 255]}
    for r, cols in ties.items():
        logits[r, cols] = 5.0
    credit[2] = 0.5  # a decaying row whose credit ties too: the fused logits still tie
    boost = torch.tensor([True, False, False, True], device=DEVICE)
    fresh = torch.tensor([True, True, False, False], device=DEVICE)
    tri, tri_credit = run_both(logits, credit, boost, fresh, 0.7, 1.0, 0.9, block_v=128)
    assert tri[0].tolist() == [20, 5, 130, 0]
    # only a boosted row's lowest tied top-1 gains credit
    gained = (tri_credit > credit * 0.9).nonzero().tolist()
    assert gained == [[0, 20], [3, 0]]
    ref_credit = credit.clone()
    assert torch.equal(credit_fuse_ref(logits, ref_credit, boost, fresh, 0.7, 1.0, 0.9)[0], tri[0])


def test_credit_fuse_strided_logits():
    # the slots' rows as a view of a wider buffer: rows strided, each row contiguous
    logits, credit, boost, fresh = make_inputs(5, 1031, torch.bfloat16)
    wide = torch.randn(5, 1500, device=DEVICE).to(torch.bfloat16)
    wide[:, :1031] = logits
    ref_credit, tri_credit = credit.clone(), credit.clone()
    ref = credit_fuse_ref(logits, ref_credit, boost, fresh, 0.7, 1.0, 0.9)
    tri = ops.credit_fuse(wide[:, :1031], tri_credit, boost, fresh, 0.7, 1.0, 0.9, impl="triton")
    assert torch.equal(ref[0], tri[0])
    assert_close("confidence", ref[1], tri[1], atol=ATOL, rtol=RTOL)
    assert_close("credit", ref_credit, tri_credit, atol=ATOL, rtol=RTOL)


def test_credit_fuse_empty_and_single_token(poisoned_empty):
    from tracelock.kernels.credit_fuse import credit_fuse_triton

    empty = torch.zeros(0, 10, device=DEVICE)
    no_rows = torch.zeros(0, dtype=torch.bool, device=DEVICE)
    proposal, confidence = credit_fuse_triton(empty, empty.clone(), no_rows, no_rows, 0.7, 1.0, 0.9)
    assert proposal.shape == confidence.shape == (0,)
    logits = torch.randn(3, 1, device=DEVICE)
    credit = torch.ones(3, 1, device=DEVICE)
    flags = torch.tensor([True, False, True], device=DEVICE)
    tri, tri_credit = run_both(logits, credit, flags, ~flags, 0.7, 1.0, 0.9)
    assert tri[0].tolist() == [0, 0, 0] and tri[1].tolist() == [1.0, 1.0, 1.0]
    assert tri_credit[:, 0].tolist() == pytest.approx([1.9, 0.0, 1.9])


def test_credit_fuse_dispatch_torch_is_the_spec():
    logits, credit, boost, fresh = make_inputs(6, 300, torch.bfloat16)
    ref_credit, torch_credit = credit.clone(), credit.clone()
    ref = credit_fuse_ref(logits, ref_credit, boost, fresh, 0.7, 1.0, 0.9)
    got = ops.credit_fuse(logits, torch_credit, boost, fresh, 0.7, 1, 0.9, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and torch.equal(ref_credit, torch_credit)
    assert ops.IMPLEMENTATIONS["credit_fuse"] == ("triton", "torch")
    assert ops.pick("credit_fuse", None, torch.device(DEVICE)) == "triton"
    tri_credit = credit.clone()
    tri = ops.credit_fuse(logits, tri_credit, boost, fresh, 0.7, 1.0, 0.9, impl="triton")
    assert torch.equal(ref[0], tri[0])
    assert_close("credit", ref_credit, tri_credit, atol=ATOL, rtol=RTOL)


def test_credit_fuse_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_interpret", False)
    logits, credit, boost, fresh = (t.cpu() for t in make_inputs(2, 16, torch.float32))
    with pytest.raises(RuntimeError, match="impl='triton' cannot run credit_fuse: .*TRITON_INTERPRET=1"):
        ops.credit_fuse(logits, credit, boost, fresh, 0.7, 1.0, 0.9, impl="triton")


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        pytest.param(dict(logits=torch.zeros(2, 5, dtype=torch.int64)), TypeError, "logits must be float32",
                     id="logits-dtype"),
        pytest.param(dict(logits=torch.zeros(5)), ValueError, r"logits must be \[N, V\]", id="logits-1d"),
        pytest.param(dict(logits=torch.zeros(2, 0), credit=torch.zeros(2, 0)), ValueError, "V >= 1",
                     id="logits-empty"),
        pytest.param(dict(credit=torch.zeros(2, 5, dtype=torch.float64)), TypeError, "credit must be float32",
                     id="credit-dtype"),
        pytest.param(dict(credit=torch.zeros(2, 6)), ValueError, r"credit must have shape \[2, 5\]", id="credit-shape"),
        pytest.param(dict(credit=torch.zeros(5, 2).t()), ValueError, "credit must be contiguous",
                     id="credit-noncontig"),
        pytest.param(dict(credit=torch.zeros(2, 5, device="meta")), ValueError, "credit must be on cpu like logits",
                     id="credit-device"),
        pytest.param(dict(boost=torch.ones(2)), TypeError, "boost must be bool", id="boost-dtype"),
        pytest.param(dict(fresh=torch.ones(3, dtype=torch.bool)), ValueError, r"fresh must have shape \[2\]",
                     id="fresh-shape"),
        pytest.param(dict(alpha=float("nan")), ValueError, "alpha must be a finite number", id="alpha-nan"),
        pytest.param(dict(gamma="1"), ValueError, "gamma must be a finite number", id="gamma-str"),
        pytest.param(dict(beta=True), ValueError, "beta must be a finite number", id="beta-bool"),
    ],
)
def test_credit_fuse_validation(bad, exc, match):
    args = dict(logits=torch.zeros(2, 5), credit=torch.zeros(2, 5), boost=torch.ones(2, dtype=torch.bool),
                fresh=torch.zeros(2, dtype=torch.bool), alpha=0.7, gamma=1.0, beta=0.9) | bad
    with pytest.raises(exc, match=match):
        ops.credit_fuse(**args, impl="torch")
