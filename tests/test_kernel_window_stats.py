"""window_logits_stats: Triton (interpreter on CPU) against window_logits_stats_ref, the ref against
tracelock.signals.compute_signals, ties, split merging, poisoned outputs, and the dispatcher."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import window_logits_stats_ref
from tracelock.signals import compute_signals
from tracelock.testing import assert_close

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the kernel and the ref both compute in fp32 from exact upcasts of the inputs; only the summation order over D
# and V differs, so every input dtype meets the fp32 tolerance
RTOL, ATOL = 1e-5, 1e-5
NAMES = ("max_prob", "second_prob", "neg_entropy", "eos_prob")
# (R, D, V, split_v): V not a multiple of the 128-column tile; split_v forces several vocabulary splits whose
# merge is then tested, None takes the launcher's choice; R = 129 needs two row tiles
SHAPES = [(1, 64, 1000, None), (5, 48, 1031, 256), (63, 32, 1000, 384), (3, 16, 6151, None), (129, 16, 1000, None)]


def make_inputs(R, D, V, dtype):
    # logits of unit-ish scale: the softmax is neither flat nor saturated
    hidden = torch.randn(R, D, device=DEVICE).to(dtype)
    weight = (torch.randn(V, D, device=DEVICE) * 2 / D**0.5).to(dtype)
    return hidden, weight


def triton_stats(hidden, weight, eos_id, split_v=None):
    from tracelock.kernels.window_logits_stats import window_logits_stats_triton

    return window_logits_stats_triton(hidden, weight, eos_id, split_v=split_v)


def check_against_ref(ref, tri, hidden, weight):
    for name, r, t in zip(NAMES, ref[1:], tri[1:]):
        assert t.dtype == torch.float32
        assert_close(name, r, t, atol=ATOL, rtol=RTOL)
    # the argmax must agree wherever the top two logits are apart by more than the fp32 sum-order error
    logits = hidden.float() @ weight.float().T
    top = logits.topk(min(2, logits.shape[1]), dim=1).values
    clear = (top[:, 0] - top[:, -1] > 1e-4) if top.shape[1] > 1 else torch.ones_like(top[:, 0], dtype=torch.bool)
    assert clear.any()
    assert torch.equal(ref[0][clear], tri[0][clear])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("R, D, V, split_v", SHAPES, ids=[f"R{r}-D{d}-V{v}-split{s}" for r, d, v, s in SHAPES])
def test_window_logits_stats_matches_ref(poisoned_empty, R, D, V, split_v, dtype):
    hidden, weight = make_inputs(R, D, V, dtype)
    eos_id = V - 2
    ref = window_logits_stats_ref(hidden, weight, eos_id)
    tri = triton_stats(hidden, weight, eos_id, split_v)
    assert tri[0].dtype == torch.int64 and all(t.shape == (R,) for t in tri)
    check_against_ref(ref, tri, hidden, weight)


@pytest.mark.parametrize("eos_id", [None, 0, 999], ids=["no-eos", "eos-first", "eos-last"])
def test_window_logits_stats_eos(poisoned_empty, eos_id):
    hidden, weight = make_inputs(7, 32, 1000, torch.float32)
    ref = window_logits_stats_ref(hidden, weight, eos_id)
    tri = triton_stats(hidden, weight, eos_id, split_v=256)
    check_against_ref(ref, tri, hidden, weight)
    if eos_id is None:
        assert torch.equal(tri[4], torch.zeros_like(tri[4]))


def test_window_logits_stats_ties_to_lowest_index(poisoned_empty):
    """Small-integer inputs make every logit exact, whatever the sum order: equal maxima must resolve to the
    lowest index, within a tile, across tiles and across splits, and then p2 == p1."""
    R, D, V = 5, 32, 1031
    hidden = torch.randint(-2, 3, (R, D), device=DEVICE).float()
    weight = torch.randint(-1, 2, (V, D), device=DEVICE).float()
    best = torch.sign(hidden)  # logit = |hidden|.sum(), above any other row of {-1, 0, 1} entries
    ties = {0: [700, 900], 1: [3, 5], 2: [130, 1000], 3: [1030], 4: [0, 1, 2, 600]}
    for r, cols in ties.items():
        weight[cols] = best[r]
    ref = window_logits_stats_ref(hidden, weight, 3)
    tri = triton_stats(hidden, weight, 3, split_v=256)
    assert tri[0].tolist() == [700, 3, 130, 1030, 0]
    assert torch.equal(ref[0], tri[0])
    for r, cols in ties.items():
        if len(cols) > 1:
            assert tri[1][r] == tri[2][r]
    for name, r, t in zip(NAMES, ref[1:], tri[1:]):
        assert_close(name, r, t, atol=ATOL, rtol=RTOL)


def test_window_logits_stats_strided_rows():
    # the window's rows gathered as a view of a wider buffer: rows strided, each row contiguous
    base, weight = make_inputs(9, 64, 1031, torch.bfloat16)
    hidden = base[:, :32]
    weight = weight[:, :32].contiguous()
    check_against_ref(window_logits_stats_ref(hidden, weight, 1), ops.window_logits_stats(hidden, weight, 1,
                      impl="triton"), hidden, weight)


def test_window_logits_stats_single_token_vocab(poisoned_empty):
    hidden, weight = make_inputs(3, 16, 1, torch.float32)
    tri = triton_stats(hidden, weight, 0)
    assert tri[0].tolist() == [0, 0, 0]
    for t, want in zip(tri[1:], (1.0, 0.0, 0.0, 1.0)):
        assert torch.equal(t, torch.full_like(t, want))


@pytest.mark.parametrize("V", [126464, 152064], ids=["llada-vocab", "dream-vocab"])
def test_window_logits_stats_real_vocab(V):
    if not torch.cuda.is_available():
        pytest.skip("too large for the Triton interpreter (about 30 ms per 128-column tile on CPU)")
    hidden, weight = make_inputs(64, 4096, V, torch.bfloat16)
    ref = window_logits_stats_ref(hidden, weight, 2)
    tri = triton_stats(hidden, weight, 2)
    check_against_ref(ref, tri, hidden, weight)


@pytest.mark.parametrize("eos_id", [None, 5])
def test_window_logits_stats_ref_matches_compute_signals(eos_id):
    hidden, weight = make_inputs(9, 32, 1031, torch.bfloat16)
    hidden[4] = 0  # a flat row: every token ties, the proposal is token 0
    proposal, max_prob, second_prob, neg_entropy, eos_prob = window_logits_stats_ref(hidden, weight, eos_id)
    sig = compute_signals((hidden.float() @ weight.float().T)[None], eos_id=eos_id, temperature=0.0)
    assert torch.equal(proposal, sig.proposal[0]) and proposal[4] == 0
    assert torch.equal(max_prob, sig.confidence[0])
    assert torch.equal(max_prob - second_prob, sig.margin[0])
    assert torch.equal(neg_entropy, sig.neg_entropy[0])
    assert torch.equal(eos_prob, sig.eos_prob[0])


def test_window_logits_stats_dispatch_torch_equals_triton():
    hidden, weight = make_inputs(63, 32, 1000, torch.bfloat16)
    torch_out = ops.window_logits_stats(hidden, weight, 7, impl="torch")
    tri_out = ops.window_logits_stats(hidden, weight, 7, impl="triton")
    check_against_ref(torch_out, tri_out, hidden, weight)
    assert ops.pick("window_logits_stats", None, torch.device(DEVICE)) == "triton"


def test_window_logits_stats_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_interpret", False)
    hidden, weight = (t.cpu() for t in make_inputs(3, 16, 100, torch.float32))
    with pytest.raises(RuntimeError, match="impl='triton' cannot run window_logits_stats: .*TRITON_INTERPRET=1"):
        ops.window_logits_stats(hidden, weight, 0, impl="triton")


@pytest.mark.parametrize(
    "case, exc, match",
    [
        pytest.param(dict(hidden=torch.zeros(4, 8, dtype=torch.int32)), TypeError, "hidden must be float32",
                     id="hidden-dtype"),
        pytest.param(dict(weight=torch.zeros(10, 9)), ValueError, r"weight must be \[V, D\] with V >= 1 and D = 8",
                     id="weight-width"),
        pytest.param(dict(weight=torch.zeros(0, 8)), ValueError, r"weight must be \[V, D\] with V >= 1",
                     id="weight-empty"),
        pytest.param(dict(eos_id=10), ValueError, r"eos_id must be None or an int in \[0, 10\)", id="eos-range"),
        pytest.param(dict(eos_id=-1), ValueError, r"eos_id must be None or an int in \[0, 10\)", id="eos-negative"),
        pytest.param(dict(eos_id=2.0), ValueError, "eos_id must be None or an int", id="eos-float"),
        pytest.param(dict(weight=torch.zeros(8, 10).t()), ValueError, "weight must be contiguous",
                     id="weight-noncontig"),
    ],
)
def test_window_logits_stats_validation(case, exc, match):
    args = dict(hidden=torch.zeros(4, 8), weight=torch.zeros(10, 8), eos_id=1) | case
    with pytest.raises(exc, match=match):
        ops.window_logits_stats(**args, impl="torch")


@pytest.mark.parametrize("config", range(5), ids=lambda i: f"cfg{i}")
def test_window_logits_stats_every_config(poisoned_empty, config):
    # each autotune config on its own (the interpreter and TRACELOCK_SKIP_AUTOTUNE take only the first): two row
    # tiles, several splits of which the last is ragged, so every tile shape meets the masks and the merge
    from tracelock.kernels.window_logits_stats import CONFIGS, window_logits_stats_triton

    assert len(CONFIGS) == 5
    hidden, weight = make_inputs(130, 160, 1400, torch.bfloat16)
    ref = window_logits_stats_ref(hidden, weight, 1398)
    tri = window_logits_stats_triton(hidden, weight, 1398, split_v=384, config=config)
    check_against_ref(ref, tri, hidden, weight)
