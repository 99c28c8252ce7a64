"""Golden tests of the heuristic policies, from the published rules (docs/design.md, "Where the rules come from")
on constructed inputs.

Every expected selection below is worked out by hand in the comments, never by calling a policy twice.
"""

import pytest
import torch

from tracelock.policies import POLICIES, Policy, StepInput, make_policy
from tracelock.signals import Signals


def _rows(x, dtype):
    t = torch.tensor(x, dtype=dtype)
    return t.unsqueeze(0) if t.dim() == 1 else t


def _inp(conf, active=None, *, step=0, initial=None, remaining=None, budget=1, margin=None, neg_entropy=None):
    """StepInput for hand-written scores; margin/neg_entropy default to the confidences."""
    conf = _rows(conf, torch.float32)
    b, r = conf.shape
    active = torch.ones(b, r, dtype=torch.bool) if active is None else _rows(active, torch.bool)
    count = active.sum(-1)

    def vec(v, default):
        return default.clone() if v is None else torch.as_tensor(v, dtype=torch.long).expand(b).clone()

    sig = Signals(
        proposal=torch.zeros(b, r, dtype=torch.long),
        confidence=conf,
        margin=conf if margin is None else _rows(margin, torch.float32),
        neg_entropy=conf if neg_entropy is None else _rows(neg_entropy, torch.float32),
        eos_prob=torch.zeros(b, r),
    )
    return StepInput(sig, active, vec(step, count * 0), vec(initial, count), vec(remaining, count), budget)


def _picked(mask, row=0):
    return mask[row].nonzero().flatten().tolist()


def _run_region(policy, conf, active=None, generator=None, max_steps=64, **scores):
    """Drive one schedule region (one row) to the end; returns the slots committed at each step."""
    inp = _inp(conf, active, **scores)
    initial, steps = inp.active.sum(-1), []
    while inp.active.any() and len(steps) < max_steps:
        inp.region_step[:] = len(steps)
        inp.region_initial, inp.region_active = initial, inp.active.sum(-1)
        inp.steps_per_region = policy.steps_per_region()
        mask = policy.select(inp, generator)
        assert not (mask & ~inp.active).any(), "committed an inactive slot"
        steps.append(_picked(mask))
        inp.active = inp.active & ~mask
    return steps


CONF10 = [0.30, 0.95, 0.10, 0.80, 0.55, 0.20, 0.90, 0.40, 0.65, 0.05]


def test_llada_confidence_block_golden():
    # gen 20, 2 blocks, steps 8: S = 4 per block; M = 10 -> 10 // 4 = 2, 10 % 4 = 2: counts 3, 3, 2, 2
    policy = make_policy("confidence", steps=8)
    policy.setup(gen_length=20, num_regions=2)
    assert policy.steps_per_region() == 4
    # descending confidence: 1 (.95), 6 (.90), 3 (.80), 8 (.65), 4 (.55), 7 (.40), 0 (.30), 5 (.20), 2, 9
    assert _run_region(policy, CONF10) == [[1, 3, 6], [4, 7, 8], [0, 5], [2, 9]]


def test_llada_confidence_padding_and_zero_steps():
    policy = make_policy("confidence")
    policy.setup(gen_length=8, num_regions=2)  # S = 4
    # M = 2 active of 6 slots (padding holds the highest scores): counts 1, 1, 0, 0; k = 0 commits nothing
    conf = [0.99, 0.2, 0.98, 0.7, 0.97, 0.96]
    active = [False, True, False, True, False, False]
    assert _run_region(policy, conf, active) == [[3], [1]]
    inp = _inp(conf, [False, True, False, False, False, False], step=2, initial=2, budget=4)
    assert _picked(policy.select(inp)) == []
    # budget spent (step 4 >= S = 4) with positions left: every active candidate is committed
    inp = _inp(conf, active, step=4, initial=2, budget=4)
    assert _picked(policy.select(inp)) == [1, 3]
    # a window clamps k: M = 10 asks for 3 at step 0, but only 2 candidates are active
    inp = _inp(conf, active, step=0, initial=10, budget=4)
    assert _picked(policy.select(inp)) == [1, 3]


