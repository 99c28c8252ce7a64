"""The fused ops vs their torch references (`tracelock.kernels.ref`) at the target's decode shapes.

- ``window_logits_stats``: the LM head on a step's window rows (B x width) plus the greedy signals;
- ``tap_project``: the three taps of every canvas position folded into the controller's inputs (B x (P + G) rows);
- ``commit_step``: TraceLock's commit rule on the window's slots;
- ``credit_fuse``, ``step_kl``, ``topk_js``: the vocabulary-wide passes of the credit, KLASS and LESS rules over the
  window's slots' logits (B x width rows of V), their state updated in place;
- ``head_credit_fuse``, ``head_topk_js``, ``head_step_kl``: the same passes fused into the LM head, at LLaDA-8B's head
  (V 126,464, D 4096, bf16; the target's own head on a CPU) for 32 and 1024 rows, beside the unfused pair (the head
  GEMM writing bf16 logits, then the op's kernel) in the same group.

The Triton rows run on a CUDA device only (under TRITON_INTERPRET=1 on a CPU they would time the interpreter).
extra_info has the bytes and FLOPs each call must move; with timings on, the achieved GB/s and TFLOP/s, and on a
known GPU the share of its ceiling.
"""

import pytest
import torch

from tracelock import ops
from tracelock.states import ACTIVE, PROMPT

# (HBM bytes/s, dense bf16 FLOP/s) from the vendors' data sheets; the first name that the device name contains wins
CEILINGS = [("H100 PCIe", 2.0e12, 756e12), ("H100", 3.35e12, 989e12), ("H200", 4.8e12, 989e12)]
IMPLS = ["torch", "triton"]


def _impl_or_skip(impl: str, device: torch.device) -> None:
    if impl == "triton" and device.type != "cuda":
        pytest.skip("Triton rows need a CUDA device (the interpreter's speed means nothing)")


def _record(benchmark, machine, bytes_moved: float, flops: float, **info) -> None:
    benchmark.extra_info.update(machine, bytes=bytes_moved, flops=flops, **info)


def _throughput(benchmark, machine) -> None:
    """After timing: achieved GB/s and TFLOP/s of the median call, and the share of the GPU's ceiling."""
    if benchmark.disabled or benchmark.stats is None:
        return
    median = benchmark.stats.stats.median
    info = benchmark.extra_info
    info.update(gb_per_s=info["bytes"] / median / 1e9, tflop_per_s=info["flops"] / median / 1e12)
    for name, bandwidth, flop_rate in CEILINGS:
        if machine["gpu"] and name in machine["gpu"]:
            info.update(bandwidth_share=info["bytes"] / median / bandwidth,
                        flop_share=info["flops"] / median / flop_rate)
            break


def _synced(fn, device: torch.device):
    """``fn`` followed by a device synchronisation on CUDA: kernel launches return before the kernel ends, so an
    unsynchronised timing measures the launch (one sync per call adds a few microseconds, counted against the op)."""
    if device.type != "cuda":
        return fn

    def body():
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return body


def _sizes(target):
    return target.batch, target.prompt_len + target.gen_length, target.block


@pytest.mark.parametrize("impl", IMPLS)
def test_window_logits_stats(benchmark, target, machine, impl):
    model = target.model
    _impl_or_skip(impl, model.device)
    B, L, width = _sizes(target)
    g = torch.Generator(device=model.device).manual_seed(0)
    weight = model.lm_head.weight
    hidden = torch.randn(B * width, weight.shape[1], generator=g, device=model.device, dtype=weight.dtype)
    # check before timing: the proposals equal the spec's and the probabilities agree
    from tracelock.kernels.ref import window_logits_stats_ref

    ref = window_logits_stats_ref(hidden, weight, model.spec.eos_id)
    got = ops.window_logits_stats(hidden, weight, model.spec.eos_id, impl=impl)
    assert torch.equal(ref[0], got[0])
    for r, o in zip(ref[1:], got[1:]):
        torch.testing.assert_close(o, r, rtol=1e-3, atol=1e-5)

    R, (V, D) = hidden.shape[0], weight.shape
    benchmark.group = f"window_logits_stats-{target.name}-R{R}-V{V}-D{D}"
    _record(benchmark, machine, V * D * weight.element_size() + R * D * hidden.element_size() + 5 * R * 4,
            2 * R * V * D, impl=impl, dtype=str(weight.dtype))
    benchmark.pedantic(_synced(lambda: ops.window_logits_stats(hidden, weight, model.spec.eos_id, impl=impl),
                               model.device), rounds=20,
                       warmup_rounds=2)
    _throughput(benchmark, machine)


