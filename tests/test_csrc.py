"""tracelock._C: the C++ apply_commits against apply_commits_ref, its torch.ops registration, and a bare
nvcc compile of the torch-free CUDA source."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tracelock import _ext
from tracelock.kernels.ref import apply_commits_ref
from tracelock.states import ACTIVE, EOT, LOCKED, PROMPT

requires_cpp = pytest.mark.skipif(not _ext.has_cpp(), reason=f"tracelock._C is not built: {_ext.ext_error()}")
requires_cuda_ext = pytest.mark.skipif(not (torch.cuda.is_available() and _ext.has_cuda_ext()),
                                       reason="needs a CUDA device and tracelock._C built with CUDA")
CSRC = Path(__file__).resolve().parents[1] / "csrc"
FILL = 999


def make_case(B, L, E, seed):
    """A canvas with a prompt prefix, a mix of states, and proposals that hit the end tokens often."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (B, L), generator=g)
    state = torch.full((B, L), ACTIVE, dtype=torch.uint8)
    state[:, : L // 4] = PROMPT
    u = torch.rand(B, L, generator=g)
    state[:, L // 4 :] = torch.where(u[:, L // 4 :] < 0.2, LOCKED, state[:, L // 4 :]).to(torch.uint8)
    state[:, L // 4 :] = torch.where(u[:, L // 4 :] > 0.97, EOT, state[:, L // 4 :]).to(torch.uint8)
    # small vocabulary so end tokens are proposed at several positions per row
    proposal = torch.randint(0, 12, (B, L), generator=g)
    commit = torch.rand(B, L, generator=g) < 0.3
    end_ids = torch.arange(E, dtype=torch.int64) * 3 + 1
    return x, state, proposal, commit, end_ids


def run_both(x, state, proposal, commit, end_ids, stop_at_eot, device="cpu"):
    """The op on ``device`` (the C++ kernel on CPU, the CUDA kernel on cuda) against the torch spec on CPU."""
    ref_x, ref_state = x.clone(), state.clone()
    ref_first = apply_commits_ref(ref_x, ref_state, proposal, commit, end_ids, FILL, stop_at_eot)
    op_x, op_state = x.clone().to(device), state.clone().to(device)
    first = torch.ops.tracelock.apply_commits(op_x, op_state, proposal.to(device), commit.to(device),
                                              end_ids.to(device), FILL, stop_at_eot)
    assert first.device.type == torch.device(device).type
    assert torch.equal(op_x.cpu(), ref_x)
    assert torch.equal(op_state.cpu(), ref_state)
    assert torch.equal(first.cpu(), ref_first)
    return ref_x, ref_state, ref_first


CASES = [
    pytest.param(1, 63, 2, id="B1-L63-E2"),
    pytest.param(4, 160, 2, id="B4-L160-E2"),
    pytest.param(8, 320, 1, id="B8-L320-E1"),
    pytest.param(3, 257, 0, id="B3-L257-E0"),
    pytest.param(2, 1, 2, id="B2-L1-E2"),
    pytest.param(2, 0, 1, id="B2-L0-E1"),
]


@requires_cpp
@pytest.mark.parametrize("stop_at_eot", [False, True], ids=["keep", "stop"])
@pytest.mark.parametrize("B, L, E", CASES)
def test_apply_commits_cpp_matches_ref(B, L, E, stop_at_eot):
    for seed in range(5):
        run_both(*make_case(B, L, E, seed), stop_at_eot)


@requires_cuda_ext
@pytest.mark.parametrize("stop_at_eot", [False, True], ids=["keep", "stop"])
@pytest.mark.parametrize("B, L, E", [*CASES, pytest.param(8, 384, 2, id="B8-L384-E2-llada-bench"),
                                     pytest.param(64, 4096, 2, id="B64-L4096-E2")])
def test_apply_commits_cuda_matches_ref(B, L, E, stop_at_eot):
    for seed in range(5):
        run_both(*make_case(B, L, E, seed), stop_at_eot, device="cuda")


@requires_cuda_ext
def test_apply_commits_cuda_opcheck():
    args = [t.cuda() for t in make_case(4, 160, 2, seed=0)]
    torch.library.opcheck(torch.ops.tracelock.apply_commits.default, (*args, FILL, True))


@requires_cpp
@pytest.mark.parametrize("stop_at_eot", [False, True], ids=["keep", "stop"])
def test_apply_commits_cpp_edge_rows(stop_at_eot):
    x, state, proposal, commit, end_ids = make_case(4, 63, 2, seed=0)
    # row 0: no active positions at all; row 1: no EOT, commits only where nothing is active
    state[0] = torch.where(state[0] == ACTIVE, LOCKED, state[0]).to(torch.uint8)
    state[1] = torch.where(state[1] == EOT, LOCKED, state[1]).to(torch.uint8)
    commit[1] = state[1] != ACTIVE
    # row 2: an EOT left from an earlier step and no commits; row 3: the end token committed at position 20
    state[2, 20], commit[2] = EOT, False
    state[3, :16], state[3, 16:] = PROMPT, ACTIVE
    commit[3], proposal[3, 20], commit[3, 20], proposal[3, 30], commit[3, 30] = False, 1, True, 5, True
    ref_x, ref_state, ref_first = run_both(x, state, proposal, commit, end_ids, stop_at_eot)
    assert ref_first[0] == 63
    assert torch.equal(ref_x[1], x[1]) and torch.equal(ref_state[1], state[1])
    assert ref_state[3, 20] == EOT and ref_state[3, 30] == LOCKED and ref_x[3, 30] == 5
    if stop_at_eot:
        assert (ref_state[2, 21:] != ACTIVE).all() and ref_first[3] == 16
        assert (ref_x[3, 21:30] == FILL).all() and (ref_state[3, 31:] == EOT).all()
    else:
        assert ref_state[3, 21] == ACTIVE and ref_first[3] == 16


@requires_cpp
def test_apply_commits_op_registration():
    op = torch.ops.tracelock.apply_commits.default
    assert "Tensor(a!) x" in str(op._schema) and "Tensor(b!) state" in str(op._schema)
    x, state, proposal, commit, end_ids = make_case(2, 16, 1, seed=0)
    torch.library.opcheck(op, (x, state, proposal, commit, end_ids, FILL, True))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (x, state, proposal, commit, end_ids)]
        first = op(*fake, FILL, True)
    assert first.shape == (2,) and first.dtype == torch.int64


@requires_cpp
def test_apply_commits_cuda_kernel_without_cuda():
    if _ext.has_cuda_ext():
        pytest.skip("tracelock._C was built with CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("tracelock::apply_commits", "CUDA")
    # redispatch reaches the CUDA kernel with no device; a CPU-only build raises before touching the tensors
    args = (*make_case(1, 8, 1, seed=0), FILL, True)
    with pytest.raises(RuntimeError, match="TRACELOCK_BUILD_CUDA=1 pip install -e . --no-build-isolation"):
        torch.ops.tracelock.apply_commits.default.redispatch(torch._C.DispatchKeySet("CUDA"), *args)


@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cu")))
def test_cuda_source_compiles_with_bare_nvcc(source, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    cmd = [nvcc, "-std=c++20", "-O3", "-c", "-gencode", "arch=compute_90,code=sm_90", "-Xcompiler", "-fPIC",
           str(CSRC / source), "-o", str(tmp_path / "out.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