def test_llada_confidence_per_row_and_ties():
    policy = make_policy("confidence", steps=4)
    policy.setup(gen_length=4, num_regions=1)
    # row 0: M = 9, S = 4 -> k0 = 3; row 1: M = 2 -> k0 = 1; equal scores go to the lowest index
    conf = [[0.5, 0.9, 0.5, 0.9, 0.5], [0.1, 0.4, 0.4, 0.2, 0.0]]
    inp = _inp(conf, step=0, initial=[9, 2], budget=4)
    mask = policy.select(inp)
    assert _picked(mask, 0) == [0, 1, 3] and _picked(mask, 1) == [1]


def test_random_commits_scheduled_count_on_active_only():
    policy = make_policy("random", steps=4)
    policy.setup(gen_length=40, num_regions=4)  # S = 1: one step commits the whole region
    assert not policy.deterministic
    active = [i % 3 != 0 for i in range(12)]
    gen = torch.Generator().manual_seed(7)
    assert _run_region(policy, [0.5] * 12, active, generator=gen) == [[i for i in range(12) if i % 3]]
    policy = make_policy("random", steps=12)
    policy.setup(gen_length=12, num_regions=1)  # S = 12, M = 8: counts 1 x 8 then 0 x 4
    steps = _run_region(policy, [0.5] * 12, active, generator=gen)
    assert [len(s) for s in steps] == [1] * 8
    assert sorted(sum(steps, [])) == [i for i in range(12) if i % 3]


def test_topk_golden():
    policy = make_policy("topk", k=2)
    policy.setup(gen_length=10, num_regions=1)
    assert policy.steps_per_region() == 5
    # ties (.9 at 1 and 3) -> lowest index; slot 4 (.99) is inactive
    assert _picked(policy.select(_inp([0.5, 0.9, 0.1, 0.9, 0.99], [1, 1, 1, 1, 0]))) == [1, 3]
    assert _picked(policy.select(_inp([0.5, 0.9], [0, 1]))) == [1]


def test_fastdllm_threshold_golden():
    policy = make_policy("threshold", tau=0.9)
    policy.setup(gen_length=32, num_regions=1)
    # conf >= tau passes (0.9 itself, as upstream drops only conf < threshold); 0.95 at slot 4 is inactive
    conf = [[0.9, 0.8999, 0.93, 0.3, 0.95], [0.5, 0.7, 0.7, 0.2, 0.99], [0.99, 0.98, 0.1, 0.1, 0.1]]
    active = [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]
    mask = policy.select(_inp(conf, active))
    assert _picked(mask, 0) == [0, 2]
    # nothing passes: the top-1 is forced (tie 0.7 -> slot 1); a row without active slots commits nothing
    assert _picked(mask, 1) == [1]
    assert _picked(mask, 2) == []
    assert _picked(make_policy("threshold", tau=1.0).select(_inp([0.2, 1.0, 1.0]))) == [1, 2]


def test_fastdllm_threshold_dream_first_token_golden():
    policy = make_policy("threshold", tau=0.9, first_token=True)
    policy.setup(gen_length=32, num_regions=1)
    # CONF10, tau 0.9: the region's first step commits slot 0 (conf 0.30) alone; then 0.95 and 0.90 together,
    # then one per step by confidence (0.80, 0.65, 0.55, 0.40, 0.20, 0.10, 0.05)
    assert _run_region(policy, CONF10) == [[0], [1, 6], [3], [8], [4], [7], [5], [2], [9]]
    # the first *masked* slot when slot 0 is already committed; rows follow their own region step
    mask = policy.select(_inp([CONF10, CONF10], [[0] + [1] * 9, [1] * 10], step=[0, 3]))
    assert _picked(mask, 0) == [1]
    assert _picked(mask, 1) == [1, 6]