@pytest.mark.parametrize("impl", IMPLS)
def test_tap_project(benchmark, target, controller, machine, impl):
    model = target.model
    _impl_or_skip(impl, model.device)
    B, L, _ = _sizes(target)
    A, c = controller[0].tap_fold(model)
    g = torch.Generator(device=model.device).manual_seed(0)
    dtype = model.dtype
    taps = [torch.randn(B * L, A.shape[1], generator=g, device=model.device, dtype=dtype) for _ in range(3)]
    A = A.to(dtype) if model.device.type == "cuda" else A  # the tensor-core path takes A in the taps' dtype
    from tracelock.kernels.ref import tap_project_ref

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ops.tap_project(*taps, A, c, impl=impl), tap_project_ref(*taps, A, c), rtol=tol,
                               atol=tol)

    T, D, N = taps[0].shape[0], A.shape[1], A.shape[2]
    benchmark.group = f"tap_project-{target.name}-T{T}-D{D}-N{N}"
    _record(benchmark, machine, 3 * T * D * taps[0].element_size() + 3 * D * N * A.element_size() + T * N * 4,
            2 * 3 * T * D * N, impl=impl, dtype=str(dtype))
    benchmark.pedantic(_synced(lambda: ops.tap_project(*taps, A, c, impl=impl), model.device), rounds=20,
                       warmup_rounds=2)
    _throughput(benchmark, machine)


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_step(benchmark, target, machine, impl):
    device = target.model.device
    _impl_or_skip(impl, device)
    B, L, R = _sizes(target)
    P = L - target.gen_length
    g = torch.Generator(device=device).manual_seed(0)
    score = torch.randn(B, R, generator=g, device=device) * 4
    tau = torch.randn(B, generator=g, device=device)
    active = torch.ones(B, R, dtype=torch.bool, device=device)
    proposal = torch.randint(0, 100, (B, R), generator=g, device=device)
    positions = (P + torch.arange(R, device=device)).expand(B, -1).contiguous()
    x = torch.randint(0, 100, (B, L), generator=g, device=device)
    state = torch.full((B, L), ACTIVE, dtype=torch.uint8, device=device)
    state[:, :P] = PROMPT
    end_ids = torch.tensor(target.model.spec.end_ids, device=device)

    def step():
        # the op writes the canvas in place: each call gets fresh copies (timed for both impls alike)
        xs, ss = x.clone(), state.clone()
        return ops.commit_step(score, tau, active, proposal, positions, xs, ss, end_ids, 0.95, 0, impl=impl), xs, ss

    from tracelock.kernels.ref import commit_step_ref

    xr, sr = x.clone(), state.clone()
    ref = commit_step_ref(score, tau, active, proposal, positions, xr, sr, end_ids, 0.95, 0)
    got, xs, ss = step()
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and torch.equal(xr, xs) and torch.equal(sr, ss)

    benchmark.group = f"commit_step-{target.name}-B{B}-R{R}-L{L}"
    _record(benchmark, machine, B * R * (4 + 1 + 8 + 8) + B * 4 + 2 * B * L * (8 + 1), 0, impl=impl)
    benchmark.pedantic(_synced(step, device), rounds=50, warmup_rounds=2)
    _throughput(benchmark, machine)


