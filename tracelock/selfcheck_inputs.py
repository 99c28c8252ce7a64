"""The small inputs `tracelock.selfcheck` runs a Triton op and its torch spec on: one builder per op, taking the
widths and flags (which optional arguments are given, the booleans, the activation) from the call being checked, or
defaults when there is none (``tracelock env``). Values are seeded, drawn on the CPU (never the global generator),
then moved to the device; discrete outputs are kept away from ties and thresholds."""

import math

import torch

from tracelock.states import ACTIVE

# the largest vocabulary / width a check draws: the op's code paths, not its real size
_V, _W = 300, 256


def _randn(g, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def window_logits_stats_inputs(a, g, device, dtype):
    D = a[0].shape[1] if a else 64
    V = min(a[1].shape[0], _V) if a else _V - 1
    wdt = a[1].dtype if a else dtype
    eos = None if a and a[2] is None else 1
    return (_randn(g, 3, D, dtype=dtype, device=device), _randn(g, V, D, dtype=wdt, device=device, scale=D**-0.5),
            eos)


def tap_project_inputs(a, g, device, dtype):
    D, N = (a[3].shape[1], a[3].shape[2]) if a else (64, 24)
    adt, cdt = (a[3].dtype, a[4].dtype) if a else (torch.float32, torch.float32)
    taps = tuple(_randn(g, 5, D, dtype=dtype, device=device) for _ in range(3))
    return (*taps, _randn(g, 3, D, N, dtype=adt, device=device, scale=D**-0.5), _randn(g, N, dtype=cdt, device=device))


def commit_step_inputs(a, g, device, dtype):
    B, R, L = 2, 8, 12
    theta, cap = (float(a[8]), a[9]) if a else (0.9, 0)
    # margins at least 0.5 from the threshold's: no slot sits on it
    bar = math.log(theta / (1 - theta)) if 0 < theta < 1 else 0.0
    m = torch.rand(B, R, generator=g) * 4 - 2
    score = (bar + m + 0.5 * m.sign()).to(device=device, dtype=dtype)
    tau = torch.zeros(B, device=device, dtype=a[1].dtype if a else dtype)
    active = torch.ones(B, R, dtype=torch.bool)
    active[1, 2] = False
    proposal = torch.randint(3, 50, (B, R), generator=g)
    proposal[0, 5] = 2  # an end token
    positions = (L - R + torch.arange(R)).expand(B, R).contiguous()
    state = torch.full((B, L), ACTIVE, dtype=torch.uint8)
    state[:, : L - R] = 0
    fallback = None if a is None or a[10] is None else torch.randperm(B * R, generator=g).view(B, R).float()
    held = None if a is None or a[11] is None else torch.rand(B, R, generator=g) < 0.25
    flags = a[12:15] if a else (False, 0, True)
    cpu = (active, proposal, positions, torch.zeros(B, L, dtype=torch.long), state, torch.tensor([1, 2]))
    active, proposal, positions, x, state, end_ids = (t.to(device) for t in cpu)
    extra = tuple(None if t is None else t.to(device) for t in (fallback, held))
    return (score, tau, active, proposal, positions, x, state, end_ids, theta, cap, *extra, *flags)


def add_rms_norm_inputs(a, g, device, dtype):
    D = a[0].shape[1] if a else 64
    wdt = a[2].dtype if a else dtype
    residual = None if a and a[1] is None else _randn(g, 3, D, dtype=dtype, device=device)
    return (_randn(g, 3, D, dtype=dtype, device=device), residual, _randn(g, D, dtype=wdt, device=device),
            float(a[3]) if a else 1e-5)


def rope_qkv_inputs(a, g, device, dtype):
    H, K, hd, fp32 = (a[3], a[4], a[5], a[6]) if a else (4, 2, 16, True)
    B, Q, Lc = 1, 3, 6
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat([torch.tensor([[5.0, 1.0, 2.0]])[..., None] * inv] * 2, dim=-1)
    out = (_randn(g, B, Q, (H + 2 * K) * hd, dtype=dtype, device=device), emb.cos().to(device), emb.sin().to(device),
           H, K, hd, fp32)
    if a and a[7] is None:
        return out
    caches = tuple(_randn(g, B, K, Lc, hd, dtype=dtype, device=device) for _ in range(2))
    return (*out, *caches, torch.tensor([[5, 1, 2]], device=device))


def silu_mul_inputs(a, g, device, dtype):
    F = min(a[0].shape[1] // 2, _W) if a else 40
    return (_randn(g, 3, 2 * F, dtype=dtype, device=device, scale=3.0),)


def linear_rows_inputs(a, g, device, dtype):
    act = a[4] if a else None
    K = min(a[0].shape[1], _W) if a else 96
    N = min(a[1].shape[0] // 2, _W // 2) * 2 if a else 80
    bdt = a[2].dtype if a and a[2] is not None else dtype
    bias = None if a and a[2] is None else _randn(g, N, dtype=bdt, device=device)
    n_out = N // 2 if act == "silu_mul" else N
    rdt = a[3].dtype if a and a[3] is not None else dtype
    residual = None if a and a[3] is None else _randn(g, 2, n_out, dtype=rdt, device=device)
    return (_randn(g, 2, K, dtype=dtype, device=device), _randn(g, N, K, dtype=dtype, device=device, scale=K**-0.5),
            bias, residual, act)


def _logits(a, g, device, dtype, N=3):
    V = min(a[0].shape[1], _V) if a else _V - 1
    return _randn(g, N, V, dtype=dtype, device=device, scale=3.0)


def credit_fuse_inputs(a, g, device, dtype):
    logits = _logits(a, g, device, dtype)
    N, V = logits.shape
    credit = torch.rand(N, V, generator=g).to(device)
    boost, fresh = torch.tensor([True, True, False], device=device), torch.tensor([False, True, False], device=device)
    return (logits, credit, boost, fresh, *(tuple(float(x) for x in a[4:7]) if a else (0.5, 1.0, 0.9)))


def step_kl_inputs(a, g, device, dtype):
    logits = _logits(a, g, device, dtype)
    pdt = a[1].dtype if a else torch.float32
    prev = torch.randn(logits.shape, generator=g).softmax(-1).to(device=device, dtype=pdt)
    prev[0] = 0  # a slot with no previous pass
    return logits, prev


def topk_js_inputs(a, g, device, dtype):
    logits = _logits(a, g, device, dtype)
    N, V = logits.shape
    K = min(a[1].shape[1], V) if a else 4
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)]).to(device)
    probs = (torch.rand(N, K, generator=g) / K).to(device)
    return logits, ids, probs, torch.tensor([True, False, True], device=device)


