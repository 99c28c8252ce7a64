"""TraceLock's gate over a training-free rule: no correction is the base rule exactly (stateless and stateful bases,
both bundled models), each knob does what it says on one step, fused == reference, eager == engine == compiled, and
bad arguments are refused by name."""

import pytest
import torch

import tracelock
from tracelock import states
from tracelock.policies import make_policy
from tracelock.policies.base import StepInput, held_ends
from tracelock.policies.frechet import FrechetPolicy
from tracelock.policies.gate import GatePolicy
from tracelock.signals import compute_signals
from tracelock.testing import assert_same_decode, decode_on_engine, fresh_controller, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["What is 12 plus 30?", "Write a function that returns the square of x.", "Tom has 3 apples and buys 4."]


@pytest.fixture(scope="module")
def bundled():
    from tracelock.models.loading import load_tokenizer
    from tracelock.text import encode_prompt

    models = {}
    for family, name in (("llada", "testbed"), ("dream", "testbed-dream")):
        model, tokenizer = tracelock.load_model(name), load_tokenizer(name)
        models[family] = (model, name, [encode_prompt(tokenizer, p) for p in PROMPTS])
    return models


BASES = {"llada": [("frechet", dict(delta=0.3, hold_end=True)), ("threshold", dict(tau=0.8)),
                   ("credit", dict(tau=0.9, hold_end=True)), ("klass", dict(tau=0.9, kl=0.01)),
                   ("less", dict(tau=0.75, drift=0.04)), ("eb", dict(gamma=0.01))],
         "dream": [("frechet", dict(delta=0.3, first_token=True)), ("threshold", dict(tau=0.8, first_token=True)),
                   ("credit", dict(tau=0.9, first_token=True))]}