def _slot_logits(target):
    """Logits of a step's window slots, [B x width, V] in the model's dtype, a few units in scale."""
    model = target.model
    B, _, width = _sizes(target)
    g = torch.Generator(device=model.device).manual_seed(0)
    V = model.lm_head.weight.shape[0]
    return (torch.randn(B * width, V, generator=g, device=model.device) * 3).to(model.dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_credit_fuse(benchmark, target, machine, impl):
    device = target.model.device
    _impl_or_skip(impl, device)
    logits = _slot_logits(target)
    N, V = logits.shape
    credit = torch.rand(N, V, device=device)
    rows = torch.arange(N, device=device)
    boost, fresh = rows % 2 == 0, rows % 4 == 3
    # check before timing, from copies of the credit (each call updates it in place)
    from tracelock.kernels.ref import credit_fuse_ref

    ref_credit, got_credit = credit.clone(), credit.clone()
    ref = credit_fuse_ref(logits, ref_credit, boost, fresh, 0.7, 1.0, 0.9)
    got = ops.credit_fuse(logits, got_credit, boost, fresh, 0.7, 1.0, 0.9, impl=impl)
    assert torch.equal(ref[0], got[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_credit, ref_credit, rtol=1e-4, atol=1e-5)

    benchmark.group = f"credit_fuse-{target.name}-N{N}-V{V}"
    # the floor: the logits once, the credit read and written (the kernel reads the logits twice, the second time
    # mostly from L2)
    _record(benchmark, machine, N * V * (logits.element_size() + 8) + N * 12, 0, impl=impl, dtype=str(logits.dtype))
    benchmark.pedantic(_synced(lambda: ops.credit_fuse(logits, credit, boost, fresh, 0.7, 1.0, 0.9, impl=impl),
                               device), rounds=20, warmup_rounds=2)
    _throughput(benchmark, machine)


@pytest.mark.parametrize("impl", IMPLS)
def test_step_kl(benchmark, target, machine, impl):
    device = target.model.device
    _impl_or_skip(impl, device)
    logits = _slot_logits(target)
    N, V = logits.shape
    # the previous step's distribution in fp32 (a GPU's state), zeros for the rows with no previous pass
    prev = (logits.float() + torch.randn(N, V, device=device)).softmax(-1)
    prev[::4] = 0
    from tracelock.kernels.ref import step_kl_ref

    ref_prev, got_prev = prev.clone(), prev.clone()
    ref = step_kl_ref(logits, ref_prev)
    got = ops.step_kl(logits, got_prev, impl=impl)
    assert torch.equal(ref[0], got[0])
    for r, o in zip((*ref[1:], ref_prev), (*got[1:], got_prev)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)

    benchmark.group = f"step_kl-{target.name}-N{N}-V{V}"
    # the floor: the logits once, prev read and written
    _record(benchmark, machine, N * V * (logits.element_size() + 8) + N * 16, 0, impl=impl, dtype=str(logits.dtype))
    benchmark.pedantic(_synced(lambda: ops.step_kl(logits, prev, impl=impl), device), rounds=20, warmup_rounds=2)
    _throughput(benchmark, machine)


@pytest.mark.parametrize("impl", IMPLS)
def test_topk_js(benchmark, target, machine, impl):
    device = target.model.device
    _impl_or_skip(impl, device)
    logits = _slot_logits(target)
    N, V = logits.shape
    K = 8
    from tracelock.kernels.ref import topk_js_ref

    # the previous step's top-K: that of nearby logits
    none = torch.zeros(N, dtype=torch.bool, device=device)
    prev_ids, prev_probs, _ = topk_js_ref(logits.float() + 0.3 * torch.randn(N, V, device=device),
                                          torch.zeros(N, K, dtype=torch.int64, device=device),
                                          torch.zeros(N, K, device=device), none)
    has_prev = ~none
    ref = topk_js_ref(logits, prev_ids, prev_probs, has_prev)
    got = ops.topk_js(logits, prev_ids, prev_probs, has_prev, impl=impl)
    assert torch.equal(ref[0], got[0])
    for r, o in zip(ref[1:], got[1:]):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)

    benchmark.group = f"topk_js-{target.name}-N{N}-V{V}-K{K}"
    # the floor: the logits once, the previous top-K read, this one written
    _record(benchmark, machine, N * V * logits.element_size() + 2 * N * K * 12 + N * 5, 0, impl=impl,
            dtype=str(logits.dtype))
    benchmark.pedantic(_synced(lambda: ops.topk_js(logits, prev_ids, prev_probs, has_prev, impl=impl), device),
                       rounds=20, warmup_rounds=2)
    _throughput(benchmark, machine)


# the fused head ops' rows: a window of 32 slots (B = 1) and a batch's 1024
HEAD_ROWS = [32, 1024]
HEAD_IMPLS = ["unfused", "torch", "triton"]


@pytest.fixture(scope="module")
def head(target):
    """LLaDA-8B's LM head in bf16 with random weights on a CUDA device (logits a few units in scale); on a CPU the
    target's own head (the rows then smoke-test their bodies)."""
    device = target.model.device
    if device.type != "cuda":
        return target.model.lm_head.weight.detach()
    g = torch.Generator(device=device).manual_seed(0)
    V, D = 126464, 4096
    return (torch.randn(V, D, generator=g, device=device) * 3 / D**0.5).to(torch.bfloat16)


def _head_call(op: str, impl: str, hidden, weight, *state):
    """``op`` on the head, fused (``impl`` "torch" or "triton") or unfused: the head GEMM, then the logits op (its
    kernel on CUDA)."""
    if impl != "unfused":
        return getattr(ops, op)(hidden, weight, *state, impl=impl)
    logits = hidden @ weight.T
    return getattr(ops, op.removeprefix("head_"))(logits, *state, impl="triton" if hidden.is_cuda else "torch")


def _clear_rows(hidden, weight, k: int, values=None):
    """Rows whose top k + 1 values (default: the head's logits) are apart by more than the fp32 sum-order error of a
    GEMM over D (about 1e-5 at D = 4096): there, discrete outputs must agree."""
    x = hidden.float() @ weight.float().T if values is None else values
    top = x.topk(min(k + 1, x.shape[1]), dim=1).values
    clear = ((top[:, :-1] - top[:, 1:]) > 1e-4 * top[:, :1].abs().clamp_min(1)).all(1)
    assert clear.any()
    return clear


def _head_setup(benchmark, target, machine, head, op: str, impl: str, R: int, state_bytes: float):
    device = head.device
    if impl == "triton":
        _impl_or_skip(impl, device)
    V, D = head.shape
    g = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(R, D, generator=g, device=device, dtype=head.dtype)
    benchmark.group = f"{op}-R{R}-V{V}-D{D}"
    # the floor: the weight once, the rows, the state; the unfused pair also writes and reads bf16 logits
    logits = 2 * R * V * head.element_size() if impl == "unfused" else 0
    _record(benchmark, machine, V * D * head.element_size() + R * D * hidden.element_size() + state_bytes + logits,
            2 * R * V * D, impl=impl, dtype=str(head.dtype))
    return hidden


@pytest.mark.parametrize("R", HEAD_ROWS)
@pytest.mark.parametrize("impl", HEAD_IMPLS)
def test_head_credit_fuse(benchmark, target, machine, head, impl, R):
    V = head.shape[0]
    hidden = _head_setup(benchmark, target, machine, head, "head_credit_fuse", impl, R, 2 * R * V * 4)
    device = hidden.device
    credit = torch.rand(R, V, device=device)
    rows = torch.arange(R, device=device)
    boost, fresh = rows % 2 == 0, rows % 4 == 3
    knobs = (0.7, 1.0, 0.9)
    # check before timing, from copies of the credit, where the raw and the fused top two are apart
    from tracelock.kernels.ref import head_credit_fuse_ref

    ref_credit, got_credit = credit.clone(), credit.clone()
    ref = head_credit_fuse_ref(hidden, head, ref_credit, boost, fresh, *knobs)
    got = _head_call("head_credit_fuse", impl, hidden, head, got_credit, boost, fresh, *knobs)
    fused = hidden.float() @ head.float().T + knobs[0] * torch.log(ref_credit + 1)
    clear = _clear_rows(hidden, head, 1) & _clear_rows(hidden, head, 1, fused)
    assert torch.equal(ref[0][clear], got[0][clear])
    torch.testing.assert_close(got[1][clear], ref[1][clear], rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(got_credit[clear], ref_credit[clear], rtol=1e-3, atol=1e-5)
    benchmark.pedantic(_synced(lambda: _head_call("head_credit_fuse", impl, hidden, head, credit, boost, fresh,
                                                  *knobs), device), rounds=20, warmup_rounds=2)
    _throughput(benchmark, machine)


@pytest.mark.parametrize("R", HEAD_ROWS)
@pytest.mark.parametrize("impl", HEAD_IMPLS)
def test_head_topk_js(benchmark, target, machine, head, impl, R):
    K = 8
    hidden = _head_setup(benchmark, target, machine, head, "head_topk_js", impl, R, 2 * R * K * 12)
    device = hidden.device
    from tracelock.kernels.ref import head_topk_js_ref, topk_js_ref

    # the previous step's top-K: that of nearby logits
    logits = hidden.float() @ head.float().T
    none = torch.zeros(R, dtype=torch.bool, device=device)
    prev_ids, prev_probs, _ = topk_js_ref(logits + 0.3 * torch.randn_like(logits),
                                          torch.zeros(R, K, dtype=torch.int64, device=device),
                                          torch.zeros(R, K, device=device), none)
    del logits
    state = (prev_ids, prev_probs, ~none)
    ref = head_topk_js_ref(hidden, head, *state)
    got = _head_call("head_topk_js", impl, hidden, head, *state)
    clear = _clear_rows(hidden, head, K)
    assert torch.equal(ref[0][clear], got[0][clear])
    for r, o in zip(ref[1:], got[1:]):
        torch.testing.assert_close(o[clear], r[clear], rtol=1e-3, atol=1e-5)
    benchmark.pedantic(_synced(lambda: _head_call("head_topk_js", impl, hidden, head, *state), device), rounds=20,
                       warmup_rounds=2)
    _throughput(benchmark, machine)


@pytest.mark.parametrize("R", HEAD_ROWS)
@pytest.mark.parametrize("impl", HEAD_IMPLS)
def test_head_step_kl(benchmark, target, machine, head, impl, R):
    V = head.shape[0]
    hidden = _head_setup(benchmark, target, machine, head, "head_step_kl", impl, R, 2 * R * V * 4)
    device = hidden.device
    from tracelock.kernels.ref import head_step_kl_ref

    # the previous step's logits (none for every fourth row); the unfused pair keeps their distribution
    prev_logits = hidden.float() @ head.float().T + torch.randn(R, V, device=device)
    prev_lse = torch.logsumexp(prev_logits, -1)
    prev_lse[::4] = float("inf")
    if impl == "unfused":
        state = (torch.where(prev_lse[:, None] == float("inf"), 0.0, (prev_logits - prev_lse[:, None]).exp()),)
    else:
        state = (prev_logits, prev_lse)
    ref_state, got_state = (prev_logits.clone(), prev_lse.clone()), tuple(t.clone() for t in state)
    ref = head_step_kl_ref(hidden, head, *ref_state)
    got = _head_call("head_step_kl", impl, hidden, head, *got_state)
    clear = _clear_rows(hidden, head, 1)
    assert torch.equal(ref[0][clear], got[0][clear])
    for r, o in zip(ref[1:], got[1:]):
        torch.testing.assert_close(o.float(), r, rtol=1e-3, atol=1e-4)
    if impl != "unfused":
        torch.testing.assert_close(got_state[1], ref_state[1], rtol=1e-4, atol=1e-4)
    benchmark.pedantic(_synced(lambda: _head_call("head_step_kl", impl, hidden, head, *state), device), rounds=20,
                       warmup_rounds=2)
    _throughput(benchmark, machine)
