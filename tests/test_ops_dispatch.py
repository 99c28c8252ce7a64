"""tracelock.ops: implementation selection, TRACELOCK_IMPL, error texts, and input validation."""

import pytest
import torch

from tracelock import _ext, ops
from tracelock.kernels.ref import apply_commits_ref
from tracelock.ops.chooser import why_not
from tracelock.states import ACTIVE, LOCKED

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
    assert ops.pick("apply_commits", None, device) == expected


def test_apply_commits_env_impl(monkeypatch):
    fake_ext(monkeypatch, True, False)
    monkeypatch.setenv("TRACELOCK_IMPL", "torch")
    assert ops.pick("apply_commits", None, CPU) == "torch"
    # an explicit impl= wins over the environment
    monkeypatch.setenv("TRACELOCK_IMPL", "cuda")
    assert ops.pick("apply_commits", "cpp", CPU) == "cpp"


@pytest.mark.parametrize("source", ["arg", "env"])
def test_apply_commits_unknown_impl(monkeypatch, source):
    if source == "env":
        monkeypatch.setenv("TRACELOCK_IMPL", "cutlass")
    with pytest.raises(ValueError, match="unknown impl 'cutlass'.*known impls: torch, triton, cpp, cuda"):
        ops.apply_commits(*make_inputs(), 0, True, impl="cutlass" if source == "arg" else None)


@pytest.mark.parametrize(
    "impl, cpp, cuda, device, exc, match",
    [
        pytest.param("triton", True, True, CPU, ValueError, "no 'triton' implementation; available: cuda, cpp, torch",
                     id="triton-missing-for-op"),
        pytest.param("cpp", False, False, CPU, RuntimeError, "pip install -e . --no-build-isolation", id="cpp-no-ext"),
        pytest.param("cpp", True, True, CUDA, RuntimeError, "run on CPU tensors", id="cpp-on-cuda"),
        pytest.param("cuda", True, True, CPU, RuntimeError, "run on a CUDA device", id="cuda-on-cpu"),
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
        ops.pick("apply_commits", impl, device)


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


@pytest.mark.parametrize("cpp", [True, False], ids=["ext", "no-ext"])
def test_one_table_decides_every_driver(monkeypatch, cpp):
    """`ops.IMPLEMENTATIONS` is the one table: fused_generate's impl families map each op to the nearest member it
    has, the default takes the first that runs, and a graph (the engine) never takes the CPU interpreter."""
    fake_ext(monkeypatch, cpp, False)
    monkeypatch.delenv("TRACELOCK_IMPL", raising=False)
    bookkeeping = "cpp" if cpp else "torch"
    triton = "triton" if why_not("triton", CPU) is None else "torch"  # where TRITON_INTERPRET=1
    # the kernel ops: a Triton kernel and its torch spec, nothing else
    kernels = [op for op, impls in ops.IMPLEMENTATIONS.items() if impls == ("triton", "torch")]
    assert {"window_logits_stats", "tap_project", "commit_step"} <= set(kernels)
    want = {
        "torch": dict.fromkeys(ops.IMPLEMENTATIONS, "torch"),
        "triton": dict(apply_commits="torch", skip_finished_blocks="torch", **dict.fromkeys(kernels, "triton")),
        # the per-layer ops never take the interpreter by default: a whole decode would pay for it in every layer
        None: dict(apply_commits=bookkeeping, skip_finished_blocks=bookkeeping,
                   **{op: "torch" if op in ops.PER_LAYER else triton for op in kernels}),
    }
    if cpp:
        want["cpp"] = dict(apply_commits="cpp", skip_finished_blocks="cpp", **dict.fromkeys(kernels, "torch"))
    for impl, expected in want.items():
        if impl == "triton" and triton == "torch":
            continue
        assert ops.op_set(CPU, impl=impl).impls == expected, impl
    graph = ops.op_set(CPU, "graph")
    assert graph.impls == dict(want[None], **dict.fromkeys(kernels, "torch"))
    # a graph gets the implementations themselves: the torch block advance is the loop-free one, not the spec
    from tracelock.kernels.ref import commit_step_ref
    from tracelock.kernels.skip_finished_blocks import skip_finished_blocks_torch

    assert graph.commit_step is commit_step_ref
    # inductor takes the torch bookkeeping (it mis-ordered reads around the C++ op's in-place writes)
    assert set(ops.op_set(CPU, "inductor").impls.values()) == {"torch"}
    if not cpp:
        assert graph.skip_finished_blocks is skip_finished_blocks_torch
    monkeypatch.setenv("TRACELOCK_IMPL", "torch")  # the environment picks for fused_generate, never for a graph
    assert set(ops.op_set(CPU).impls.values()) == {"torch"} and ops.op_set(CPU, "graph") == graph


def test_fused_generate_and_the_engine_take_their_ops_from_the_table(monkeypatch):
    import tracelock
    from tracelock.decode.engine import DecodeEngine

    seen = []
    real = ops.op_set
    monkeypatch.setattr(ops, "op_set", lambda *a, **k: seen.append(a[1] if len(a) > 1 else "eager") or real(*a, **k))
    model = tracelock.load_model("testbed")
    tracelock.fused_generate(model, [[5, 6, 7]], policy="confidence", gen_length=8, block=4, impl="torch")
    engine = DecodeEngine(model, policy="confidence", gen_length=8, block=4)
    assert seen == ["eager", "graph"]
    assert engine.ops.impls == real(model.device, "graph").impls
