"""commit_step: Triton (interpreter on CPU) against commit_step_ref, bit for bit: threshold boundary, cap, ties,
fallback, rows with no live slot, end tokens, NaN scores, the canvas invariant, and the dispatcher."""

import decimal
import math

import pytest
import torch

from tracelock import _triton, ops
from tracelock.kernels.ref import commit_margin_threshold, commit_step_ref
from tracelock.states import ACTIVE, EOT, LOCKED, PROMPT

pytestmark = pytest.mark.skipif(
    not _triton.triton_available or not (_triton.triton_interpret or torch.cuda.is_available()),
    reason="needs triton on CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
END_IDS = torch.tensor([3, 7], device=DEVICE)
# (B, L, R): odd lengths, B = 1 and 3, R odd, R above and below a power of two, a window wider than the canvas
SHAPES = [(1, 63, 7), (3, 63, 33), (3, 257, 33), (1, 257, 129), (3, 63, 65)]


def make_window(B, L, R, *, score_scale=3.0, score_dtype=torch.float32):
    """A canvas (prompt, then a generation region of ACTIVE, LOCKED and EOT positions) and a window of R slots
    from each row's first ACTIVE position; slots past the canvas end get out-of-range positions. Row 1 has no
    active slot, row 2 scores far below any threshold (the fallback fires)."""
    state = torch.full((B, L), PROMPT, dtype=torch.uint8)
    gen = torch.multinomial(torch.tensor([0.7, 0.2, 0.1]), B * (L - L // 4), replacement=True).view(B, -1)
    state[:, L // 4:] = torch.tensor([ACTIVE, LOCKED, EOT], dtype=torch.uint8)[gen]
    state[:, -1] = ACTIVE
    x = torch.randint(0, 50, (B, L))
    lo = (state == ACTIVE).int().argmax(1)
    positions = lo[:, None] + torch.arange(R)
    positions = torch.where(positions < L, positions, L + torch.arange(R))
    gathered = state.gather(1, positions.clamp(max=L - 1))
    active = (positions < L) & (gathered == ACTIVE)
    # the slot flags need not agree with the canvas: a stale flag on a LOCKED position must not move it
    active[:, -1] |= positions[:, -1] < L
    score = torch.randn(B, R) * score_scale
    tau = torch.randn(B)
    if B > 1:
        active[1] = False
    if B > 2:
        score[2] = -30.0 + torch.randn(R)
    proposal = torch.randint(0, 12, (B, R))  # ids 3 and 7 (END_IDS) come up often
    return [t.to(DEVICE) for t in (score.to(score_dtype), tau.to(score_dtype), active, proposal, positions, x, state)]


def rule_inputs(B, R, rule, score_dtype=torch.float32):
    """The rule's keyword arguments: a fallback score (confidence-like, with ties), held slots, inclusive, the
    end-of-text fill."""
    kw = {}
    if "fallback" in rule:
        kw["fallback_score"] = (torch.randint(0, 6, (B, R)) / 6).to(score_dtype).to(DEVICE)  # ties come up
    if "held" in rule:
        kw["held"] = (torch.rand(B, R) < 0.3).to(DEVICE)
    if "inclusive" in rule:
        kw["inclusive"] = True
    if "eot" in rule:
        kw.update(fill_id=99, stop_at_eot=True)
    return kw


def run_both(score, tau, active, proposal, positions, x, state, end_ids=END_IDS, theta=0.95, cap=0, **rule):
    from tracelock.kernels.commit_step import commit_step_triton

    ref_x, ref_state, tri_x, tri_state = x.clone(), state.clone(), x.clone(), state.clone()
    ref = commit_step_ref(score, tau, active, proposal, positions, ref_x, ref_state, end_ids, theta, cap, **rule)
    tri = commit_step_triton(score, tau, active, proposal, positions, tri_x, tri_state, end_ids, theta, cap, **rule)
    assert torch.equal(ref_x, tri_x), "x differs"
    assert torch.equal(ref_state, tri_state), "state differs"
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1]), (ref, tri)
    return tri_x, tri_state, tri


def committed(state_before, state_after):
    return (state_before != state_after).nonzero().tolist()


RULES = ["paper", "fallback", "held", "fallback-held", "inclusive", "eot", "fallback-held-eot"]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("theta, cap", [(0.95, 0), (0.5, 3), (0.9, 1), (0.0, 0)], ids=lambda v: str(v))
@pytest.mark.parametrize("B, L, R", SHAPES, ids=[f"B{b}-L{l}-R{r}" for b, l, r in SHAPES])
def test_commit_step_matches_ref(poisoned_empty, B, L, R, theta, cap, rule):
    args = make_window(B, L, R)
    kw = rule_inputs(B, R, rule)
    new_x, new_state, (first_active, n) = run_both(*args, theta=theta, cap=cap, **kw)
    state = args[6]
    moved = (new_state != state).sum(1)
    assert ((new_state != state) <= (state == ACTIVE)).all(), "only ACTIVE positions may move"
    if "eot" not in rule:
        assert torch.equal(moved, n)  # without the fill, the positions that moved are the slots committed
        if cap:
            assert (moved <= cap).all()
    if B > 1:
        assert n[1] == 0  # no active slot
    if B > 2 and theta > 0 and "held" not in rule:
        assert n[2] == 1  # nothing passes: the fallback commits exactly one
    still = torch.cat([new_state == ACTIVE, torch.ones(B, 1, dtype=torch.bool, device=DEVICE)], 1)
    assert torch.equal(first_active, torch.where(still, torch.arange(L + 1, device=DEVICE), L).amin(1))


@pytest.mark.parametrize("rule", ["paper", "fallback-held", "fallback-held-eot"])
def test_commit_step_eot_fill_is_apply_commits_fill(rule):
    """With stop_at_eot, the step is the same step without it followed by apply_commits' tail fill (no commit)."""
    from tracelock.kernels.ref import apply_commits_ref

    score, tau, active, proposal, positions, x, state = make_window(3, 63, 33)
    kw = rule_inputs(3, 33, rule)
    kw.pop("stop_at_eot", None), kw.pop("fill_id", None)
    want_x, want_state = x.clone(), state.clone()
    commit_step_ref(score, tau, active, proposal, positions, want_x, want_state, END_IDS, 0.6, 0, **kw)
    none = torch.zeros_like(want_x, dtype=torch.bool)
    want_first = apply_commits_ref(want_x, want_state, want_x.clone(), none, END_IDS, 99, True)
    got_x, got_state, (got_first, _) = run_both(score, tau, active, proposal, positions, x, state, theta=0.6,
                                                fill_id=99, stop_at_eot=True, **kw)
    assert torch.equal(got_x, want_x) and torch.equal(got_state, want_state) and torch.equal(got_first, want_first)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_commit_step_lowp_scores(dtype):
    run_both(*make_window(3, 63, 33, score_dtype=dtype), theta=0.9, cap=4, **rule_inputs(3, 33, "fallback", dtype))


@pytest.mark.parametrize("inclusive", [False, True], ids=["strict", "inclusive"])
@pytest.mark.parametrize("theta", [0.5, 0.9, 0.95, 0.99, 0.999, 1e-3, 0.3])
def test_commit_margin_threshold_brackets_logit(theta, inclusive):
    """t is the largest fp32 below logit(theta) (computed here to 60 digits), or at it for the strict rule: an fp32
    margin m has sigmoid(m) > theta (>= theta, inclusive) exactly when m > t."""
    with decimal.localcontext(decimal.Context(prec=60)):
        th = decimal.Decimal(theta)
        logit = th.ln() - (1 - th).ln()
    t = commit_margin_threshold(theta, inclusive)
    above = float(torch.nextafter(torch.tensor(t), torch.tensor(math.inf)))
    if inclusive:
        assert decimal.Decimal(t) < logit <= decimal.Decimal(above)
    else:
        assert decimal.Decimal(t) <= logit < decimal.Decimal(above)


@pytest.mark.parametrize("inclusive", [False, True], ids=["strict", "inclusive"])
def test_commit_step_threshold_boundary(inclusive):
    """theta = 0.5 is logit 0, an fp32 value: p == theta commits under the inclusive rule only; the next fp32
    margin up commits under both, the next one down under neither. Slot 0 passes, so the fallback stays out."""
    tiny = float(torch.nextafter(torch.tensor(0.0), torch.tensor(1.0)))
    score = torch.tensor([[10.0, 0.0, tiny, -tiny]], device=DEVICE)
    args = (score, torch.zeros(1, device=DEVICE), torch.ones(1, 4, dtype=torch.bool, device=DEVICE),
            torch.tensor([[20, 21, 22, 23]], device=DEVICE), torch.tensor([[0, 1, 2, 3]], device=DEVICE),
            torch.zeros(1, 5, dtype=torch.int64, device=DEVICE),
            torch.full((1, 5), ACTIVE, dtype=torch.uint8, device=DEVICE))
    x, state, (first_active, n) = run_both(*args, theta=0.5, inclusive=inclusive)
    assert x.tolist() == ([[20, 21, 22, 0, 0]] if inclusive else [[20, 0, 22, 0, 0]])
    assert first_active.tolist() == ([3] if inclusive else [1]) and n.tolist() == [3 if inclusive else 2]


def test_commit_step_threshold_is_strict():
    """p == theta does not commit; the next fp32 margin up does. Slot 0 passes, so the fallback stays out."""
    for theta in (0.5, 0.95):
        t = commit_margin_threshold(theta)
        above = float(torch.nextafter(torch.tensor(t), torch.tensor(math.inf)))
        score = torch.tensor([[10.0, t, above, t]], device=DEVICE)
        args = (score, torch.zeros(1, device=DEVICE), torch.ones(1, 4, dtype=torch.bool, device=DEVICE),
                torch.tensor([[20, 21, 22, 23]], device=DEVICE), torch.tensor([[0, 1, 2, 3]], device=DEVICE),
                torch.zeros(1, 5, dtype=torch.int64, device=DEVICE),
                torch.full((1, 5), ACTIVE, dtype=torch.uint8, device=DEVICE))
        x, state, (first_active, n) = run_both(*args, theta=theta)
        assert x.tolist() == [[20, 0, 22, 0, 0]], theta
        assert first_active.tolist() == [1] and n.tolist() == [2]


def canvas(R, L=None):
    L = L or R + 2
    return (torch.ones(1, R, dtype=torch.bool, device=DEVICE), torch.arange(10, 10 + R, device=DEVICE)[None],
            torch.arange(R, device=DEVICE)[None], torch.zeros(1, L, dtype=torch.int64, device=DEVICE),
            torch.full((1, L), ACTIVE, dtype=torch.uint8, device=DEVICE))


@pytest.mark.parametrize(
    "margins, theta, cap, live, want, rule",
    [
        # cap: the cap highest pass, ties to the lowest slot
        pytest.param([5, 5, 9, 5, 1], 0.95, 2, None, [2, 0], {}, id="cap-ties"),
        # fp32 sigmoid is 1.0 for both 30 and 20; the order is the exact probabilities', so slot 1 wins
        pytest.param([20, 30, 25, 0], 0.95, 1, None, [1], {}, id="cap-saturated"),
        # nothing passes: the best live slot, ties to the lowest live one (slot 0 is not live)
        pytest.param([-4, -1, -3, -1, -1], 0.95, 0, [0, 1, 1, 1, 1], [1], {}, id="fallback-ties"),
        # theta = 1: nothing can pass, the fallback still commits one
        pytest.param([50, 60, 60], 1.0, 0, None, [1], {}, id="theta-one"),
        # a live margin of -inf (p = 0) is still the best of a row with nothing else live
        pytest.param([-math.inf, 3, 4], 0.95, 0, [1, 0, 0], [0], {}, id="fallback-minus-inf"),
        # NaN never commits, not even as the fallback
        pytest.param([math.nan, -9, -5], 0.95, 0, None, [2], {}, id="nan-skipped"),
        pytest.param([math.nan, math.nan], 0.5, 0, None, [], {}, id="all-nan"),
        pytest.param([1, 2, 3], 0.5, 0, [0, 0, 0], [], {}, id="no-live-slot"),
        # theta = 0: every slot with p > 0 passes, i.e. all but m = -inf
        pytest.param([-80, -math.inf, 0], 0.0, 0, None, [0, 2], {}, id="theta-zero"),
        # the shipped rule's fallback: the highest fallback score, not the highest margin, ties to the lowest slot
        pytest.param([-1, -5, -5, -2], 0.95, 0, None, [1], dict(fallback_score=[0.2, 0.9, 0.9, 0.5]),
                     id="fallback-score"),
        # a NaN fallback score never wins; a NaN margin is not a candidate whatever its fallback score
        pytest.param([math.nan, -5, -5], 0.95, 0, None, [2], dict(fallback_score=[0.9, math.nan, 0.1]),
                     id="fallback-score-nan"),
        # held slots neither pass nor fall back, whatever their scores
        pytest.param([9, 9, -9, 9], 0.95, 0, None, [1], dict(held=[True, False, False, True]), id="held-pass"),
        pytest.param([-1, -5, -9], 0.95, 0, None, [2], dict(held=[True, True, False]), id="held-fallback"),
        pytest.param([-1, -5, -9], 0.95, 0, None, [1], dict(held=[True, False, False], fallback_score=[1, .5, .4]),
                     id="held-fallback-score"),
        pytest.param([9, 9], 0.95, 0, None, [], dict(held=[True, True]), id="all-held"),
        # the cap ranks the passing slots that are not held
        pytest.param([9, 8, 7, 6], 0.95, 2, None, [1, 3], dict(held=[True, False, True, False]), id="held-cap"),
    ],
)
def test_commit_step_rule(margins, theta, cap, live, want, rule):
    R = len(margins)
    active, proposal, positions, x, state = canvas(R)
    if live is not None:
        active = torch.tensor([live], dtype=torch.bool, device=DEVICE)
    kw = {}
    if "fallback_score" in rule:
        kw["fallback_score"] = torch.tensor([rule["fallback_score"]], dtype=torch.float32, device=DEVICE)
    if "held" in rule:
        kw["held"] = torch.tensor([rule["held"]], device=DEVICE)
    score, tau = torch.tensor([margins], device=DEVICE), torch.zeros(1, device=DEVICE)
    before = state.clone()
    _, new_state, (_, n) = run_both(score, tau, active, proposal, positions, x, state, theta=theta, cap=cap, **kw)
    assert sorted(p for _, p in committed(before, new_state)) == sorted(want)
    assert n.tolist() == [len(want)]


def test_commit_step_canvas_invariant_and_end_tokens():
    """A slot flagged active on a LOCKED or PROMPT position never moves and is not a fallback candidate; an end
    token becomes EOT; with no end ids everything becomes LOCKED; a fully committed row is done."""
    score = torch.tensor([[9.0, 9.0, 9.0, -9.0], [9.0, 9.0, -9.0, -9.0]], device=DEVICE)
    tau = torch.zeros(2, device=DEVICE)
    active = torch.ones(2, 4, dtype=torch.bool, device=DEVICE)
    proposal = torch.tensor([[7, 5, 3, 6], [8, 9, 10, 11]], device=DEVICE)
    positions = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]], device=DEVICE)
    x = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    state = torch.tensor([[ACTIVE, LOCKED, ACTIVE, ACTIVE], [PROMPT, ACTIVE, LOCKED, LOCKED]], dtype=torch.uint8,
                         device=DEVICE)
    new_x, new_state, (first_active, n) = run_both(score, tau, active, proposal, positions, x, state)
    assert new_state.tolist() == [[EOT, LOCKED, EOT, ACTIVE], [PROMPT, LOCKED, LOCKED, LOCKED]]
    assert new_x.tolist() == [[7, 0, 3, 0], [0, 9, 0, 0]]
    assert first_active.tolist() == [3, 4] and n.tolist() == [2, 1]
    # stop_at_eot: the tail after the first EOT (slot 0's end token) is filled, the fill is not a commit
    new_x, new_state, (first_active, n) = run_both(score, tau, active, proposal, positions, x, state, fill_id=42,
                                                   stop_at_eot=True)
    assert new_state[0].tolist() == [EOT, LOCKED, EOT, EOT] and new_x[0].tolist() == [7, 0, 3, 42]
    assert first_active.tolist() == [4, 4] and n.tolist() == [2, 1]
    no_end = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    _, new_state, _ = run_both(score, tau, active, proposal, positions, x, state, end_ids=no_end)
    assert new_state[0].tolist() == [LOCKED, LOCKED, LOCKED, ACTIVE]