@pytest.mark.parametrize(
    "sorted_conf, f, valid, quirk",
    [
        # f = 1: thresholds by rank n: forced, 1 - 1/3 = .667, 1 - 1/4 = .75, .8, .833
        ([0.95, 0.9, 0.7, 0.6, 0.2], 1.0, 2, 2),  # n = 3 fails (.7 < .75) -> prefix 2, quirk inert
        ([0.9, 0.8, 0.76, 0.5], 1.0, 3, 4),  # only the last (N - 1 = 3) fails: the quirk commits all 4
        ([0.5, 0.3], 1.0, 1, 2),  # N = 2, second fails (.3 < .667): quirk commits both
        ([0.99, 0.9, 0.8, 0.85], 1.0, 4, 4),  # .85 >= .8 at n = 4: all valid
        ([0.01], 1.0, 1, 1),  # a single candidate is forced
        # f = 2: thresholds forced, 1 - 2/3 = .333, .5, .6, .667
        ([0.4, 0.35, 0.2, 0.1, 0.05, 0.01], 2.0, 2, 2),
    ],
)
def test_fastdllm_factor_golden(sorted_conf, f, valid, quirk):
    n = len(sorted_conf)
    # scatter the sorted values over shuffled active slots, with an inactive 1.0 in front
    slots = torch.randperm(n) + 1
    conf = torch.zeros(n + 1)
    conf[0] = 1.0
    conf[slots] = torch.tensor(sorted_conf)
    active = [False] + [True] * n
    for release_quirk, length in ((False, valid), (True, quirk)):
        policy = make_policy("factor", f=f, release_quirk=release_quirk)
        got = _picked(policy.select(_inp(conf.tolist(), active)))
        assert got == sorted(slots[:length].tolist()), (release_quirk, length)


@pytest.mark.parametrize(
    "sorted_conf, delta, length",
    [
        # score_n = c_1 + ... + c_n - (n - 1) - (1 - c_n); n = 1 is forced
        # .99, .95, .9, .6: n = 2: 1.94 - 1 - .05 = .89; n = 3: 2.84 - 2 - .1 = .74; n = 4: 3.44 - 3 - .4 = .04
        ([0.99, 0.95, 0.9, 0.6], 0.0, 4),
        ([0.99, 0.95, 0.9, 0.6], 0.05, 3),  # .04 does not clear .05
        ([0.99, 0.95, 0.9, 0.6], 0.8, 2),  # .74 does not clear .8
        ([0.99, 0.95, 0.9, 0.6], 0.9, 1),  # only the forced first
        ([0.99, 0.95, 0.9, 0.6], -0.5, 4),
        # equal confidences 1 - eps, eps = 5/16 (exact in fp32): score_n = 1 - (n + 1) eps > 0 for n <= 2
        ([0.6875] * 5, 0.0, 2),
        # eps = 1/4: score_3 = 1 - 4/4 = 0 is not > 0 (the rule is strict), so 2
        ([0.75] * 5, 0.0, 2),
        # n = 2: .5 + .5 - 1 - .5 = -.5; a negative delta takes more: -.5 is not > -.5, -1.5 (n = 3) neither
        ([0.5, 0.5, 0.5], -0.5, 1),
        ([0.5, 0.5, 0.5], -0.6, 2),
        ([0.01], 0.0, 1),  # a single candidate is forced
    ],
)
def test_frechet_golden(sorted_conf, delta, length):
    n = len(sorted_conf)
    # scatter the sorted values over shuffled active slots, with an inactive 1.0 in front
    slots = torch.randperm(n) + 1
    conf = torch.zeros(n + 1)
    conf[0] = 1.0
    conf[slots] = torch.tensor(sorted_conf)
    policy = make_policy("frechet", delta=delta)
    policy.setup(gen_length=32, num_regions=1)
    got = _picked(policy.select(_inp(conf.tolist(), [False] + [True] * n)))
    assert len(got) == length
    # the committed slots are the `length` most confident (ties to the lowest slot)
    by_conf = sorted(range(1, n + 1), key=lambda i: (-float(conf[i]), i))
    assert got == sorted(by_conf[:length])


def test_frechet_equals_factor_at_equal_confidences_and_dream_form():
    # at equal confidences 1 - eps the rule is the factor rule with f = 1 off its boundary ((n + 1) eps = 1, where
    # factor's >= takes one more): eps = 5/16, 3/32, 1/64 (exact in fp32)
    for c in (0.6875, 0.90625, 0.984375):
        inp = _inp([c] * 12)
        frechet, factor = make_policy("frechet", delta=0.0), make_policy("factor", f=1.0)
        assert torch.equal(frechet.select(inp), factor.select(inp))
    inp = _inp([0.75] * 6)
    assert make_policy("frechet").select(inp).sum() == 2 and make_policy("factor").select(inp).sum() == 3
    # the Dream form: the region's first step commits its first masked slot alone, then the rule (delta 0 on
    # CONF10: .95, .90 give .95 + .9 - 1 - .1 = .75 > 0; with .80: 2.65 - 2 - .2 = .45; with .65: 3.3 - 3 - .35 =
    # -.05, so three; then .65, .55: 1.2 - 1 - .45 < 0 -> one per step)
    policy = make_policy("frechet", delta=0.0, first_token=True)
    policy.setup(gen_length=32, num_regions=1)
    assert _run_region(policy, CONF10) == [[0], [1, 3, 6], [8], [4], [7], [5], [2], [9]]
    with pytest.raises(ValueError, match="delta=nan must be a finite number"):
        make_policy("frechet", delta=float("nan"))


