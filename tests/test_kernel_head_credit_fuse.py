"""head_credit_fuse: Triton (interpreter on CPU) against head_credit_fuse_ref: vocabularies that are not a multiple of
the tile, several splits (forced with split_v) and two row tiles, fresh / decaying rows, boost on and off, a negative
fusion weight, ties at the top-1 and at the fused argmax within and across tiles and splits, the credit carried over
steps (updated in place), fp32 and bf16 inputs, R = 0, each autotune config, poisoned outputs, and the dispatcher."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import credit_fuse_ref, head_credit_fuse_ref
from tracelock.testing import assert_close

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# both compute in fp32 from exact upcasts; the head's sums over D and the softmax's over V run in another order
RTOL, ATOL = 1e-5, 1e-5
# (R, D, V, split_v): V a multiple of no tile; split_v forces several splits (a ragged last one), None takes the
# launcher's; R = 70 takes two row tiles
SHAPES = [(1, 32, 1000, None), (5, 48, 1031, 256), (9, 16, 300, 128), (70, 16, 1000, 384)]


def make_inputs(R, D, V, dtype):
    """Logits of a few units, credit in [0, 1) with a few large entries, and the four (boost, fresh) combinations."""
    hidden = torch.randn(R, D, device=DEVICE).to(dtype)
    weight = (torch.randn(V, D, device=DEVICE) * 3 / D**0.5).to(dtype)
    credit = torch.rand(R, V, device=DEVICE)
    credit[:, ::7] *= 10
    rows = torch.arange(R, device=DEVICE)
    return hidden, weight, credit, rows % 2 == 0, rows % 4 >= 2


def exact_head(logits, D=16):
    """(hidden, weight) whose product is exactly ``logits`` [R, V] (R <= D): one-hot rows against the logits as the
    weight's first R columns, so ties stay ties whatever the sum order."""
    R, V = logits.shape
    hidden = torch.eye(R, D, device=DEVICE)
    weight = torch.zeros(V, D, device=DEVICE)
    weight[:, :R] = logits.T
    return hidden, weight


def run_both(hidden, weight, credit, boost, fresh, alpha=0.7, gamma=1.0, beta=0.9, split_v=None, config=None):
    """Both implementations from copies of ``credit``; the outputs and the credit each leaves behind are compared.
    Returns the Triton outputs and credit."""
    from tracelock.kernels.head_credit_fuse import head_credit_fuse_triton

    ref_credit, tri_credit = credit.clone(), credit.clone()
    ref = head_credit_fuse_ref(hidden, weight, ref_credit, boost, fresh, alpha, gamma, beta)
    tri = head_credit_fuse_triton(hidden, weight, tri_credit, boost, fresh, alpha, gamma, beta, split_v=split_v,
                                  config=config)
    R = hidden.shape[0]
    assert tri[0].dtype == torch.int64 and tri[1].dtype == torch.float32 and tri[0].shape == tri[1].shape == (R,)
    assert_close("credit", ref_credit, tri_credit, atol=ATOL, rtol=RTOL)
    assert_close("confidence", ref[1], tri[1], atol=ATOL, rtol=RTOL)
    # the proposals agree wherever the top two fused logits are apart by more than the fp32 rounding of head and fusion
    fused = hidden.float() @ weight.float().T + alpha * torch.log(ref_credit + 1)
    top = fused.topk(min(2, fused.shape[1]), dim=1).values
    clear = top[:, 0] - top[:, -1] > 1e-4 * top[:, 0].abs().clamp_min(1) if top.shape[1] > 1 else top[:, 0] == top[:, 0]
    assert clear.any()
    assert torch.equal(ref[0][clear], tri[0][clear]), (ref[0], tri[0])
    return tri, tri_credit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("R, D, V, split_v", SHAPES, ids=[f"R{r}-D{d}-V{v}-split{s}" for r, d, v, s in SHAPES])
def test_head_credit_fuse_matches_ref(poisoned_empty, R, D, V, split_v, dtype):
    run_both(*make_inputs(R, D, V, dtype), split_v=split_v)


@pytest.mark.parametrize("alpha, gamma, beta", [(2.0, 0.5, 0.5), (-0.5, 2.0, 1.0)], ids=["strong", "negative"])
def test_head_credit_fuse_knobs(poisoned_empty, alpha, gamma, beta):
    run_both(*make_inputs(6, 32, 700, torch.float32), alpha, gamma, beta, split_v=256)


