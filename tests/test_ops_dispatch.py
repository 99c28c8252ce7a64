"""tracelock.ops: implementation selection, TRACELOCK_IMPL, error texts, and input validation."""

import pytest
import torch

from tracelock import _ext, ops
from tracelock.kernels.ref import apply_commits_ref
from tracelock.states import ACTIVE, LOCKED

IMPLS = ("torch", "cpp", "cuda")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def fake_ext(monkeypatch, cpp, cuda):
    monkeypatch.setattr(_ext, "has_cpp", lambda: cpp)
    monkeypatch.setattr(_ext, "has_cuda_ext", lambda: cuda)


def make_inputs(B=2, L=8):
    x = torch.randint(0, 20, (B, L))
    state = torch.full((B, L), ACTIVE, dtype=torch.uint8)
    state[:, :2] = LOCKED
    proposal = torch.randint(0, 20, (B, L))
    commit = torch.rand(B, L) < 0.5
    return x, state, proposal, commit, torch.tensor([3, 4])


@pytest.mark.parametrize(
    "cpp, cuda, device, expected",
    [
        pytest.param(True, True, CUDA, "cuda", id="cuda-ext-on-cuda"),
        pytest.param(True, False, CUDA, "torch", id="cpu-ext-on-cuda"),
        pytest.param(False, False, CUDA, "torch", id="no-ext-on-cuda"),
        pytest.param(True, True, CPU, "cpp", id="cuda-ext-on-cpu"),
        pytest.param(True, False, CPU, "cpp", id="cpu-ext-on-cpu"),
        pytest.param(False, False, CPU, "torch", id="no-ext-on-cpu"),
    ],
)
def test_apply_commits_default_order(monkeypatch, cpp, cuda, device, expected):
    fake_ext(monkeypatch, cpp, cuda)
    assert ops._pick_impl("apply_commits", None, device, IMPLS) == expected


def test_apply_commits_env_impl(monkeypatch):
    fake_ext(monkeypatch, True, False)
    monkeypatch.setenv("TRACELOCK_IMPL", "torch")
    assert ops._pick_impl("apply_commits", None, CPU, IMPLS) == "torch"
    # an explicit impl= wins over the environment
    monkeypatch.setenv("TRACELOCK_IMPL", "cuda")
    assert ops._pick_impl("apply_commits", "cpp", CPU, IMPLS) == "cpp"


@pytest.mark.parametrize("source", ["arg", "env"])
def test_apply_commits_unknown_impl(monkeypatch, source):
    if source == "env":
        monkeypatch.setenv("TRACELOCK_IMPL", "cutlass")
    with pytest.raises(ValueError, match="unknown impl 'cutlass'.*known impls: torch, triton, cpp, cuda"):
        ops.apply_commits(*make_inputs(), 0, True, impl="cutlass" if source == "arg" else None)


@pytest.mark.parametrize(
    "impl, cpp, cuda, device, exc, match",
    [
        pytest.param("triton", True, True, CPU, ValueError, "no 'triton' implementation; available: torch, cpp, cuda",
                     id="triton-missing-for-op"),
        pytest.param("cpp", False, False, CPU, RuntimeError, "pip install -e . --no-build-isolation", id="cpp-no-ext"),
        pytest.param("cpp", True, True, CUDA, RuntimeError, "runs on CPU tensors", id="cpp-on-cuda"),
        pytest.param("cuda", True, True, CPU, RuntimeError, "runs on CUDA tensors", id="cuda-on-cpu"),
        pytest.param("cuda", True, False, CUDA, RuntimeError,
                     "built without CUDA; rebuild with `TRACELOCK_BUILD_CUDA=1 pip install -e . --no-build-isolation`",
                     id="cuda-cpu-only-ext"),
        pytest.param("cuda", False, False, CUDA, RuntimeError, "failed to import.*TRACELOCK_BUILD_CUDA=1",
                     id="cuda-no-ext"),
    ],
)
def test_apply_commits_unavailable_impl(monkeypatch, impl, cpp, cuda, device, exc, match):
    fake_ext(monkeypatch, cpp, cuda)
    with pytest.raises(exc, match=match):
        ops._pick_impl("apply_commits", impl, device, IMPLS)


@pytest.mark.parametrize("impl", [None, "torch", "cpp"], ids=["default", "torch", "cpp"])
def test_apply_commits_dispatch_matches_ref(impl):
    if impl == "cpp" and not _ext.has_cpp():
        pytest.skip(f"tracelock._C is not built: {_ext.ext_error()}")
    x, state, proposal, commit, end_ids = make_inputs()
    ref_x, ref_state = x.clone(), state.clone()
    ref_first = apply_commits_ref(ref_x, ref_state, proposal, commit, end_ids, 0, True)
    first = ops.apply_commits(x, state, proposal, commit, end_ids, 0, True, impl=impl)
    assert torch.equal(x, ref_x) and torch.equal(state, ref_state) and torch.equal(first, ref_first)


def _bad(name):
    x, state, proposal, commit, end_ids = make_inputs()
    bad = {
        "x-dtype": dict(x=x.int()),
        "x-1d": dict(x=x[0], state=state[0], proposal=proposal[0], commit=commit[0]),
        "state-dtype": dict(state=state.long()),
        "proposal-shape": dict(proposal=proposal[:, :-1]),
        "commit-dtype": dict(commit=commit.to(torch.uint8)),
        "end_ids-2d": dict(end_ids=end_ids[None]),
        "state-noncontig": dict(state=state.t().contiguous().t()),
        "proposal-not-tensor": dict(proposal=proposal.tolist()),
        "commit-device": dict(commit=commit.to("meta")),
    }[name]
    return dict(x=x, state=state, proposal=proposal, commit=commit, end_ids=end_ids) | bad


@pytest.mark.parametrize(
    "case, exc, match",
    [
        pytest.param("x-dtype", TypeError, "x must be torch.int64", id="x-dtype"),
        pytest.param("x-1d", ValueError, r"x must be \[B, L\]", id="x-1d"),
        pytest.param("state-dtype", TypeError, "state must be torch.uint8", id="state-dtype"),
        pytest.param("proposal-shape", ValueError, r"proposal must have shape \[2, 8\]", id="proposal-shape"),
        pytest.param("commit-dtype", TypeError, "commit must be torch.bool", id="commit-dtype"),
        pytest.param("end_ids-2d", ValueError, r"end_ids must be 1-D \[E\]", id="end_ids-2d"),
        pytest.param("state-noncontig", ValueError, "state must be contiguous", id="state-noncontig"),
        pytest.param("proposal-not-tensor", TypeError, "proposal must be a torch.Tensor", id="proposal-not-tensor"),
        pytest.param("commit-device", ValueError, "commit must be on cpu like x, got meta", id="commit-device"),
    ],
)
def test_apply_commits_validation(case, exc, match):
    with pytest.raises(exc, match=match):
        ops.apply_commits(**_bad(case), fill_id=0, stop_at_eot=True, impl="torch")
