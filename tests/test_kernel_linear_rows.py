"""linear_rows: Triton (interpreter on CPU) against linear_rows_ref: every epilogue, every way stream-K splits a tile
(forced through the program count), strided rows, the self-resetting workspace, each autotune config, and the
dispatcher's checks."""

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import linear_rows_ref
from tracelock.testing import assert_close

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative to the output's scale: fp32 differs from the spec only in the order of the sums over K; a 16-bit output
# rounds once in both, and the interpreter's fp32 -> bf16 cast truncates (triton 3.7), so one 16-bit step apart
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
# (bias, residual, activation): every epilogue
EPILOGUES = [(b, r, a) for a in (None, "silu_mul") for b in (False, True) for r in (False, True)]


def epi_id(epi):
    bias, res, act = epi
    return "-".join(["bias"] * bias + ["res"] * res + ["silu"] * (act is not None)) or "plain"


def make_inputs(M, N, K, dtype, bias=False, residual=False, activation=None, x_stride=None):
    """x [M, K] (a column slice of a [M, x_stride] buffer when given), weight [N, K] (2N rows for silu_mul)."""
    rows = 2 * N if activation == "silu_mul" else N
    x = torch.randn(M, x_stride or K, device=DEVICE).to(dtype)[:, :K]
    weight = (torch.randn(rows, K, device=DEVICE) / K**0.5).to(dtype)
    b = torch.randn(rows, device=DEVICE).to(dtype) if bias else None
    r = torch.randn(M, N, device=DEVICE).to(dtype) if residual else None
    return x, weight, b, r, activation


def run(args, **kw):
    from tracelock.kernels.linear_rows import linear_rows_triton

    return linear_rows_triton(*args, **kw)


def check(ref, got, dtype):
    rtol, atol = TOL[dtype]
    assert got.dtype == ref.dtype and got.shape == ref.shape and got.is_contiguous()
    # assert_close passes NaN (a NaN difference is never above the tolerance); a poisoned share must not
    assert bool(got.isfinite().all())
    assert_close("out", ref, got, rtol=rtol, atol=atol * ref.abs().max().clamp_min(1).item())


@pytest.fixture
def fresh_workspace(monkeypatch, poisoned_empty):
    """An empty workspace cache under NaN-poisoned torch.empty: the partials start as NaN, so a share the last
    program reads but no program wrote shows up in the output."""
    from tracelock.kernels import linear_rows

    monkeypatch.setattr(linear_rows, "_WORKSPACES", {})
    return linear_rows._WORKSPACES


