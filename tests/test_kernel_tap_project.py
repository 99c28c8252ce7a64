"""tap_project: Triton (interpreter on CPU) against tap_project_ref, the encoder fold, and the dispatcher."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import tap_project_ref
from tracelock.testing import assert_close

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# loads upcast to fp32 exactly, and the ref computes in fp32 from the same upcast values: every input dtype meets
# the fp32 tolerance, relative to the output's scale (the sum order differs)
RTOL, ATOL = 1e-5, 1e-5
SHAPES = [(1, 16, 8), (63, 48, 40), (257, 96, 100), (63, 17, 5)]


def make_inputs(T, D, N, dtype, a_dtype=torch.float32):
    h = [torch.randn(T, D, device=DEVICE).to(dtype) for _ in range(3)]
    return (*h, torch.randn(3, D, N, device=DEVICE).to(a_dtype) / D**0.5, torch.randn(N, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("T, D, N", SHAPES, ids=[f"T{t}-D{d}-N{n}" for t, d, n in SHAPES])
def test_tap_project_matches_ref(poisoned_empty, T, D, N, dtype):
    from tracelock.kernels.tap_project import tap_project_triton

    args = make_inputs(T, D, N, dtype)
    ref_out = tap_project_ref(*args)
    tri_out = tap_project_triton(*args)
    assert tri_out.dtype == torch.float32 and tri_out.shape == (T, N)
    assert_close("out", ref_out, tri_out, atol=ATOL * ref_out.abs().max().item(), rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_tap_project_lowp_weights(dtype):
    # taps and weights in one 16-bit dtype: the tensor-core path on a GPU, an exact upcast in the interpreter
    args = make_inputs(63, 48, 40, dtype, a_dtype=dtype)
    ref_out = tap_project_ref(*args)
    tri_out = ops.tap_project(*args, impl="triton")
    assert_close("out", ref_out, tri_out, atol=ATOL * ref_out.abs().max().item(), rtol=RTOL)


def test_tap_project_strided_rows():
    # taps gathered from a [T, 2D] buffer: rows may be strided, only the last dim must be contiguous
    T, D, N = 63, 32, 24
    base = [torch.randn(T, 2 * D, device=DEVICE) for _ in range(3)]
    h = [b[:, :D] for b in base]
    A, c = torch.randn(3, D, N, device=DEVICE), torch.randn(N, device=DEVICE)
    ref_out = tap_project_ref(*h, A, c)
    tri_out = ops.tap_project(*h, A, c, impl="triton")
    assert_close("out", ref_out, tri_out, atol=ATOL * ref_out.abs().max().item(), rtol=RTOL)


def test_tap_project_writes_codes():
    """With A, c from tracelock.features.fold with the identity projection, one pass writes a fitted linear
    encoder's codes [E_h h1, E_h h2, E_h h3, E_d (h2 - h1), E_d (h3 - h2)], standardisation included."""
    from tracelock.features import LinearEncoder, TapEncoder, fold

    T, D = 63, 48
    samples = torch.randn(256, D) * torch.linspace(0.5, 3, D) + 1.0
    enc = TapEncoder(LinearEncoder.fit_pca(samples, 24), LinearEncoder.fit_pca(samples[1:] - samples[:-1], 16), {})
    A, c = fold(enc, torch.eye(enc.code_dim), torch.zeros(enc.code_dim))
    h1, h2, h3 = (torch.randn(T, D) * 2 + 1 for _ in range(3))
    codes = enc.codes(h1, h2, h3)
    tri_out = ops.tap_project(*(t.to(DEVICE) for t in (h1, h2, h3, A, c)), impl="triton")
    assert tri_out.shape == codes.shape == (T, 3 * 24 + 2 * 16)
    assert_close("codes", codes, tri_out.cpu(), atol=ATOL * codes.abs().max().item(), rtol=RTOL)