def _head(a, g, device, dtype, R=3):
    """Hidden rows and a head weight whose logits are a few units in scale (as `_logits`)."""
    D = a[0].shape[1] if a else 64
    V = min(a[1].shape[0], _V) if a else _V - 1
    wdt = a[1].dtype if a else dtype
    return (_randn(g, R, D, dtype=dtype, device=device),
            _randn(g, V, D, dtype=wdt, device=device, scale=3 * D**-0.5))


def head_credit_fuse_inputs(a, g, device, dtype):
    hidden, weight = _head(a, g, device, dtype)
    credit = torch.rand(3, weight.shape[0], generator=g).to(device)
    boost, fresh = torch.tensor([True, True, False], device=device), torch.tensor([False, True, False], device=device)
    return (hidden, weight, credit, boost, fresh, *(tuple(float(x) for x in a[5:8]) if a else (0.5, 1.0, 0.9)))


def head_topk_js_inputs(a, g, device, dtype):
    hidden, weight = _head(a, g, device, dtype)
    V = weight.shape[0]
    K = min(a[2].shape[1], V) if a else 4
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(3)]).to(device)
    probs = (torch.rand(3, K, generator=g) / K).to(device)
    return hidden, weight, ids, probs, torch.tensor([True, False, True], device=device)


def head_step_kl_inputs(a, g, device, dtype):
    hidden, weight = _head(a, g, device, dtype)
    prev_logits = torch.randn(3, weight.shape[0], generator=g) * 3
    prev_lse = prev_logits.logsumexp(-1)
    prev_lse[0] = float("inf")  # a slot with no previous pass
    return hidden, weight, prev_logits.to(device), prev_lse.to(device)


# op -> its small input's builder
BUILDERS = {f.__name__.removesuffix("_inputs"): f for f in (
    window_logits_stats_inputs, tap_project_inputs, commit_step_inputs, add_rms_norm_inputs, rope_qkv_inputs,
    silu_mul_inputs, linear_rows_inputs, credit_fuse_inputs, step_kl_inputs, topk_js_inputs, head_credit_fuse_inputs,
    head_topk_js_inputs, head_step_kl_inputs)}