def test_head_credit_fuse_ref_is_credit_fuse_on_the_head():
    hidden, weight, credit, boost, fresh = make_inputs(5, 32, 300, torch.bfloat16)
    a, b = credit.clone(), credit.clone()
    ref = credit_fuse_ref(hidden.float() @ weight.float().T, a, boost, fresh, 0.7, 1.0, 0.9)
    got = head_credit_fuse_ref(hidden, weight, b, boost, fresh, 0.7, 1.0, 0.9)
    assert all(torch.equal(x, y) for x, y in zip(ref, got)) and torch.equal(a, b)


def test_head_credit_fuse_ties_to_lowest_index(poisoned_empty):
    """Exact logits (multiples of 0.5) and credit: equal maxima resolve to the lowest index in the top-1 that gains the
    credit and in the fused argmax, within a tile, across tiles and across splits (split 256, tile 64)."""
    R, V = 6, 1031
    logits = torch.randint(-8, 8, (R, V), device=DEVICE).float() / 2
    credit = torch.zeros(R, V, device=DEVICE)
    ties = {0: [700, 900], 1: [7, 5, 6], 2: [130, 1000], 3: [1030], 4: [0, 1, 2, 600], 5: [300, 40]}
    for r, cols in ties.items():
        logits[r, cols] = 5.0
    credit[2] = 0.5  # decaying, no boost: the credit ties too, so the fused logits still tie
    # the fused argmax is not the top-1, which gains credit all the same
    logits[4, 900], credit[4, 900] = 3.0, 1000.0
    boost = torch.tensor([True, False, False, True, True, True], device=DEVICE)
    fresh = torch.tensor([True, True, False, False, False, True], device=DEVICE)
    tri, tri_credit = run_both(*exact_head(logits), credit, boost, fresh, split_v=256)
    assert tri[0].tolist() == [700, 5, 130, 1030, 900, 40]
    gained = (tri_credit > credit * 0.9).nonzero().tolist()
    assert gained == [[0, 700], [3, 1030], [4, 0], [5, 40]]


def test_head_credit_fuse_negative_alpha_hands_the_top_to_the_runner_up(poisoned_empty):
    """alpha < 0: the boost lowers the top-1's fused logit (gamma 0 adds exactly 1: 5 - log 2 < 4.5), so the proposal
    is the best of the other columns, which the merge must know apart from the top-1 (here in another split)."""
    logits = torch.full((2, 600), -3.0, device=DEVICE)
    logits[:, 100] = 5.0
    logits[0, 500], logits[1, 50] = 4.5, 4.5
    boost = torch.tensor([True, False], device=DEVICE)
    fresh = torch.ones(2, dtype=torch.bool, device=DEVICE)
    tri, _ = run_both(*exact_head(logits), torch.zeros(2, 600, device=DEVICE), boost, fresh, -1.0, 0.0, 0.9,
                      split_v=256)
    assert tri[0].tolist() == [500, 100]


def test_head_credit_fuse_credit_carries_over_steps(poisoned_empty):
    """Fresh at the first step (the stale credit, NaN here, is never read), then decayed and boosted; each
    implementation's credit is its own next input."""
    from tracelock.kernels.head_credit_fuse import head_credit_fuse_triton

    hidden, weight, _, _, _ = make_inputs(4, 32, 500, torch.float32)
    ref_credit = torch.full((4, 500), float("nan"), device=DEVICE)
    tri_credit = ref_credit.clone()
    for step in range(3):
        boost = torch.tensor([True, step == 0, True, step == 0], device=DEVICE)
        fresh = torch.full((4,), step == 0, device=DEVICE)
        h = hidden + 0.3 * torch.randn_like(hidden)
        ref = head_credit_fuse_ref(h, weight, ref_credit, boost, fresh, 0.7, 1.0, 0.9)
        tri = head_credit_fuse_triton(h, weight, tri_credit, boost, fresh, 0.7, 1.0, 0.9, split_v=256)
        assert torch.equal(ref[0], tri[0])
        assert_close("confidence", ref[1], tri[1], atol=ATOL, rtol=RTOL)
        assert_close("credit", ref_credit, tri_credit, atol=ATOL, rtol=RTOL)
    assert ((tri_credit > 0).sum(1) <= 3).all() and (tri_credit > 0).any(1).all()


