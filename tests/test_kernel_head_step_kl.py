"""head_step_kl: the spec against step_kl_ref (within V·1e-12, the eps it drops), then Triton (interpreter on CPU)
against head_step_kl_ref: vocabularies that are not a multiple of the tile, several splits (forced with split_v) and
two row tiles, rows with and without a previous pass (whose stale memory is never read), ties at the argmax across
tiles and splits, the memory carried over steps (overwritten in place), fp32 and bf16 inputs, R = 0, each autotune
config, poisoned outputs, and the dispatcher."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import head_step_kl_ref, step_kl_ref
from tracelock.testing import assert_close

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the kernel computes in fp32, the spec in fp64 from the same fp32 logits; a row with no previous pass has a KL of
# about 27.6 = -log(1e-12), so rtol carries it
RTOL, ATOL = 1e-5, 1e-5
# (R, D, V, split_v): as test_kernel_head_credit_fuse's
SHAPES = [(1, 32, 1000, None), (5, 48, 1031, 256), (9, 16, 300, 128), (70, 16, 1000, 384)]
INF = float("inf")


def make_inputs(R, D, V, dtype):
    """The head, and a memory from nearby logits: none in every third row (+inf, its stale logits NaN)."""
    hidden = torch.randn(R, D, device=DEVICE).to(dtype)
    weight = (torch.randn(V, D, device=DEVICE) * 3 / D**0.5).to(dtype)
    prev_logits = hidden.float() @ weight.float().T + torch.randn(R, V, device=DEVICE)
    prev_lse = torch.logsumexp(prev_logits, -1)
    none = torch.arange(R, device=DEVICE) % 3 == 1
    prev_logits[none], prev_lse[none] = float("nan"), INF
    return hidden, weight, prev_logits, prev_lse


def exact_head(logits, D=16):
    """(hidden, weight) whose product is exactly ``logits`` [R, V] (R <= D), so ties stay ties."""
    R, V = logits.shape
    hidden = torch.eye(R, D, device=DEVICE)
    weight = torch.zeros(V, D, device=DEVICE)
    weight[:, :R] = logits.T
    return hidden, weight


def run_both(hidden, weight, prev_logits, prev_lse, split_v=None, config=None):
    """Both implementations from copies of the memory; the outputs and the memory each leaves behind are compared.
    Returns the Triton outputs and memory."""
    from tracelock.kernels.head_step_kl import head_step_kl_triton

    ref_mem, tri_mem = (prev_logits.clone(), prev_lse.clone()), (prev_logits.clone(), prev_lse.clone())
    ref = head_step_kl_ref(hidden, weight, *ref_mem)
    tri = head_step_kl_triton(hidden, weight, *tri_mem, split_v=split_v, config=config)
    R = hidden.shape[0]
    assert tri[0].dtype == torch.int64 and tri[1].dtype == tri[2].dtype == torch.float32
    assert all(t.shape == (R,) for t in tri)
    for name, r, t in zip(("confidence", "kl", "prev_logits", "prev_lse"), (*ref[1:], *ref_mem), (*tri[1:], *tri_mem)):
        assert_close(name, r, t, atol=ATOL, rtol=RTOL)
    logits = hidden.float() @ weight.float().T
    top = logits.topk(min(2, logits.shape[1]), dim=1).values
    clear = top[:, 0] - top[:, -1] > 1e-4 if top.shape[1] > 1 else torch.ones(R, dtype=torch.bool)
    assert clear.any()
    assert torch.equal(ref[0][clear], tri[0][clear]), (ref[0], tri[0])
    return tri, tri_mem


@pytest.mark.parametrize("first", [False, True], ids=["with-prev", "first-pass"])
def test_head_step_kl_ref_is_step_kl_but_its_own_eps(first):
    """On the distribution the memory stands for, the KL differs from step_kl_ref's only by the eps it drops from the
    current distribution's log: sum p log(1 + eps / p), in (0, V·1e-12]; the proposal and confidence agree. The
    memory's logsumexp in fp64 keeps the comparison's digits."""
    R, D, V = 5, 32, 1000
    hidden, weight, prev_logits, _ = make_inputs(R, D, V, torch.float32)
    prev_logits = torch.where(prev_logits.isnan(), torch.randn(R, V, device=DEVICE), prev_logits)
    prev_lse = torch.logsumexp(prev_logits.double(), -1)
    if first:
        prev_lse[:] = INF
    prev = torch.where(prev_lse[:, None] == INF, 0.0, (prev_logits.double() - prev_lse[:, None]).exp())
    ref = step_kl_ref(hidden.float() @ weight.float().T, prev)
    got = head_step_kl_ref(hidden, weight, prev_logits.clone(), prev_lse.clone())
    assert torch.equal(ref[0], got[0])
    assert_close("confidence", ref[1], got[1], atol=1e-15)
    gap = ref[2] - got[2]
    assert (gap > 0).all() and (gap <= V * 1e-12 + 1e-13).all(), gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("R, D, V, split_v", SHAPES, ids=[f"R{r}-D{d}-V{v}-split{s}" for r, d, v, s in SHAPES])
def test_head_step_kl_matches_ref(poisoned_empty, R, D, V, split_v, dtype):
    run_both(*make_inputs(R, D, V, dtype), split_v=split_v)


def test_head_step_kl_memory_carries_over_steps(poisoned_empty):
    """A first pass (no memory: NaN logits, +inf), then two steps on nearby hidden states; each implementation's
    memory is its own next input. A repeated step has no drift."""
    from tracelock.kernels.head_step_kl import head_step_kl_triton

    hidden, weight, _, _ = make_inputs(4, 32, 500, torch.float32)
    ref_mem = (torch.full((4, 500), float("nan"), device=DEVICE), torch.full((4,), INF, device=DEVICE))
    tri_mem = tuple(t.clone() for t in ref_mem)
    for step in range(3):
        h = hidden + 0.3 * step * torch.randn_like(hidden)
        ref = head_step_kl_ref(h, weight, *ref_mem)
        tri = head_step_kl_triton(h, weight, *tri_mem, split_v=256)
        assert torch.equal(ref[0], tri[0])
        for name, r, t in zip(("confidence", "kl", "prev_logits", "prev_lse"), (*ref[1:], *ref_mem),
                              (*tri[1:], *tri_mem)):
            assert_close(name, r, t, atol=ATOL, rtol=RTOL)
    again = head_step_kl_triton(h, weight, *tri_mem, split_v=256)
    assert_close("kl", torch.zeros(4), again[2], atol=ATOL)


def test_head_step_kl_ties_to_lowest_index(poisoned_empty):
    # exact logits: equal maxima within a tile, across tiles and across splits (split 256, tile 64)
    logits = torch.randint(-8, 8, (4, 1031), device=DEVICE).float() / 2
    ties = {0: [700, 900], 1: [7, 5, 6], 2: [130, 1000], 3: [1030]}
    for r, cols in ties.items():
        logits[r, cols] = 5.0
    hidden, weight = exact_head(logits)
    prev_logits = torch.randn(4, 1031, device=DEVICE)
    tri, _ = run_both(hidden, weight, prev_logits, torch.logsumexp(prev_logits, -1), split_v=256)
    assert tri[0].tolist() == [700, 5, 130, 1030]


def test_head_step_kl_empty_and_single_token(poisoned_empty):
    from tracelock.kernels.head_step_kl import head_step_kl_triton

    out = head_step_kl_triton(torch.zeros(0, 16, device=DEVICE), torch.zeros(10, 16, device=DEVICE),
                              torch.zeros(0, 10, device=DEVICE), torch.zeros(0, device=DEVICE))
    assert all(t.shape == (0,) for t in out)
    hidden, weight, _, _ = make_inputs(3, 16, 1, torch.float32)
    prev_lse = torch.tensor([0.0, INF, 0.0], device=DEVICE)
    tri, _ = run_both(hidden, weight, torch.zeros(3, 1, device=DEVICE), prev_lse)
    assert tri[0].tolist() == [0, 0, 0] and tri[1].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("config", range(3), ids=lambda i: f"cfg{i}")
def test_head_step_kl_every_config(poisoned_empty, config):
    from tracelock.kernels.head_step_kl import CONFIGS

    assert len(CONFIGS) == 3
    run_both(*make_inputs(66, 32, 700, torch.bfloat16), split_v=320, config=config)


def test_head_step_kl_dispatch():
    hidden, weight, prev_logits, prev_lse = make_inputs(6, 32, 300, torch.bfloat16)
    ref_mem, torch_mem, tri_mem = ((prev_logits.clone(), prev_lse.clone()) for _ in range(3))
    ref = head_step_kl_ref(hidden, weight, *ref_mem)
    got = ops.head_step_kl(hidden, weight, *torch_mem, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip((*ref, *ref_mem), (*got, *torch_mem)))
    assert ops.IMPLEMENTATIONS["head_step_kl"] == ("triton", "torch")
    assert ops.pick("head_step_kl", None, torch.device(DEVICE)) == "triton"
    tri = ops.head_step_kl(torch.cat([hidden, hidden], 1)[:, :32], weight, *tri_mem, impl="triton")
    assert torch.equal(ref[0], tri[0])
    assert_close("kl", ref[2], tri[2], atol=ATOL, rtol=RTOL)


def test_head_step_kl_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_interpret", False)
    args = [t.cpu() for t in make_inputs(2, 16, 16, torch.float32)]
    with pytest.raises(RuntimeError, match="impl='triton' cannot run head_step_kl: .*TRITON_INTERPRET=1"):
        ops.head_step_kl(*args, impl="triton")


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        pytest.param(dict(hidden=torch.zeros(2, 8, 1)), ValueError, r"hidden must be \[R, D\]", id="hidden-3d"),
        pytest.param(dict(prev_logits=torch.zeros(2, 5, dtype=torch.float64)), TypeError,
                     "prev_logits must be float32", id="logits-dtype"),
        pytest.param(dict(prev_logits=torch.zeros(2, 6)), ValueError, r"prev_logits must have shape \[2, 5\]",
                     id="logits-shape"),
        pytest.param(dict(prev_logits=torch.zeros(5, 2).t()), ValueError, "prev_logits must be contiguous",
                     id="logits-noncontig"),
        pytest.param(dict(prev_lse=torch.zeros(2, dtype=torch.float64)), TypeError, "prev_lse must be float32",
                     id="lse-dtype"),
        pytest.param(dict(prev_lse=torch.zeros(3)), ValueError, r"prev_lse must have shape \[2\]", id="lse-shape"),
    ],
)
def test_head_step_kl_validation(bad, exc, match):
    args = dict(hidden=torch.zeros(2, 8), weight=torch.zeros(5, 8), prev_logits=torch.zeros(2, 5),
                prev_lse=torch.zeros(2)) | bad
    with pytest.raises(exc, match=match):
        ops.head_step_kl(**args, impl="torch")
