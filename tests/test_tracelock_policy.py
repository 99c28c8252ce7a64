"""The TraceLock policy: known decisions from hand-set controllers, cap, fallback, crop and padding, the fold,
run folders and fingerprints, and a full decode (fused == reference)."""

import pytest
import torch

import tracelock
from tracelock import states
from tracelock.controller import Controller, ControllerConfig, controller_fingerprint
from tracelock.features import AutoEncoder, LinearEncoder, TapEncoder, backbone_fingerprint
from tracelock.models import write_tiny_checkpoint
from tracelock.policies import make_policy
from tracelock.policies.base import StepInput
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.signals import compute_signals

SMALL = dict(width=32, layers=1, heads=2, ffn=48, dropout=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("llada"), family="llada", seed=3))


@pytest.fixture(scope="module")
def encoder(model):
    D = model.spec.hidden_size
    g = torch.Generator().manual_seed(0)
    samples = torch.randn(256, D, generator=g)
    return TapEncoder(LinearEncoder.fit_pca(samples, 8), LinearEncoder.fit_pca(samples, 4), backbone_fingerprint(model))


def _controller(model, encoder, **kw):
    torch.manual_seed(2)
    cfg = ControllerConfig(code_dim=encoder.code_dim, groups=encoder.groups, **{**SMALL, **kw},
                           fingerprint=controller_fingerprint(model, encoder))
    return Controller(cfg).eval()


@torch.no_grad()
def _constant(controller, a: float, tau: float = 0.0):
    """Score head and threshold head reduced to their biases: a and tau are the same at every position."""
    controller.score_head.weight.zero_()
    controller.score_head.bias.fill_(a)
    controller.tau_head[-1].weight.zero_()
    controller.tau_head[-1].bias.fill_(tau)
    return controller


@torch.no_grad()
def _confidence_sign(controller):
    """A controller whose score is about +-80 by the sign of (confidence - 0.5): identity encoder layers (attention
    and FFN outputs zeroed), codes ignored, the confidence written along v = e0 - e1 at scale 1000 so it dominates
    the position encoding, and the final LayerNorm keeps its sign; tau = 0."""
    w = controller.config.width
    v = torch.zeros(w)
    v[0], v[1] = 1.0, -1.0
    for layer in controller.encoder.layers:
        for lin in (layer.self_attn.out_proj, layer.linear2):
            lin.weight.zero_()
            lin.bias.zero_()
    controller.input_proj.weight.zero_()
    controller.input_proj.bias.zero_()
    controller.conf_proj.weight.copy_(1000 * v[:, None])
    controller.conf_proj.bias.copy_(-500 * v)
    controller.score_head.weight.copy_(10 * v[None])
    controller.score_head.bias.zero_()
    controller.tau_head[-1].weight.zero_()
    controller.tau_head[-1].bias.zero_()
    return controller


def _step(model, B=3, T=14, R=6, lo=8, seed=0):
    """A StepInput like the loop's: slots [lo, lo + R) of a canvas of L = T + 4, taps of positions [0, T)."""
    g = torch.Generator().manual_seed(seed)
    D, L = model.spec.hidden_size, T + 4
    taps = tuple(torch.randn(B, T, D, generator=g) for _ in range(3))
    positions = (lo + torch.arange(R)).expand(B, R).clone()
    state = torch.full((B, L), states.ACTIVE, dtype=torch.uint8)
    state[:, :5] = states.PROMPT
    state[:, 5:lo] = states.LOCKED
    active = torch.rand(B, R, generator=g) < 0.7
    active[0] = torch.tensor([False, True, True, False, True, True])
    active[-1] = False
    state[:, lo:lo + R] = torch.where(active, states.ACTIVE, states.LOCKED)
    signals = compute_signals(torch.randn(B, R, 17, generator=g))
    zeros = torch.zeros(B, dtype=torch.long)
    return StepInput(signals=signals, active=active, region_step=zeros, region_initial=zeros, region_active=zeros,
                     steps_per_region=16, positions=positions, state=state, rows=torch.arange(B), taps=taps)


def _slots(mask):
    return [row.nonzero().flatten().tolist() for row in mask]


def _margins(policy, inp):
    """(m [B, R] margins of the slots, tau [B] the threshold logit used) at one step: the policy's slot scores less
    its threshold logit."""
    a, tau = policy.slot_scores(inp)
    return a - tau[:, None], tau