def test_head_credit_fuse_empty_and_single_token(poisoned_empty):
    from tracelock.kernels.head_credit_fuse import head_credit_fuse_triton

    no_rows = torch.zeros(0, dtype=torch.bool, device=DEVICE)
    out = head_credit_fuse_triton(torch.zeros(0, 16, device=DEVICE), torch.zeros(10, 16, device=DEVICE),
                                  torch.zeros(0, 10, device=DEVICE), no_rows, no_rows, 0.7, 1.0, 0.9)
    assert out[0].shape == out[1].shape == (0,)
    hidden, weight, _, _, _ = make_inputs(3, 16, 1, torch.float32)
    flags = torch.tensor([True, False, True], device=DEVICE)
    tri, tri_credit = run_both(hidden, weight, torch.ones(3, 1, device=DEVICE), flags, ~flags)
    assert tri[0].tolist() == [0, 0, 0] and tri[1].tolist() == [1.0, 1.0, 1.0]
    assert tri_credit[:, 0].tolist() == pytest.approx([1.9, 0.0, 1.9])


@pytest.mark.parametrize("config", range(3), ids=lambda i: f"cfg{i}")
def test_head_credit_fuse_every_config(poisoned_empty, config):
    # each autotune config on its own (the interpreter takes only the first): two row tiles, a ragged last split
    from tracelock.kernels.head_credit_fuse import CONFIGS

    assert len(CONFIGS) == 3
    run_both(*make_inputs(66, 32, 700, torch.bfloat16), split_v=320, config=config)


def test_head_credit_fuse_dispatch():
    hidden, weight, credit, boost, fresh = make_inputs(6, 32, 300, torch.bfloat16)
    ref_credit, torch_credit, tri_credit = credit.clone(), credit.clone(), credit.clone()
    ref = head_credit_fuse_ref(hidden, weight, ref_credit, boost, fresh, 0.7, 1.0, 0.9)
    got = ops.head_credit_fuse(hidden, weight, torch_credit, boost, fresh, 0.7, 1, 0.9, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and torch.equal(ref_credit, torch_credit)
    assert ops.IMPLEMENTATIONS["head_credit_fuse"] == ("triton", "torch")
    assert ops.pick("head_credit_fuse", None, torch.device(DEVICE)) == "triton"
    # rows strided (a view of a wider buffer), each row contiguous
    wide = torch.cat([hidden, hidden], 1)[:, :32]
    tri = ops.head_credit_fuse(wide, weight, tri_credit, boost, fresh, 0.7, 1.0, 0.9, impl="triton")
    assert torch.equal(ref[0], tri[0])
    assert_close("credit", ref_credit, tri_credit, atol=ATOL, rtol=RTOL)


def test_head_credit_fuse_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_interpret", False)
    args = [t.cpu() for t in make_inputs(2, 16, 16, torch.float32)]
    with pytest.raises(RuntimeError, match="impl='triton' cannot run head_credit_fuse: .*TRITON_INTERPRET=1"):
        ops.head_credit_fuse(*args, 0.7, 1.0, 0.9, impl="triton")


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        pytest.param(dict(hidden=torch.zeros(2, 8, dtype=torch.int32)), TypeError, "hidden must be float32",
                     id="hidden-dtype"),
        pytest.param(dict(weight=torch.zeros(5, 9)), ValueError, r"weight must be \[V, D\] with V >= 1 and D = 8",
                     id="weight-width"),
        pytest.param(dict(credit=torch.zeros(2, 5, dtype=torch.float64)), TypeError, "credit must be float32",
                     id="credit-dtype"),
        pytest.param(dict(credit=torch.zeros(2, 6)), ValueError, r"credit must have shape \[2, 5\]", id="credit-shape"),
        pytest.param(dict(credit=torch.zeros(5, 2).t()), ValueError, "credit must be contiguous",
                     id="credit-noncontig"),
        pytest.param(dict(boost=torch.ones(2)), TypeError, "boost must be bool", id="boost-dtype"),
        pytest.param(dict(fresh=torch.ones(3, dtype=torch.bool)), ValueError, r"fresh must have shape \[2\]",
                     id="fresh-shape"),
        pytest.param(dict(alpha=float("inf")), ValueError, "alpha must be a finite number", id="alpha-inf"),
    ],
)
def test_head_credit_fuse_validation(bad, exc, match):
    args = dict(hidden=torch.zeros(2, 8), weight=torch.zeros(5, 8), credit=torch.zeros(2, 5),
                boost=torch.ones(2, dtype=torch.bool), fresh=torch.zeros(2, dtype=torch.bool), alpha=0.7, gamma=1.0,
                beta=0.9) | bad
    with pytest.raises(exc, match=match):
        ops.head_credit_fuse(**args, impl="torch")