def test_tap_project_dispatch_torch_equals_triton():
    args = make_inputs(63, 48, 40, torch.bfloat16)
    torch_out = ops.tap_project(*args, impl="torch")
    tri_out = ops.tap_project(*args, impl="triton")
    assert_close("out", torch_out, tri_out, atol=ATOL * torch_out.abs().max().item(), rtol=RTOL)
    # no impl: triton, since it runs here (CUDA or the interpreter)
    assert ops.pick("tap_project", None, torch.device(DEVICE)) == "triton"


@pytest.mark.parametrize(
    "available, interpret, match",
    [
        pytest.param(False, True, r"triton is not installed; `pip install triton", id="no-triton"),
        pytest.param(True, False, r"it runs on CUDA tensors.*got cpu without TRITON_INTERPRET=1.*use impl='torch'",
                     id="cpu-no-interpreter"),
    ],
)
def test_tap_project_unavailable_triton(monkeypatch, available, interpret, match):
    monkeypatch.setattr(_triton, "triton_available", available)
    monkeypatch.setattr(_triton, "triton_interpret", interpret)
    args = [t.cpu() for t in make_inputs(5, 16, 8, torch.float32)]
    with pytest.raises(RuntimeError, match="impl='triton' cannot run tap_project: " + match):
        ops.tap_project(*args, impl="triton")
    monkeypatch.setenv("TRACELOCK_IMPL", "triton")
    with pytest.raises(RuntimeError, match=match):
        ops.tap_project(*args)
    # without an explicit choice the dispatcher routes to torch
    monkeypatch.delenv("TRACELOCK_IMPL")
    assert torch.equal(ops.tap_project(*args), tap_project_ref(*args))


@pytest.mark.parametrize(
    "case, exc, match",
    [
        pytest.param(dict(h1=torch.zeros(4, 8, dtype=torch.int64)), TypeError, "h1 must be float32", id="h1-dtype"),
        pytest.param(dict(h2=torch.zeros(4, 9)), ValueError, r"h2 must have shape \[4, 8\]", id="h2-shape"),
        pytest.param(dict(A=torch.zeros(2, 8, 6)), ValueError, r"A must be \[3, D, N\] with D = 8", id="A-shape"),
        pytest.param(dict(c=torch.zeros(5)), ValueError, r"c must have shape \[6\]", id="c-shape"),
        pytest.param(dict(h3=torch.zeros(8, 4).t()), ValueError, "h3 must be contiguous", id="h3-noncontig"),
        pytest.param(dict(A=torch.zeros(3, 6, 8).mT), ValueError, "A must be contiguous", id="A-noncontig"),
        pytest.param(dict(c=torch.zeros(6, device="meta")), ValueError, "c must be on cpu like h1", id="c-device"),
        pytest.param(dict(h1=torch.zeros(8)), ValueError, r"h1 must be \[T, D\]", id="h1-1d"),
    ],
)
def test_tap_project_validation(case, exc, match):
    args = dict(h1=torch.zeros(4, 8), h2=torch.zeros(4, 8), h3=torch.zeros(4, 8), A=torch.zeros(3, 8, 6),
                c=torch.zeros(6)) | case
    with pytest.raises(exc, match=match):
        ops.tap_project(**args, impl="torch")


@pytest.mark.parametrize("config", range(5), ids=lambda i: f"cfg{i}")
def test_tap_project_every_config(poisoned_empty, config):
    # each autotune config on its own (the interpreter and TRACELOCK_SKIP_AUTOTUNE take only the first): T, D and N
    # all ragged against every config's tiles
    from tracelock.kernels.tap_project import CONFIGS, tap_project_triton

    assert len(CONFIGS) == 5
    args = make_inputs(131, 80, 140, torch.bfloat16, torch.bfloat16)
    ref_out = tap_project_ref(*args)
    tri_out = tap_project_triton(*args, config=config)
    assert_close("out", ref_out, tri_out, atol=ATOL * ref_out.abs().max().item(), rtol=RTOL)