def test_all_pass_cap_and_fallback(model, encoder):
    inp = _step(model)
    everyone = TraceLockPolicy(_constant(_controller(model, encoder), a=10.0), encoder)
    assert _slots(everyone.select(inp)) == _slots(inp.active)
    # equal margins: the cap keeps the lowest slots
    capped = TraceLockPolicy(_constant(_controller(model, encoder), a=10.0), encoder, cap=2)
    assert _slots(capped.select(inp)) == [s[:2] for s in _slots(inp.active)]
    # nothing passes: the single best (here the lowest) active slot; a row without active slots commits nothing
    nobody = TraceLockPolicy(_constant(_controller(model, encoder), a=-10.0), encoder)
    assert _slots(nobody.select(inp)) == [s[:1] for s in _slots(inp.active)]
    assert _slots(nobody.select(inp))[-1] == []


def test_threshold_and_static_tau(model, encoder):
    inp = _step(model)
    # m = 2 - 0: sigmoid(2) = 0.881 passes theta 0.8, not 0.95
    ctrl = _constant(_controller(model, encoder), a=2.0)
    assert _slots(TraceLockPolicy(ctrl, encoder, theta=0.8).select(inp)) == _slots(inp.active)
    assert _slots(TraceLockPolicy(ctrl, encoder).select(inp)) == [s[:1] for s in _slots(inp.active)]
    # a fixed threshold logit replaces the learned tau (here 0, moved to -2: m = 4, sigmoid = 0.982)
    static = TraceLockPolicy(ctrl, encoder, static_tau=-2.0)
    assert _slots(static.select(inp)) == _slots(inp.active)
    m, tau = _margins(static, inp)
    assert torch.equal(tau, torch.full((3,), -2.0)) and torch.allclose(m, torch.full_like(m, 4.0))


def test_commits_exactly_the_confident_active_slots(model, encoder):
    inp = _step(model)
    inp.signals.confidence = torch.tensor([[0.9, 0.95, 0.2, 0.99, 0.7, 0.3],
                                           [0.1, 0.8, 0.9, 0.05, 0.6, 0.2],
                                           [0.9, 0.9, 0.9, 0.9, 0.9, 0.9]])
    policy = TraceLockPolicy(_confidence_sign(_controller(model, encoder, confidence_input=True)), encoder)
    want = (inp.signals.confidence > 0.5) & inp.active
    assert _slots(policy.select(inp)) == _slots(want)
    capped = TraceLockPolicy(policy._controller, encoder, cap=1).select(inp)
    for row, allowed in zip(_slots(capped), _slots(want)):
        assert len(row) == min(1, len(allowed)) and set(row) <= set(allowed)