def test_dream_entropy_k_schedule_golden():
    # ts = linspace(1, 1e-3, 5) = 1, .75025, .5005, .25075, .001; 1 - s/t = .24975, .33289, .49900, (last)
    # n = 8: int(8 * .24975) = 1 -> n = 7: int(7 * .33289) = 2 -> n = 5: int(5 * .499) = 2 -> last: int(3) = 3
    policy = make_policy("entropy", steps=4)
    policy.setup(gen_length=8, num_regions=1)
    neg = [-0.8, -0.1, -2.0, -0.5, -0.05, -1.5, -0.3, -3.0]
    # descending neg-entropy: 4, 1, 6, 3, 0, 5, 2, 7
    assert _run_region(policy, [0.0] * 8, neg_entropy=neg) == [[4], [1, 6], [0, 3], [2, 5, 7]]
    # n = 3: int(.749) = 0, int(.9987) = 0 (k = 0 steps commit nothing), int(1.497) = 1, last int(2) = 2
    assert _run_region(policy, [0.0] * 3, neg_entropy=[-1.0, -0.2, -0.6]) == [[], [], [1], [0, 2]]


def test_dream_scores_and_batch_average():
    conf, margin, neg = [0.9, 0.5, 0.1], [0.1, 0.8, 0.3], [-2.0, -1.0, -0.1]
    expect = {"maskgit_plus": [0], "topk_margin": [1], "entropy": [2]}
    for name, slots in expect.items():
        policy = make_policy(name, steps=2)
        policy.setup(gen_length=4, num_regions=1)  # step 1 of S = 2 is the last: k = int(n)
        inp = _inp(conf, step=1, remaining=1, budget=2, margin=margin, neg_entropy=neg)
        assert _picked(policy.select(inp)) == slots, name
    # step 1 of S = 4 (1 - s/t = .33289): per row n = 9 -> int(2.996) = 2, n = 3 -> int(.9987) = 0;
    # Dream's batch average n = 6 -> int(1.997) = 1 for both rows
    scores = [[0.1 * i for i in range(9, 0, -1)]] * 2
    for batch_average, k in ((False, [2, 0]), (True, [1, 1])):
        policy = make_policy("maskgit_plus", steps=4, batch_average=batch_average)
        policy.setup(gen_length=9, num_regions=1)
        mask = policy.select(_inp(scores, step=1, remaining=[9, 3], budget=4))
        assert mask.sum(-1).tolist() == k


def test_dream_alg_temp_samples_k_active():
    policy = make_policy("entropy", steps=2, alg_temp=0.5)
    policy.setup(gen_length=6, num_regions=1)
    assert not policy.deterministic and make_policy("entropy").deterministic
    active = [1, 0, 1, 1, 0, 1, 1, 1]
    # ts = linspace(1, 1e-3, 3) = 1, .5005, .001; step 0: int(6 * (1 - .5005)) = int(2.997) = 2 of 6 active
    inp = _inp([0.0] * 8, active, step=0, remaining=6, budget=2, neg_entropy=[-1.0] * 8)
    masks = [policy.select(inp, torch.Generator().manual_seed(s)) for s in range(20)]
    assert all(m.sum().item() == 2 and not (m & ~inp.active).any() for m in masks)
    assert len({tuple(_picked(m)) for m in masks}) > 1
    # 40-nat gaps at alg_temp 0.5 make any other pick a ~e^-80 event; slot 1 scores high but is inactive
    inp.signals.neg_entropy = torch.tensor([[-40.0, -0.1, -40.0, -0.1, -40.0, -40.0, -40.0, -0.1]])
    assert _picked(policy.select(inp, torch.Generator().manual_seed(0))) == [3, 7]


