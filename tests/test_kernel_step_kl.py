"""step_kl: Triton (interpreter on CPU) against step_kl_ref: rows with and without a previous pass, prev in fp32 (a
GPU's) and fp64 (the spec's), ties within and across vocabulary tiles, a vocabulary that is not a multiple of the
tile, prev carried over steps (overwritten in place), poisoned outputs, and the dispatcher."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import step_kl_ref
from tracelock.testing import assert_close

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the kernel computes in prev's dtype: fp64 prev meets the spec (fp64) to its rounding, fp32 prev to fp32's (the KL
# of a slot with no previous pass is about 27.6 = -log(1e-12))
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}
# (N, V, block_v): V a multiple of no tile (several tiles, the last ragged), one exact tile, the launcher's tile
SHAPES = [(4, 1000, 256), (6, 300, 128), (3, 64, None), (5, 1031, None)]


def make_inputs(N, V, dtype, prev_dtype):
    """Logits of a few units (a -inf token in row 0) and prev: zeros (no previous pass) in the odd rows, the softmax
    of nearby logits (the previous step's) in the even ones, and this step's own distribution in row 2."""
    logits = (torch.randn(N, V, device=DEVICE) * 3).to(dtype)
    logits[0, V // 3] = float("-inf")
    prev = (logits.double() + torch.randn(N, V, device=DEVICE).double()).softmax(-1).to(prev_dtype)
    prev[1::2] = 0
    if N > 2:
        prev[2] = logits[2].double().softmax(-1)
    return logits, prev


def run_both(logits, prev, block_v=None):
    """Both implementations from copies of ``prev``: the outputs and the prev each left behind are compared;
    returns the Triton outputs and prev."""
    from tracelock.kernels.step_kl import step_kl_triton

    ref_prev, tri_prev = prev.clone(), prev.clone()
    ref = step_kl_ref(logits, ref_prev)
    tri = step_kl_triton(logits, tri_prev, block_v=block_v)
    assert tri[0].dtype == torch.int64 and tri[1].dtype == tri[2].dtype == prev.dtype
    assert all(t.shape == (logits.shape[0],) for t in tri)
    tol = TOL[prev.dtype]
    # the argmax of the logits, exact in every dtype
    assert torch.equal(ref[0], tri[0]), (ref[0], tri[0])
    assert_close("confidence", ref[1], tri[1], **tol)
    assert_close("kl", ref[2], tri[2], **tol)
    assert_close("prev", ref_prev, tri_prev, **tol)
    return tri, tri_prev


@pytest.mark.parametrize("prev_dtype", [torch.float32, torch.float64], ids=["prev-fp32", "prev-fp64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N, V, block_v", SHAPES, ids=[f"N{n}-V{v}-tile{b}" for n, v, b in SHAPES])
def test_step_kl_matches_ref(poisoned_empty, N, V, block_v, dtype, prev_dtype):
    logits, prev = make_inputs(N, V, dtype, prev_dtype)
    tri, _ = run_both(logits, prev, block_v)
    if N > 2:
        # no previous pass: KL = -H(p) - log(1e-12), large; the same distribution: 0
        assert bool((tri[2][1::2] > 20).all()) and abs(float(tri[2][2])) < 1e-5


@pytest.mark.parametrize("prev_dtype", [torch.float32, torch.float64], ids=["prev-fp32", "prev-fp64"])
def test_step_kl_prev_carries_over_steps(poisoned_empty, prev_dtype):
    """A slot's distribution across steps: zeros before its first pass, then each step's KL against the distribution
    the step before left in place, in each implementation's own state."""
    from tracelock.kernels.step_kl import step_kl_triton

    N, V = 3, 500
    logits, _ = make_inputs(N, V, torch.float32, prev_dtype)
    ref_prev = torch.zeros(N, V, dtype=prev_dtype, device=DEVICE)
    tri_prev = ref_prev.clone()
    for step in range(3):
        step_logits = logits + 0.3 * step * torch.randn(N, V, device=DEVICE)
        ref = step_kl_ref(step_logits, ref_prev)
        tri = step_kl_triton(step_logits, tri_prev, block_v=128)
        assert torch.equal(ref[0], tri[0])
        for name, r, t in (("confidence", ref[1], tri[1]), ("kl", ref[2], tri[2]), ("prev", ref_prev, tri_prev)):
            assert_close(name, r, t, **TOL[prev_dtype])
        assert bool((tri[2] > 20).all()) if step == 0 else bool((tri[2] < 1).all())


def test_step_kl_ties_to_lowest_index(poisoned_empty):
    # equal maxima resolve to the lowest index, within a tile and across tiles
    N, V = 4, 300
    logits = torch.randint(-4, 3, (N, V), device=DEVICE).float()
    ties = {0: [200, 20], 1: [7, 5, 6], 2: [130, 290], 3: [0, 255]}
    for r, cols in ties.items():
        logits[r, cols] = 5.0
    prev = torch.zeros(N, V, device=DEVICE)
    tri, _ = run_both(logits, prev, block_v=128)
    assert tri[0].tolist() == [20, 5, 130, 0]
    flat, _ = run_both(torch.zeros(2, 300, device=DEVICE), torch.full((2, 300), 1 / 300, device=DEVICE), block_v=128)
    assert flat[0].tolist() == [0, 0]


def test_step_kl_strided_logits():
    # the slots' rows as a view of a wider buffer: rows strided, each row contiguous
    logits, prev = make_inputs(5, 1031, torch.bfloat16, torch.float32)
    wide = torch.randn(5, 1500, device=DEVICE).to(torch.bfloat16)
    wide[:, :1031] = logits
    ref_prev, tri_prev = prev.clone(), prev.clone()
    ref = step_kl_ref(logits, ref_prev)
    tri = ops.step_kl(wide[:, :1031], tri_prev, impl="triton")
    assert torch.equal(ref[0], tri[0])
    for name, r, t in (("confidence", ref[1], tri[1]), ("kl", ref[2], tri[2]), ("prev", ref_prev, tri_prev)):
        assert_close(name, r, t, **TOL[torch.float32])


def test_step_kl_empty_and_single_token(poisoned_empty):
    from tracelock.kernels.step_kl import step_kl_triton

    proposal, confidence, kl = step_kl_triton(torch.zeros(0, 10, device=DEVICE), torch.zeros(0, 10, device=DEVICE))
    assert proposal.shape == confidence.shape == kl.shape == (0,)
    prev = torch.tensor([[0.0], [1.0]], device=DEVICE)
    tri, tri_prev = run_both(torch.randn(2, 1, device=DEVICE), prev)
    assert tri[0].tolist() == [0, 0] and tri[1].tolist() == [1.0, 1.0] and tri_prev.tolist() == [[1.0], [1.0]]


def test_step_kl_dispatch_torch_is_the_spec():
    for prev_dtype in (torch.float32, torch.float64):
        logits, prev = make_inputs(6, 300, torch.bfloat16, prev_dtype)
        ref_prev, torch_prev = prev.clone(), prev.clone()
        ref = step_kl_ref(logits, ref_prev)
        got = ops.step_kl(logits, torch_prev, impl="torch")
        assert all(torch.equal(a, b) for a, b in zip(ref, got)) and torch.equal(ref_prev, torch_prev)
    assert ops.IMPLEMENTATIONS["step_kl"] == ("triton", "torch")
    assert ops.pick("step_kl", None, torch.device(DEVICE)) == "triton"
    tri_prev = prev.clone()
    tri = ops.step_kl(logits, tri_prev, impl="triton")
    assert torch.equal(ref[0], tri[0])
    assert_close("prev", ref_prev, tri_prev, **TOL[torch.float64])


def test_step_kl_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_available", False)
    logits, prev = (t.cpu() for t in make_inputs(2, 16, torch.float32, torch.float32))
    with pytest.raises(RuntimeError, match="impl='triton' cannot run step_kl: triton is not installed"):
        ops.step_kl(logits, prev, impl="triton")


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        pytest.param(dict(logits=torch.zeros(2, 5, dtype=torch.int32)), TypeError, "logits must be float32",
                     id="logits-dtype"),
        pytest.param(dict(logits=torch.zeros(1, 2, 5)), ValueError, r"logits must be \[N, V\]", id="logits-3d"),
        pytest.param(dict(logits=torch.zeros(2, 0), prev=torch.zeros(2, 0)), ValueError, "V >= 1", id="logits-empty"),
        pytest.param(dict(logits=torch.zeros(5, 2).t()), ValueError, "logits must be contiguous",
                     id="logits-column-strided"),
        pytest.param(dict(prev=torch.zeros(2, 5, dtype=torch.bfloat16)), TypeError, "prev must be float32 or float64",
                     id="prev-dtype"),
        pytest.param(dict(prev=torch.zeros(3, 5)), ValueError, r"prev must have shape \[2, 5\]", id="prev-shape"),
        pytest.param(dict(prev=torch.zeros(5, 2).t()), ValueError, "prev must be contiguous", id="prev-noncontig"),
        pytest.param(dict(prev=torch.zeros(2, 5, device="meta")), ValueError, "prev must be on cpu like logits",
                     id="prev-device"),
        pytest.param(dict(prev=[[0.0] * 5] * 2), TypeError, "prev must be a torch.Tensor", id="prev-list"),
    ],
)
def test_step_kl_validation(bad, exc, match):
    args = dict(logits=torch.zeros(2, 5), prev=torch.zeros(2, 5)) | bad
    with pytest.raises(exc, match=match):
        ops.step_kl(**args, impl="torch")