SHAPES = [(1, 77, 131), (3, 77, 131), (32, 77, 131), (33, 77, 131)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("epi", EPILOGUES, ids=epi_id)
@pytest.mark.parametrize("M, N, K", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_linear_rows_matches_ref(fresh_workspace, M, N, K, epi, dtype):
    args = make_inputs(M, N, K, dtype, *epi)
    ref_out = linear_rows_ref(*args)
    check(ref_out, run(args), dtype)


# (N, K, programs): with the default tiles (64 x 64) the tiles hold 5 K-steps; the program counts make every kind of
# share: 1 (whole tiles only), 2 (a whole tile and a split one), 3 (a program ending in one tile and starting the
# next: both workspace slots), 4 (a share ending exactly at a tile's end), 7, 64 (more programs than units: the grid
# shrinks to the units)
SPLITS = [(77, 300, 1), (77, 300, 3), (77, 300, 4), (150, 300, 2), (150, 300, 7), (150, 300, 64)]


@pytest.mark.parametrize("epi", [(True, True, None), (True, True, "silu_mul")], ids=epi_id)
@pytest.mark.parametrize("N, K, programs", SPLITS, ids=[f"N{n}-K{k}-P{p}" for n, k, p in SPLITS])
def test_linear_rows_every_split(fresh_workspace, N, K, programs, epi):
    args = make_inputs(5, N, K, torch.float32, *epi)
    check(linear_rows_ref(*args), run(args, programs=programs), torch.float32)


def test_linear_rows_two_calls_in_a_row(fresh_workspace):
    # the last program of each split tile resets its counter, so the next call (other inputs, other shapes, other
    # grids) starts from zero without a memset
    for programs, (M, N, K) in [(3, (4, 77, 300)), (3, (4, 77, 300)), (5, (9, 130, 200)), (None, (2, 40, 300))]:
        args = make_inputs(M, N, K, torch.float32, True, True, "silu_mul")
        check(linear_rows_ref(*args), run(args, programs=programs), torch.float32)
        counters = fresh_workspace[torch.device(DEVICE)][1]
        assert int(counters.abs().sum()) == 0


def test_linear_rows_many_row_tiles(fresh_workspace):
    # M above one 64-row tile: several row tiles per column tile, each reading the weights again
    args = make_inputs(130, 70, 96, torch.bfloat16, True, True, None)
    check(linear_rows_ref(*args), run(args, programs=5), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_linear_rows_strided_rows(fresh_workspace, dtype):
    # x gathered as a column slice of a wider buffer (each row contiguous), the residual likewise
    x, weight, bias, _, _ = make_inputs(7, 45, 33, dtype, True, x_stride=80)
    residual = torch.randn(7, 100, device=DEVICE).to(dtype)[:, 10:55]
    assert x.stride(0) == 80 and residual.stride(0) == 100
    check(linear_rows_ref(x, weight, bias, residual), ops.linear_rows(x, weight, bias, residual, impl="triton"), dtype)


@pytest.mark.parametrize("config", range(5), ids=lambda i: f"cfg{i}")
def test_linear_rows_every_config(fresh_workspace, config):
    # each autotune config on its own (the interpreter and TRACELOCK_SKIP_AUTOTUNE take only the first), on split
    # tiles with ragged edges in N and K and the whole epilogue
    from tracelock.kernels.linear_rows import CONFIGS

    assert len(CONFIGS) == 5
    args = make_inputs(19, 150, 333, torch.bfloat16, True, True, "silu_mul")
    check(linear_rows_ref(*args), run(args, programs=5, config=config), torch.bfloat16)


def test_linear_rows_empty_sizes():
    x, weight, bias, _, _ = make_inputs(0, 8, 16, torch.float32, True)
    assert ops.linear_rows(x, weight, bias, impl="triton").shape == (0, 8)
    # K = 0: the product is zero and the epilogue still runs
    x, weight, bias, res, act = make_inputs(3, 8, 0, torch.float32, True, True, "silu_mul")
    check(linear_rows_ref(x, weight, bias, res, act), ops.linear_rows(x, weight, bias, res, act, impl="triton"),
          torch.float32)


def test_linear_rows_ref_is_the_unfused_torch():
    # the spec is what the backbone computes unfused (fp32: the same operations in the same order)
    x, weight, bias, res, _ = make_inputs(5, 24, 40, torch.float32, True, True)
    F = torch.nn.functional
    assert_close("linear", F.linear(x, weight, bias) + res, linear_rows_ref(x, weight, bias, res), atol=1e-6)
    gate_up = F.linear(x, weight.repeat(2, 1), bias.repeat(2))
    assert_close("silu_mul", F.silu(gate_up[:, :24]) * gate_up[:, 24:] + res,
                 linear_rows_ref(x, weight.repeat(2, 1), bias.repeat(2), res, "silu_mul"), atol=1e-6)


def test_linear_rows_dispatch_torch_equals_triton():
    args = make_inputs(33, 77, 131, torch.bfloat16, True, True, "silu_mul")
    check(ops.linear_rows(*args, impl="torch"), ops.linear_rows(*args, impl="triton"), torch.bfloat16)
    assert ops.pick("linear_rows", None, torch.device(DEVICE)) == "triton"
    assert ops.IMPLEMENTATIONS["linear_rows"] == ("triton", "torch")


def test_linear_rows_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_interpret", False)
    x, weight, *_ = (t for t in make_inputs(3, 16, 8, torch.float32))
    with pytest.raises(RuntimeError, match="impl='triton' cannot run linear_rows: .*TRITON_INTERPRET=1"):
        ops.linear_rows(x.cpu(), weight.cpu(), impl="triton")


@pytest.mark.parametrize(
    "case, exc, match",
    [
        pytest.param(dict(x=torch.zeros(4, 8, dtype=torch.int32)), TypeError, "x must be float32", id="x-dtype"),
        pytest.param(dict(x=torch.zeros(4, 8, 2)), ValueError, r"x must be \[M, K\]", id="x-dims"),
        pytest.param(dict(x=torch.zeros(8, 4).t()), ValueError, r"x must be contiguous", id="x-columns-strided"),
        pytest.param(dict(weight=torch.zeros(10, 8, dtype=torch.bfloat16)), TypeError,
                     r"weight must be float32 like x, got bfloat16 \(cast one with .to\(\)\)", id="weight-dtype"),
        pytest.param(dict(weight=torch.zeros(10, 9)), ValueError, r"weight must be \[N, K\] with N >= 1 and K = 8",
                     id="weight-width"),
        pytest.param(dict(weight=torch.zeros(8, 10).t()), ValueError, "weight must be contiguous",
                     id="weight-noncontig"),
        pytest.param(dict(bias=torch.zeros(9)), ValueError, r"bias must have shape \[10\]", id="bias-shape"),
        pytest.param(dict(residual=torch.zeros(4, 5)), ValueError, r"residual must have shape \[4, 10\]",
                     id="residual-shape"),
        pytest.param(dict(activation="silu_mul", residual=torch.zeros(4, 10)), ValueError,
                     r"residual must have shape \[4, 5\]", id="residual-silu-shape"),
        pytest.param(dict(weight=torch.zeros(9, 8), activation="silu_mul"), ValueError,
                     r"gate/up weight \[2F, K\].*odd N = 9", id="silu-odd"),
        pytest.param(dict(activation="gelu"), ValueError, r"activation must be one of \(None, 'silu_mul'\)",
                     id="activation"),
    ],
)
def test_linear_rows_validation(case, exc, match):
    args = dict(x=torch.zeros(4, 8), weight=torch.zeros(10, 8), bias=None, residual=None, activation=None) | case
    with pytest.raises(exc, match=match):
        ops.linear_rows(**args, impl="torch")
