"""Triton kernels that check themselves (tracelock.selfcheck): a default-chosen kernel is compared with its spec on
first use per device, dtype and shape class; a wrong or failing one falls back to the spec with one warning."""

import importlib
import warnings

import pytest
import torch

import tracelock
from tracelock import _triton, ops, selfcheck
from tracelock.kernels import ref
from tracelock.ops.chooser import graph_fn

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not _triton.triton_available or not (_triton.triton_interpret or
                                                                    torch.cuda.is_available()),
                                 reason="needs Triton on CUDA or under TRITON_INTERPRET=1")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = sorted(selfcheck.BUILDERS)


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    monkeypatch.delenv("TRACELOCK_SELFCHECK", raising=False)
    selfcheck.reset()
    yield
    selfcheck.reset()


def _corrupt(t):
    if t.dtype == torch.bool:
        return ~t
    return t + 1


def wrong(op):
    """The op's spec with its first output corrupted: a kernel that runs but gives the wrong answer."""
    spec = getattr(ref, f"{op}_ref")

    def kernel(*args):
        out = spec(*args)
        return (_corrupt(out[0]), *out[1:]) if isinstance(out, tuple) else _corrupt(out)

    return kernel


def register(monkeypatch, op, kernel):
    """Register ``kernel`` as ``op``'s Triton implementation (what `tracelock.ops.chooser.implementation` looks up)."""
    monkeypatch.setattr(importlib.import_module(f"tracelock.kernels.{op}"), f"{op}_triton", kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_selfcheck_passes_every_kernel(op, dtype):
    assert selfcheck.check(op, DEVICE, dtype) == (True, "passed")


@pytest.mark.parametrize("op", OPS)
def test_selfcheck_catches_a_wrong_kernel(op):
    ok, why = selfcheck.check(op, DEVICE, torch.float32, kernel=wrong(op))
    assert not ok and "output 0" in why


def test_wrong_kernel_falls_back_with_one_warning(monkeypatch):
    register(monkeypatch, "silu_mul", wrong("silu_mul"))
    x = torch.randn(4, 16, device=DEVICE)
    with pytest.warns(RuntimeWarning, match=r"Triton silu_mul kernel failed its check .*TRACELOCK_SELFCHECK=0"):
        got = ops.silu_mul(x)
    assert torch.equal(got, ref.silu_mul_ref(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(ops.silu_mul(x[:2]), ref.silu_mul_ref(x[:2]))  # the verdict holds: no second warning
    # asked for by name, the kernel is obeyed (its own parity tests must see it)
    assert torch.equal(ops.silu_mul(x, impl="triton"), ref.silu_mul_ref(x) + 1)


def test_kernel_that_fails_to_compile_falls_back(monkeypatch):
    def broken(*args):
        raise RuntimeError("CompilationError: Input shapes should have M >= 1, N >= 1 and K >= 16")

    register(monkeypatch, "add_rms_norm", broken)
    x, w = torch.randn(3, 32, device=DEVICE), torch.rand(32, device=DEVICE)
    with pytest.warns(RuntimeWarning, match="add_rms_norm .*CompilationError"):
        normed, summed = ops.add_rms_norm(x, x, w, 1e-5)
    want = ref.add_rms_norm_ref(x, x, w, 1e-5)
    assert torch.equal(normed, want[0]) and torch.equal(summed, want[1])
    (key, why), = selfcheck.verdicts().items()
    assert key[0] == "add_rms_norm" and key[2] == torch.float32 and "CompilationError" in why


def test_one_check_per_dtype_and_shape_class(monkeypatch):
    calls = []
    kernel = importlib.import_module("tracelock.kernels.add_rms_norm").add_rms_norm_triton

    def counted(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    register(monkeypatch, "add_rms_norm", counted)
    w = torch.rand(32, device=DEVICE)
    for rows in (3, 5, 7):  # one shape class: one check (3 rows), then the calls themselves
        ops.add_rms_norm(torch.randn(rows, 32, device=DEVICE), None, w, 1e-5)
    x = torch.randn(2, 32, device=DEVICE)
    ops.add_rms_norm(x, x, w, 1e-5)  # with a residual: another class
    ops.add_rms_norm(x.bfloat16(), None, w, 1e-5)  # another dtype
    assert len(selfcheck.verdicts()) == 3 and len(calls) == 5 + 3


def test_selfcheck_off(monkeypatch):
    monkeypatch.setenv("TRACELOCK_SELFCHECK", "0")
    register(monkeypatch, "silu_mul", wrong("silu_mul"))
    x = torch.randn(2, 8, device=DEVICE)
    assert torch.equal(ops.silu_mul(x), ref.silu_mul_ref(x) + 1) and selfcheck.verdicts() == {}


def test_graphs_hold_checked_kernels(monkeypatch):
    register(monkeypatch, "silu_mul", wrong("silu_mul"))
    fn = graph_fn("silu_mul", "triton")
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.warns(RuntimeWarning, match="silu_mul"):
        assert torch.equal(fn(x), ref.silu_mul_ref(x))


def test_decode_with_a_wrong_kernel_keeps_the_reference_tokens(monkeypatch, tmp_path):
    """The eager loop's LM head and statistics run the Triton kernel here by default; a wrong one (its proposals one
    token off) falls back and every token stays the reference's."""
    model = tracelock.load_model(tracelock.write_tiny_checkpoint(tmp_path / "m", family="llada", seed=0))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    settings = dict(gen_length=8, block=4, policy="threshold", policy_args={"tau": 0.9})
    want, _ = tracelock.reference_generate(model, prompts, **settings)
    register(monkeypatch, "window_logits_stats", wrong("window_logits_stats"))
    with pytest.warns(RuntimeWarning, match="window_logits_stats"):
        got, _ = tracelock.fused_generate(model, prompts, **settings)
    assert torch.equal(got, want)


def test_env_reports_each_op(monkeypatch):
    from tracelock import env

    register(monkeypatch, "silu_mul", wrong("silu_mul"))
    lines = env.ops_report(DEVICE)
    assert list(lines) == [f"op {op}" for op in ops.IMPLEMENTATIONS]
    assert lines["op silu_mul"].startswith("torch (the Triton kernel failed its self-check: output 0")
    assert lines["op commit_step"].startswith("triton (self-check passed")
    monkeypatch.setenv("TRACELOCK_SELFCHECK", "0")
    assert env.ops_report(DEVICE)["op silu_mul"] == "triton (self-check off: TRACELOCK_SELFCHECK=0)"