@pytest.mark.parametrize("family, base, args", [(f, b, a) for f, bs in BASES.items() for b, a in bs],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_no_correction_is_the_base_rule_exactly(bundled, family, base, args):
    model, controller, prompts = bundled[family]
    kw = dict(gen_length=32, block=16)
    want = tracelock.fused_generate(model, prompts, policy=base, policy_args=args, **kw)
    gate = GatePolicy(controller, base=base, model=model, **{f"base_{k}": v for k, v in args.items()})
    got = tracelock.fused_generate(model, prompts, policy=gate, **kw)
    assert torch.equal(got[0], want[0])
    assert got[1].steps == want[1].steps and got[1].commits_per_step == want[1].commits_per_step


def _step(model, B=3, R=6, lo=8, seed=0):
    """A StepInput like the loop's: slots [lo, lo + R) of a canvas of lo + R + 4 positions."""
    g = torch.Generator().manual_seed(seed)
    T, D = lo + R, model.spec.hidden_size
    state = torch.full((B, T + 4), states.ACTIVE, dtype=torch.uint8)
    state[:, :lo] = states.LOCKED
    active = torch.rand(B, R, generator=g) < 0.8
    active[:, 0] = True
    zeros = torch.zeros(B, dtype=torch.long)
    return StepInput(signals=compute_signals(3 * torch.randn(B, R, 17, generator=g)), active=active,
                     region_step=zeros + 1, region_initial=zeros, region_active=zeros, steps_per_region=16,
                     positions=(lo + torch.arange(R)).expand(B, R).clone(), state=state, rows=torch.arange(B),
                     taps=tuple(torch.randn(B, T, D, generator=g) for _ in range(3)))


@pytest.mark.parametrize("accept, veto", [(1.0, 0.0), (0.6, 0.0), (1.0, 0.5), (0.7, 0.45)])
def test_a_step_vetoes_and_accepts_by_the_controllers_probability(accept, veto):
    model = tracelock.load_model("testbed")
    controller, encoder = fresh_controller(model)
    base = FrechetPolicy(delta=0.2)
    gate = GatePolicy(controller, base=base, accept=accept, veto=veto, encoder=encoder)
    for seed in range(4):
        inp = _step(model, seed=seed)
        a, tau = gate._scorer.slot_scores(inp)
        p = torch.sigmoid(a - tau[:, None])
        proposed = base.select(inp)
        want = (proposed & (p >= veto)) | (inp.active & (p > accept))
        for b in range(inp.active.shape[0]):
            if not want[b].any():  # all vetoed: the proposed slot with the largest p
                want[b, torch.where(proposed[b], p[b], -1.0).argmax()] = True
        assert torch.equal(gate.select(inp), want)


def test_accept_never_takes_a_slot_the_base_holds():
    model = tracelock.load_model("testbed")
    controller, encoder = fresh_controller(model)
    gate = GatePolicy(controller, base=FrechetPolicy(delta=0.2, hold_end=True), accept=1e-6, encoder=encoder)
    inp = _step(model)
    inp.signals.eos_prob.copy_(torch.where(torch.arange(6) % 2 == 1, 2.0, 0.0).expand(3, 6))  # every odd slot ends
    held = held_ends(inp)
    chosen = gate.select(inp)
    assert held.any() and not (chosen & held).any() and torch.equal(chosen, inp.active & ~held)


@pytest.mark.parametrize("base, args", [("frechet", dict(base_delta=0.1)), ("credit", dict(base_tau=0.8))])
def test_fused_equals_reference_and_the_correction_changes_the_decode(bundled, base, args):
    model, controller, prompts = bundled["llada"]
    kw = dict(gen_length=32, block=16)
    gate = GatePolicy(controller, base=base, accept=0.9, veto=0.5, model=model, **args)
    ref = tracelock.reference_generate(model, prompts, policy=gate, **kw)
    got = tracelock.fused_generate(model, prompts, policy=gate, **kw)
    assert torch.equal(got[0], ref[0]) and got[1].steps == ref[1].steps
    assert got[1].commits_per_step == ref[1].commits_per_step
    plain = tracelock.fused_generate(model, prompts, policy=base, policy_args={k[5:]: v for k, v in args.items()}, **kw)
    assert plain[1].commits_per_step != got[1].commits_per_step


@pytest.mark.parametrize("base, args, schedule", [("frechet", dict(base_delta=0.1), dict(block=8, cache="dual")),
                                                  ("credit", dict(base_tau=0.8), dict(block=8))])
def test_engine_and_compiled_steps_equal_the_eager_loop(base, args, schedule, tmp_path):
    from tracelock.testing import eos_prone_model

    model = eos_prone_model(tmp_path, "llada", 16)
    controller, encoder = fresh_controller(model)
    gate = GatePolicy(controller, base=base, accept=0.6, veto=0.4, encoder=encoder, **args)
    prompts = random_prompts(model)
    kw = dict(policy=gate, gen_length=16, **schedule)
    for compile in (False, True):
        rows, _ = decode_on_engine(model, prompts, compile=compile, **kw)
        for r, prompt in enumerate(prompts):
            assert_same_decode(rows[r], tracelock.fused_generate(model, [prompt], impl="torch", **kw),
                               f"{base} compile={compile}")


@pytest.mark.parametrize("args, match", [
    (dict(accept=0.0), r"accept=0\.0 must lie in \(0, 1\]; accept=1 turns it off"),
    (dict(veto=1.0), r"veto=1\.0 must lie in \[0, 1\); veto=0 turns it off"),
    (dict(base="nope"), r"base='nope' must be a training-free rule's name"),
    (dict(base="random"), r"base='random' must be a deterministic training-free rule"),
    (dict(base="frechet", base_tau=0.9), r"base 'frechet' takes no argument base_tau"),
    (dict(theta=0.9), r"policy 'gate' takes no argument theta"),
])
def test_bad_arguments_are_named(args, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make_policy("gate", controller="testbed", **args)


def test_the_spec_grammar_builds_the_gate():
    from tracelock.eval.runner import parse_policies

    (spec,) = parse_policies("gate:controller=testbed:base=frechet:base_delta=0.3:base_hold_end=true:veto=0.2")
    policy = make_policy(spec.name, **spec.args)
    assert isinstance(policy.base, FrechetPolicy) and policy.base.delta == 0.3 and policy.base.hold_end
    assert policy.veto == 0.2 and policy.accept == 1.0