def test_dream_origin_reveal_probability_and_last_step():
    policy = make_policy("origin", steps=4)
    policy.setup(gen_length=8, num_regions=1)
    n = 20_000
    inp = _inp([0.5] * n, step=0, budget=4)
    frac = policy.select(inp, torch.Generator().manual_seed(3)).float().mean().item()
    # p = 1 - s/t = .24975; Hoeffding: P(|frac - p| > .0191) <= 2 exp(-2 n .0191^2) < 1e-6
    assert abs(frac - 0.24975) <= 0.0191
    last = _inp([0.5] * 5, [1, 0, 1, 1, 0], step=3, budget=4)
    assert _picked(policy.select(last, torch.Generator().manual_seed(0))) == [0, 2, 3]


# learned policies need a checkpoint to be built (tests/test_tracelock_policy.py and tests/test_l2p.py cover them)
# the rules that remember read their vocabulary pass (StepInput.vocab): tests/test_new_rules.py drives them
@pytest.mark.parametrize("name", sorted(n for n, cls in POLICIES.items() if not cls.learned and not cls.reads_vocab))
def test_policies_seeded_reproducible(name):
    policy = make_policy(name, **({"background": "testbed"} if name == "pc" else {}))
    policy.setup(gen_length=16, num_regions=2)
    conf = torch.rand(3, 8)
    inp = _inp(conf.tolist(), (torch.rand(3, 8) > 0.3).tolist(), step=1, budget=policy.steps_per_region())
    first = policy.select(inp, torch.Generator().manual_seed(11))
    assert torch.equal(first, policy.select(inp, torch.Generator().manual_seed(11)))
    assert not (first & ~inp.active).any()


def test_policy_registry():
    assert sorted(POLICIES) == sorted(
        ["random", "confidence", "topk", "origin", "maskgit_plus", "topk_margin", "entropy", "threshold", "factor",
         "frechet", "credit", "hierarchy", "klass", "less", "eb", "pc", "tracelock", "gate", "l2p", "l2p-hidden"]
    )
    stochastic = {name for name, cls in POLICIES.items() if not cls.deterministic}
    assert stochastic == {"random", "origin"}
    policy = make_policy("factor", f=0.5)
    assert make_policy(policy) is policy and isinstance(policy, Policy)


@pytest.mark.parametrize(
    "spec, kwargs, exc, match",
    [
        ("greedy", {}, ValueError, "known policies: confidence, credit, eb, entropy"),
        ("threshold", {"tau": 0.0}, ValueError, r"tau=0.0 must lie in \(0, 1\]"),
        ("threshold", {"tau": 1.5}, ValueError, "tau=1.5"),
        ("confidence", {"steps": 0}, ValueError, "steps=0 must be a positive int"),
        ("confidence", {"score": "entropy"}, ValueError, "score='entropy' is not a certainty score; choose one of "
                                                         "confidence, margin, neg_entropy"),
        ("entropy", {"steps": -4}, ValueError, "steps=-4"),
        ("topk", {"k": 0}, ValueError, "k=0"),
        ("factor", {"f": -1.0}, ValueError, "f=-1.0"),
        ("entropy", {"eps": 1.0}, ValueError, "eps=1.0"),
        ("threshold", {"steps": 8}, TypeError, "takes no argument steps; its arguments are: tau, first_token"),
        ("threshold", {"first_token": 1}, TypeError, "first_token=1 must be a bool"),
        ("frechet", {"delta": float("inf")}, ValueError, "delta=inf must be a finite number"),
        ("frechet", {"hold_end": 1}, TypeError, "hold_end=1 must be a bool"),
        ("factor", {"hold_end": "yes"}, TypeError, "hold_end='yes' must be a bool"),
        ("confidence", {"hold_end": 0}, TypeError, "hold_end=0 must be a bool"),
    ],
)
def test_make_policy_errors(spec, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        make_policy(spec, **kwargs)


def test_setup_errors():
    policy = make_policy("confidence", steps=10)
    with pytest.raises(RuntimeError, match="call setup"):
        policy.steps_per_region()
    with pytest.raises(ValueError, match=r"LLaDA asserts steps % num_blocks == 0; pass steps=8"):
        policy.setup(gen_length=32, num_regions=4)
    with pytest.raises(ValueError, match="block length that divides gen_length"):
        policy.setup(gen_length=30, num_regions=4)
    with pytest.raises(TypeError, match="pass the name instead"):
        make_policy(policy, steps=4)