@pytest.mark.parametrize("rule", RULES)
def test_commit_step_dispatch_torch_equals_triton(rule):
    score, tau, active, proposal, positions, x, state = make_window(3, 257, 33)
    kw = rule_inputs(3, 33, rule)
    got = {}
    for impl in ("torch", "triton"):
        x_i, state_i = x.clone(), state.clone()
        first, n = ops.commit_step(score, tau, active, proposal, positions, x_i, state_i, END_IDS, 0.9, 2,
                                   impl=impl, **kw)
        got[impl] = (x_i, state_i, first, n)
    assert all(torch.equal(a, b) for a, b in zip(got["torch"], got["triton"]))
    assert ops.pick("commit_step", None, torch.device(DEVICE)) == "triton"


def test_commit_step_unavailable_triton(monkeypatch):
    monkeypatch.setattr(_triton, "triton_available", False)
    args = [t.cpu() for t in make_window(1, 63, 7)]
    with pytest.raises(RuntimeError, match="impl='triton' cannot run commit_step: triton is not installed"):
        ops.commit_step(*args, END_IDS.cpu(), 0.95, impl="triton")


def _args(**bad):
    B, L, R = 2, 9, 3
    args = dict(score=torch.zeros(B, R), tau=torch.zeros(B), active=torch.ones(B, R, dtype=torch.bool),
                proposal=torch.zeros(B, R, dtype=torch.int64), positions=torch.zeros(B, R, dtype=torch.int64),
                x=torch.zeros(B, L, dtype=torch.int64), state=torch.ones(B, L, dtype=torch.uint8),
                end_ids=torch.tensor([1]), theta=0.95, cap=0)
    return args | bad


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        pytest.param(dict(score=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "score must be float32",
                     id="score-dtype"),
        pytest.param(dict(score=torch.zeros(3, 3)), ValueError, r"score must be \[B, R\] with B = 2", id="score-rows"),
        pytest.param(dict(score=torch.zeros(2, 0)), ValueError, "R >= 1", id="score-empty"),
        pytest.param(dict(tau=torch.zeros(2, 1)), ValueError, r"tau must have shape \[2\]", id="tau-shape"),
        pytest.param(dict(active=torch.ones(2, 3, dtype=torch.uint8)), TypeError, "active must be bool",
                     id="active-dtype"),
        pytest.param(dict(positions=torch.zeros(2, 3, dtype=torch.int32)), TypeError, "positions must be int64",
                     id="positions-dtype"),
        pytest.param(dict(state=torch.ones(2, 8, dtype=torch.uint8)), ValueError, r"state must have shape \[2, 9\]",
                     id="state-shape"),
        pytest.param(dict(end_ids=torch.tensor([[1]])), ValueError, r"end_ids must be \[E\]", id="end_ids-2d"),
        pytest.param(dict(theta=1.5), ValueError, r"theta must be a probability in \[0, 1\]", id="theta-range"),
        pytest.param(dict(theta=math.nan), ValueError, "theta must be a probability", id="theta-nan"),
        pytest.param(dict(cap=-1), ValueError, "cap must be an int >= 0", id="cap-negative"),
        pytest.param(dict(cap=2.0), ValueError, "cap must be an int >= 0", id="cap-float"),
        pytest.param(dict(proposal=torch.zeros(2, 3, dtype=torch.int64, device="meta")), ValueError,
                     "proposal must be on cpu like x", id="proposal-device"),
        pytest.param(dict(fallback_score=torch.zeros(2, 4)), ValueError, r"fallback_score must have shape \[2, 3\]",
                     id="fallback-shape"),
        pytest.param(dict(fallback_score=torch.zeros(2, 3, dtype=torch.int64)), TypeError,
                     "fallback_score must be float32 or float16 or bfloat16, got torch.int64", id="fallback-dtype"),
        pytest.param(dict(held=torch.zeros(2, 3)), TypeError, "held must be bool", id="held-dtype"),
        pytest.param(dict(held=torch.zeros(3, 3, dtype=torch.bool)), ValueError, r"held must have shape \[2, 3\]",
                     id="held-shape"),
        pytest.param(dict(inclusive=1), TypeError, "inclusive must be a bool", id="inclusive-int"),
        pytest.param(dict(stop_at_eot="yes"), TypeError, "stop_at_eot must be a bool", id="stop-at-eot-str"),
        pytest.param(dict(fill_id=1.5), TypeError, "fill_id must be an int token id", id="fill-id-float"),
        pytest.param(dict(score=torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]])), ValueError,
                     "score is NaN at an active slot", id="score-nan"),
        pytest.param(dict(tau=torch.tensor([0.0, math.nan])), ValueError, "tau is NaN at an active slot",
                     id="tau-nan"),
        pytest.param(dict(fallback_score=torch.tensor([[0.0, 0.0, 0.0], [math.nan, 0.0, 0.0]])), ValueError,
                     "fallback_score is NaN at an active slot", id="fallback-nan"),
    ],
)
def test_commit_step_validation(bad, exc, match):
    with pytest.raises(exc, match=match):
        ops.commit_step(**_args(**bad), impl="torch")


def test_a_nan_score_at_an_inactive_slot_is_no_error():
    """Only the slots that may commit are checked: padding slots past the region may hold anything."""
    score = torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]])
    active = torch.tensor([[True, False, True], [True, True, True]])
    first, n = ops.commit_step(**_args(score=score, active=active), impl="torch")
    assert n.tolist() == [1, 1]