def test_region_crop_and_left_padding(model, encoder):
    policy = TraceLockPolicy(_controller(model, encoder, state_embedding=True), encoder)
    inp = _step(model, B=2, seed=1)
    inp.positions[1] = torch.arange(4, 10)  # row 1's region ends at 10 < T = 14
    inp.active[:] = True
    m, tau = _margins(policy, inp)
    alone = _step(model, B=2, seed=1)
    alone.taps = tuple(t[1:, :10] for t in inp.taps)
    alone.positions, alone.state, alone.active = inp.positions[1:], inp.state[1:], inp.active[1:]
    m1, tau1 = _margins(policy, alone)
    torch.testing.assert_close(m[1:], m1, rtol=1e-5, atol=1e-5)
    # row 0 left-padded by 3 with a mask: the same margins as without the padding
    pad = 3
    padded = _step(model, B=1, seed=1)
    padded.taps = tuple(torch.cat([torch.randn(1, pad, t.shape[-1]), t[:1]], dim=1) for t in inp.taps)
    padded.state = torch.cat([torch.full((1, pad), states.PROMPT, dtype=torch.uint8), inp.state[:1]], dim=1)
    padded.positions, padded.active = inp.positions[:1] + pad, inp.active[:1]
    padded.attention_mask = torch.arange(padded.state.shape[1])[None] >= pad
    mp, taup = _margins(policy, padded)
    torch.testing.assert_close(mp, m[:1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(taup, tau[:1], rtol=1e-5, atol=1e-5)


def test_fold_path_equals_codes_path(model, encoder):
    ctrl = _controller(model, encoder, features="hidden")
    inp = _step(model)
    T = inp.taps[0].shape[1]
    key_mask = torch.arange(T)[None] < (inp.positions.max(1).values + 1)[:, None]
    a, tau = ctrl(encoder.codes(*inp.taps), inp.state[:, :T], key_mask)
    m, _ = _margins(TraceLockPolicy(ctrl, encoder), inp)
    torch.testing.assert_close(m, a.gather(1, inp.positions) - tau[:, None], rtol=1e-4, atol=1e-4)
    # a nonlinear encoder cannot fold: the policy runs the codes through the input projection
    D = model.spec.hidden_size
    torch.manual_seed(0)
    ae = TapEncoder(AutoEncoder(D, 8, 16), AutoEncoder(D, 4, 16), backbone_fingerprint(model)).eval()
    ctrl_ae = _controller(model, ae)
    a, tau = ctrl_ae(ae.codes(*inp.taps), inp.state[:, :T], key_mask)
    m, _ = _margins(TraceLockPolicy(ctrl_ae, ae), inp)
    torch.testing.assert_close(m, a.gather(1, inp.positions) - tau[:, None], rtol=1e-5, atol=1e-5)


def test_presets_and_errors(model, encoder):
    ctrl = _controller(model, encoder, confidence_input=True)
    release = TraceLockPolicy(ctrl, encoder, reference_release=True)
    assert (release.theta, release.cap, release.reference_release) == (0.99, 4, True)
    assert (TraceLockPolicy(ctrl, encoder).theta, TraceLockPolicy(ctrl, encoder).cap) == (0.95, None)
    with pytest.raises(ValueError, match="reference_release=True fixes theta=0.99"):
        TraceLockPolicy(ctrl, encoder, reference_release=True, theta=0.9)
    with pytest.raises(ValueError, match="needs a controller trained with the confidence input"):
        TraceLockPolicy(_controller(model, encoder), encoder, reference_release=True)
    with pytest.raises(ValueError, match="theta=1.5 must lie in"):
        TraceLockPolicy(ctrl, encoder, theta=1.5)
    with pytest.raises(ValueError, match="cap=0 must be a positive int"):
        TraceLockPolicy(ctrl, encoder, cap=0)
    with pytest.raises(ValueError, match="encoder is required"):
        TraceLockPolicy(ctrl)


def test_run_folder_and_fingerprint_mismatch(model, encoder, tmp_path):
    _controller(model, encoder).save(tmp_path / "best.safetensors")
    encoder.save(tmp_path)
    policy = make_policy("tracelock", controller=str(tmp_path), theta=0.9)
    assert isinstance(policy, TraceLockPolicy) and policy.theta == 0.9
    dream = tracelock.load_model(write_tiny_checkpoint(tmp_path / "dream", family="dream", seed=1))
    with pytest.raises(ValueError, match=r"'family': 'llada'.*'family': 'dream'"):
        TraceLockPolicy(tmp_path, model=dream)
    # without the model, the tap width is checked at the first step
    inp = _step(model)
    inp.taps = tuple(t[..., :16] for t in inp.taps)
    with pytest.raises(ValueError, match="the taps are 16 wide but this controller was trained on a backbone with "
                                         "hidden size 64"):
        policy.select(inp)


@pytest.mark.parametrize("schedule", [{"window": 8}, {"block": 8}, {}], ids=["window8", "block8", "full"])
def test_full_decode_fused_equals_reference(model, encoder, schedule, monkeypatch):
    """The fused loop closes every TraceLock step with ops.commit_step (the Triton kernel here, interpreted)."""
    policy = TraceLockPolicy(_controller(model, encoder, confidence_input=True, state_embedding=True), encoder,
                             theta=0.6)
    prompts = [[5, 9, 13, 2, 7], [11, 4, 8]]
    ref_tokens, ref_stats = tracelock.reference_generate(model, prompts, policy=policy, gen_length=16, **schedule)
    calls = []
    real = tracelock.ops.commit_step
    monkeypatch.setattr(tracelock.ops, "commit_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens, stats = tracelock.fused_generate(model, prompts, policy=policy, gen_length=16, **schedule)
    assert len(calls) == max(ref_stats.steps)
    assert torch.equal(tokens, ref_tokens)
    assert stats.steps == ref_stats.steps and stats.commits_per_step == ref_stats.commits_per_step
    assert not (tokens == model.spec.mask_id).any()
    assert all(1 <= n for row in stats.commits_per_step for n in row)


def test_hold_end_keeps_the_padding_until_the_text_left_of_it_is_proposed(model, encoder):
    """hold_end: an end-token proposal commits only when no active slot left of it proposes text; the leftmost
    active slot is never held, so the fallback always has a slot."""
    inp = _step(model)
    eos = torch.tensor([[0.0, 0.9, 0.9, 0.0, 0.0, 0.9],   # row 0: active slots 1, 2, 4, 5
                        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    inp.signals.eos_prob, inp.signals.confidence = eos, torch.where(eos > 0, eos, torch.full_like(eos, 0.5))
    inp.active[1] = torch.tensor([True, False, True, True, False, True])
    inp.signals.eos_prob[1] = torch.tensor([0.0, 0.0, 0.0, 0.9, 0.0, 0.9])  # text at 0 and 2, ends at 3 and 5
    inp.signals.confidence[1] = torch.where(inp.signals.eos_prob[1] > 0, 0.9, 0.5)
    everyone = _constant(_controller(model, encoder), a=10.0)
    held = TraceLockPolicy(everyone, encoder, hold_end=True)
    # row 0: ends at 1 and 2 lead (no text left of them), slot 4 is text, so the end at 5 waits
    # row 1: text at 0 and 2 lies left of both ends: both wait
    assert _slots(held.select(inp)) == [[1, 2, 4], [0, 2], []]
    assert _slots(TraceLockPolicy(everyone, encoder).select(inp)) == _slots(inp.active)
    nobody = TraceLockPolicy(_constant(_controller(model, encoder), a=-10.0), encoder, hold_end=True)
    assert _slots(nobody.select(inp)) == [[1], [0], []]
    with pytest.raises(ValueError, match="hold_end='yes' must be true or false"):
        TraceLockPolicy(everyone, encoder, hold_end="yes")


def test_the_threshold_holds_the_end_alike(model):
    """Fast-dLLM's threshold with hold_end (the control that tells the hold's effect from the controller's): the same
    slots wait as under TraceLock's hold_end; its always-committed top slot is picked among the rest."""
    from tracelock.policies.fastdllm import ThresholdPolicy

    inp = _step(model)
    eos = torch.tensor([[0.0, 0.95, 0.95, 0.0, 0.0, 0.99], [0.0] * 6, [0.0] * 6])
    inp.signals.eos_prob = eos
    inp.signals.confidence = torch.where(eos > 0, eos, torch.full_like(eos, 0.5))
    inp.signals.confidence[0, 4] = 0.92
    plain, held = ThresholdPolicy(tau=0.9), ThresholdPolicy(tau=0.9, hold_end=True)
    # row 0 (active 1, 2, 4, 5): the end at 5 lies right of text at 4 and waits
    assert _slots(plain.select(inp))[0] == [1, 2, 4, 5] and _slots(held.select(inp))[0] == [1, 2, 4]
    inp.signals.confidence[0] = torch.tensor([0.5, 0.3, 0.3, 0.5, 0.6, 0.99])
    inp.signals.eos_prob[0] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.99])
    # nothing clears tau but the held end: the top slot among the others commits instead
    assert _slots(plain.select(inp))[0] == [5] and _slots(held.select(inp))[0] == [4]
    with pytest.raises(TypeError, match="hold_end='yes' must be a bool"):
        ThresholdPolicy(hold_end="yes")


def _end_case(model, second: bool = False):
    """The threshold test's step: row 0's active slots 1, 2, 4, 5; first ends at 1 and 2 (0.95, no text left of
    them) and at 5 (0.99, right of the text at 4, 0.92); second only the end at 5 (0.99) beside text at 0.3-0.6."""
    inp = _step(model)
    eos = torch.tensor([[0.0, 0.95, 0.95, 0.0, 0.0, 0.99], [0.0] * 6, [0.0] * 6])
    inp.signals.eos_prob = eos
    inp.signals.confidence = torch.where(eos > 0, eos, torch.full_like(eos, 0.5))
    inp.signals.confidence[0, 4] = 0.92
    if second:
        inp.signals.confidence[0] = torch.tensor([0.5, 0.3, 0.3, 0.5, 0.6, 0.99])
        inp.signals.eos_prob[0] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.99])
    return inp


@pytest.mark.parametrize("name, args, first, second", [
    # factor f = 1 (n-th needs 1 - 1/(n + 1)): all four pass plainly (.99, .95, .95, .92 >= .8); held, .95, .95, .92
    # pass; second case: .99 then .6 < .667 -> the top alone; held: .6, .3 -> the top of the rest
    ("factor", {"f": 1.0}, ([1, 2, 4, 5], [1, 2, 4]), ([5], [4])),
    # Fréchet delta 0: .99, .95, .95, .92 score .89, .84, .73 > 0 -> four; held: .95, .95, .92 -> .85, .74 -> three;
    # second: .99, .6 -> 1.59 - 1 - .4 = .19 > 0, then .3: 1.89 - 2 - .7 < 0 -> two; held: .6, .3 -> -.8 -> one
    ("frechet", {"delta": 0.0}, ([1, 2, 4, 5], [1, 2, 4]), ([4, 5], [4])),
    ("frechet", {"delta": 0.0, "first_token": True}, ([1, 2, 4, 5], [1, 2, 4]), ([4, 5], [4])),
])
def test_every_held_rule_holds_the_end_alike(model, name, args, first, second):
    """factor's and Fréchet's hold_end: the same slots wait as under the threshold's (and TraceLock's) hold_end, the
    rule runs on the rest, its always-committed top slot among them."""
    for case, want in ((_end_case(model), first), (_end_case(model, second=True), second)):
        case.region_step = torch.ones(3, dtype=torch.long)  # past the Dream form's first step
        plain, held = make_policy(name, **args), make_policy(name, **args, hold_end=True)
        assert (_slots(plain.select(case))[0], _slots(held.select(case))[0]) == want
        assert _slots(plain.select(case))[1:] == _slots(held.select(case))[1:]  # no end proposed: no hold
    # the Dream form's first step commits the first masked slot, held or not (the leftmost is never held)
    case = _end_case(model)
    assert _slots(make_policy("frechet", first_token=True, hold_end=True).select(case))[0] == [1]


def test_the_schedule_rules_hold_the_end_last(model):
    """confidence with hold_end: the schedule's count per step stays; a held end ranks after every other active
    slot, so it commits only when the step's count reaches past the rest."""
    policy, held = make_policy("confidence", steps=16), make_policy("confidence", steps=16, hold_end=True)
    for p in (policy, held):
        p.setup(gen_length=64, num_regions=4)  # 4 steps per region
    for initial, want in ((8, ([1, 5], [1, 2])), (16, ([1, 2, 4, 5], [1, 2, 4, 5]))):
        case = _end_case(model)
        case.region_initial = torch.full((3,), initial)  # 8 / 4 = 2 per step, 16 / 4 = 4
        assert (_slots(policy.select(case))[0], _slots(held.select(case))[0]) == want
    case = _end_case(model, second=True)
    case.region_initial = torch.full((3,), 8)
    # plainly the end (.99) and the text at 4 (.6); held: 4, then 1 (.3, ties to the lower slot)
    assert (_slots(policy.select(case))[0], _slots(held.select(case))[0]) == ([4, 5], [1, 4])


def test_learn2pd_holds_the_end_in_its_accepts_its_schedule_and_its_cut(model):
    """Learn2PD with hold_end: the filter's accepts skip a held end, its scheduled rule ranks it last, and end-of-text
    prediction cuts only at an end no masked text lies left of."""
    from tracelock.policies.l2p import L2PPolicy
    from tracelock.testing import step_l2p_filter

    conf = torch.tensor([[0.9, 0.95, 0.6, 0.97, 0.3, 0.3, 0.3, 0.3]])  # ends at 1 and 3, text left of both
    eos = torch.tensor([[0.0, 0.95, 0.0, 0.97, 0.0, 0.0, 0.0, 0.0]])
    B, R, L = 1, 8, 20
    state = torch.full((B, L), states.ACTIVE, dtype=torch.uint8)
    state[:, :6] = states.PROMPT
    signals = compute_signals(torch.randn(B, R, 17))
    signals.confidence, signals.eos_prob = conf, eos
    signals.proposal = torch.where(eos > 0, model.spec.eos_id, 3)
    one = torch.ones(B, dtype=torch.long)
    inp = StepInput(signals=signals, active=torch.ones(B, R, dtype=torch.bool), region_step=one * 0,
                    region_initial=one * 8, region_active=one * 8, steps_per_region=8,
                    positions=(6 + torch.arange(R)).expand(B, R).clone(), state=state, rows=torch.arange(B))
    plain = L2PPolicy(step_l2p_filter(model), filter_block=4)
    held = L2PPolicy(step_l2p_filter(model), filter_block=4, hold_end=True)
    for p in (plain, held):
        p.setup(gen_length=8, num_regions=1)  # one per step: the scheduled top-1
    # plainly the filter accepts confidence > .5 (0-3), the top-1 is the end at 3; the first accepted end (slot 1,
    # position 7) is the cut
    chosen, cut = plain.decide(inp)
    assert _slots(chosen) == [[0, 1, 2, 3]] and cut.tolist() == [7]
    # held: 1 and 3 wait; the accepts are 0 and 2, the top-1 of the rest is 0; no end without text left: no cut
    chosen, cut = held.decide(inp)
    assert _slots(chosen) == [[0, 2]] and cut.tolist() == [L]
    # once the text left of the first end is committed, it no longer waits: accepted and cut after it
    inp.active[0, 0] = False
    chosen, cut = held.decide(inp)
    assert _slots(chosen) == [[1, 2]] and cut.tolist() == [7]


@pytest.mark.parametrize("schedule", [{"window": 8}, {"block": 8}], ids=["window8", "block8"])
def test_hold_end_fused_equals_reference(model, encoder, schedule):
    policy = TraceLockPolicy(_controller(model, encoder, confidence_input=True), encoder, theta=0.6, hold_end=True)
    prompts = [[5, 9, 13, 2, 7], [11, 4, 8]]
    ref_tokens, ref_stats = tracelock.reference_generate(model, prompts, policy=policy, gen_length=16, **schedule)
    tokens, stats = tracelock.fused_generate(model, prompts, policy=policy, gen_length=16, **schedule)
    assert torch.equal(tokens, ref_tokens) and stats.steps == ref_stats.steps
    assert stats.commits_per_step == ref_stats.commits_per_step


def test_confidence_fallback_commits_the_most_confident_slot(model, encoder):
    inp = _step(model)
    inp.signals.confidence = torch.tensor([[0.9, 0.3, 0.95, 0.2, 0.7, 0.8],
                                           [0.1, 0.8, 0.9, 0.05, 0.6, 0.2],
                                           [0.9, 0.9, 0.9, 0.9, 0.9, 0.9]])
    inp.signals.eos_prob = torch.zeros(3, 6)
    nobody = _constant(_controller(model, encoder), a=-10.0)
    policy = TraceLockPolicy(nobody, encoder, fallback="confidence")
    rule = policy.commit_rule(inp)  # the fused commit op runs this rule too: the backbone's score falls back
    assert rule.fallback_score is inp.signals.confidence and rule.held is None and rule.theta == 0.95
    most = [[max(s, key=lambda j: inp.signals.confidence[r, j].item())] if s else [] for r, s in
            enumerate(_slots(inp.active))]
    assert _slots(policy.select(inp)) == most
    # hold_end still holds: the most confident slot of row 0 (slot 2) proposes the end token after text at slot 1
    inp.signals.eos_prob[0, 2] = 0.95
    held = TraceLockPolicy(nobody, encoder, fallback="confidence", hold_end=True)
    assert _slots(held.select(inp))[0] == [5]
    inp.signals.neg_entropy = -inp.signals.confidence.flip(1)  # a different order: the most certain by entropy
    by_entropy = TraceLockPolicy(nobody, encoder, fallback="neg_entropy")
    assert _slots(by_entropy.select(inp)) == [[max(s, key=lambda j: inp.signals.neg_entropy[r, j].item())] if s else []
                                              for r, s in enumerate(_slots(inp.active))]
    with pytest.raises(ValueError, match="fallback='best' must be one of score, confidence, neg_entropy"):
        TraceLockPolicy(nobody, encoder, fallback="best")


def test_confidence_fallback_fused_equals_reference(model, encoder):
    policy = TraceLockPolicy(_controller(model, encoder, confidence_input=True), encoder, theta=0.9,
                             fallback="confidence", hold_end=True)
    prompts = [[5, 9, 13, 2, 7], [11, 4, 8]]
    ref_tokens, ref_stats = tracelock.reference_generate(model, prompts, policy=policy, gen_length=16, window=8)
    tokens, stats = tracelock.fused_generate(model, prompts, policy=policy, gen_length=16, window=8)
    assert torch.equal(tokens, ref_tokens) and stats.commits_per_step == ref_stats.commits_per_step
