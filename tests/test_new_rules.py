"""The rules published since Fast-dLLM (CreditDecoding, dInfer's hierarchy, KLASS, LESS, the entropy bound,
PC-Sampler): their selections on constructed inputs (worked out by hand in the comments), the memory of the rules that
remember (reset where their authors' code resets it, carried by every driver), and their errors.

Token-for-token checks against the authors' own code are in bench/test_bench_peers_since.py.
"""

import json

import pytest
import torch

import tracelock
from tracelock.decode.context import allocate_memory, start_run
from tracelock.decode.engine import DecodeEngine
from tracelock.decode.settings import DecodeSettings
from tracelock.ops import op_set, spec_set
from tracelock.policies import POLICIES, StepInput, make_policy
from tracelock.policies.hierarchy import run_best
from tracelock.reference import reference_generate
from tracelock.signals import Signals
from tracelock.testing import eos_prone_model, random_prompts

NEW_RULES = ("credit", "hierarchy", "klass", "less", "eb", "pc")
MEMORY_RULES = ("credit", "klass", "less")


def _inp(conf, active=None, *, step=0, proposal=None, neg_entropy=None, vocab=None, budget=4):
    conf = torch.tensor([conf], dtype=torch.float32)
    r = conf.shape[1]
    active = torch.ones(1, r, dtype=torch.bool) if active is None else torch.tensor([active], dtype=torch.bool)
    prop = torch.zeros(1, r, dtype=torch.long) if proposal is None else torch.tensor([proposal])
    neg = conf if neg_entropy is None else torch.tensor([neg_entropy], dtype=torch.float32)
    sig = Signals(prop, conf, conf, neg, torch.zeros(1, r))
    count = active.sum(-1)
    vocab = None if vocab is None else {k: torch.tensor([v]) for k, v in vocab.items()}
    return StepInput(sig, active, torch.tensor([step]), count.clone(), count.clone(), budget, vocab=vocab)


def _picked(mask):
    return mask[0].nonzero().flatten().tolist()


# ---- the selections ------------------------------------------------------------------------------------------------


def _credit(tau):
    policy = make_policy("credit", tau=tau)
    policy.memory_spec(width=4, spec=type("Spec", (), {"mask_id": 7, "vocab_size": 16, "eos_id": 1})())
    return policy


def test_credit_commits_above_tau_or_within_1e5_of_the_best():
    # tau 0.9: the bar is min(0.95 - 1e-5, 0.9) = 0.9, and 0.9 >= 0.9 commits (dInfer compares with >=)
    assert _picked(_credit(0.9).select(_inp([0.5, 0.95, 0.9, 0.89, 0.3]))) == [1, 2]
    # nothing clears tau: the best and every slot within 1e-5 of it commit (0.599995 >= 0.6 - 1e-5)
    assert _picked(_credit(0.9).select(_inp([0.5, 0.6, 0.599995, 0.2]))) == [1, 2]
    # an inactive slot counts as -inf, even when it is the best: the bar falls to 0.599995 - 1e-5
    assert _picked(_credit(0.9).select(_inp([0.5, 0.6, 0.599995, 0.2], [True, False, True, True]))) == [2]


def test_credit_never_commits_a_mask_token_proposal():
    policy = _credit(0.5)
    # slot 1 is the most confident but proposes the mask token (7): dInfer drops it, so slot 2 is the best left
    inp = _inp([0.3, 0.99, 0.45, 0.2], proposal=[1, 7, 2, 3])
    assert _picked(policy.select(inp)) == [2]


def test_hierarchy_one_per_run_above_low_plus_tau_plus_the_best():
    conf = torch.tensor([[0.5, 0.7, 0.9, 0.3, 0.35, 0.2, 0.9, 0.6]])
    active = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    # runs {0, 1}: best 1 (0.7 > 0.4); {3, 4, 5}: best 4 (0.35, not > 0.4); {7}: 0.6 > 0.4. The best overall is 1.
    assert _picked(run_best(conf, active, 0.4, None)) == [1, 7]
    # tau 0.45 adds slot 0 (0.5 > 0.45); inactive slots 2 and 6 (0.9) never commit
    assert _picked(run_best(conf, active, 0.4, 0.45)) == [0, 1, 7]
    # a tie at a run's best commits both (dInfer compares with ==); nothing clears low 0.5: only the best overall
    tie = torch.tensor([[0.45, 0.45, 0.1]])
    assert _picked(run_best(tie, torch.ones_like(tie, dtype=torch.bool), 0.4, None)) == [0, 1]
    assert _picked(run_best(tie, torch.ones_like(tie, dtype=torch.bool), 0.5, None)) == [0]


def test_entropy_bound_counts():
    policy = make_policy("eb", gamma=0.005)
    entropy = torch.tensor([[0.001, 0.5, 0.002, 0.004]])
    active = torch.ones_like(entropy, dtype=torch.bool)
    # ascending 0.001, 0.002, 0.004, 0.5: sum less the largest so far 0, 0.001, 0.003, 0.007 -> three within 0.005
    assert policy.counts(entropy, active).tolist() == [3]
    # the largest entropy of a prefix is not charged: at gamma 0.01 the 0.5 slot joins too
    assert make_policy("eb", gamma=0.01).counts(entropy, active).tolist() == [4]
    # at least one, and only active slots
    assert make_policy("eb", gamma=0.0).counts(entropy, active).tolist() == [1]
    inp = _inp([0.1, 0.1, 0.1, 0.1], [True, False, True, True], neg_entropy=[-0.001, -0.5, -0.002, -0.004])
    assert _picked(make_policy("eb", gamma=0.005).select(inp)) == [0, 2, 3]


def test_pc_scores_position_and_rarity(tmp_path):
    table = tmp_path / "bg.json"
    table.write_text(json.dumps({"num_token": 100, "p_baseline_dict": {"1": 50, "2": 1}}))
    policy = make_policy("pc", background=str(table), lambd=0.5, alpha=3.0)
    policy.setup(gen_length=4, num_regions=1)
    inp = _inp([0.9, 0.9, 0.5, 0.9], proposal=[1, 2, 2, 3])
    want = []
    for j, (p, f) in enumerate([(0.9, 0.5), (0.9, 0.01), (0.5, 0.01), (0.9, 0.01)]):  # id 3 is absent: 1 / 100
        want.append(torch.exp(torch.tensor(-0.5 * j)) * min(-p * torch.log(torch.tensor(f + 1e-9)), 3.0))
    assert torch.allclose(policy.scores(inp)[0], torch.tensor(want))
    # one per step (steps = gen_length): slot 1, the rare token near the front (its cap 3 beats slot 0's 0.62)
    assert _picked(policy.select(inp)) == [1]


def test_klass_ready_and_fallbacks():
    vocab = {"confidence": [0.95, 0.9, 0.99, 0.5], "stable": [True, True, False, True]}
    llada = make_policy("klass", tau=0.9, history=2)
    llada.setup(gen_length=8, num_regions=2)  # 4 steps per block, one token each
    # step 1: ready = stable, masked and conf > 0.9 (strict): slot 0 only
    assert _picked(llada.select(_inp([0] * 4, step=1, vocab=vocab))) == [0]
    # step 0 (< history - 1): nobody is ready, the schedule's one most confident commits (slot 2, unstable or not)
    assert _picked(llada.select(_inp([0] * 4, step=0, vocab=vocab))) == [2]
    dream = make_policy("klass", tau=0.9, form="dream")
    dream.setup(gen_length=8, num_regions=1)
    # the Dream form: conf >= 0.9 and no step gate: slots 0 and 1
    assert _picked(dream.select(_inp([0] * 4, step=0, vocab={**vocab, "fallback": [0.0] * 4}))) == [0, 1]
    # nobody ready: the one best by the fallback's ranking (the softmax in the logits' dtype), not by confidence
    none_ready = {"confidence": [0.5, 0.7, 0.6, 0.1], "stable": [True] * 4, "fallback": [0.5, 0.7, 0.8, 0.1]}
    assert _picked(dream.select(_inp([0] * 4, vocab=none_ready))) == [2]


# ---- the vocabulary passes and their memory ------------------------------------------------------------------------


def _spec(vocab_size=10, mask_id=9):
    return type("Spec", (), {"mask_id": mask_id, "vocab_size": vocab_size, "eos_id": 8})()


def _memory(policy, width):
    return {k: torch.zeros((1, *shape), dtype=dtype) for k, (shape, dtype) in
            policy.memory_spec(width=width, spec=_spec()).items()}


def test_credit_memory_decays_boosts_and_restarts():
    policy = make_policy("credit", alpha=1.0, gamma=1.0, beta=0.5)
    memory = _memory(policy, 1)
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2] + [1e-9] * 7]]))
    active, fresh = torch.ones(1, 1, dtype=torch.bool), torch.tensor([True])
    policy.vocab_pass(spec_set(), logits, memory, active, fresh, 1)
    assert torch.allclose(memory["credit"][0, 0, :3], torch.tensor([0.5, 0.0, 0.0]), atol=1e-6)
    policy.vocab_pass(spec_set(), logits, memory, active, torch.tensor([False]), 1)
    assert torch.allclose(memory["credit"][0, 0, 0], torch.tensor(0.5 * 0.5 + 0.5), atol=1e-6)  # decay, then boost
    out = policy.vocab_pass(spec_set(), logits, memory, active, fresh, 1)  # a new block starts over
    assert torch.allclose(memory["credit"][0, 0, 0], torch.tensor(0.5), atol=1e-6)
    fused = logits[0, 0] + torch.log(memory["credit"][0, 0] + 1)
    assert out["proposal"].item() == 0 and torch.allclose(out["confidence"][0, 0], fused.softmax(-1)[0])
    # an unmasked slot decays but gains nothing
    policy.vocab_pass(spec_set(), logits, memory, ~active, torch.tensor([False]), 1)
    assert torch.allclose(memory["credit"][0, 0, 0], torch.tensor(0.25), atol=1e-6)


def test_klass_memory_is_stable_after_history_steps_and_moves_with_the_block():
    policy = make_policy("klass", kl=0.01, history=2)
    memory = _memory(policy, 4)  # a region of 2 slots and the next region's 2
    logits = torch.randn(1, 4, 10)
    active, not_fresh = torch.ones(1, 4, dtype=torch.bool), torch.tensor([False])
    # against the zero start the KL is large; the same distribution twice more gives KL 0 twice
    stable = [policy.vocab_pass(spec_set(), logits, memory, active, not_fresh, 2)["stable"][0].tolist()
              for _ in range(3)]
    assert stable == [[False] * 4, [False] * 4, [True] * 4]
    # a new block: the region takes what the next region gathered, the new next region starts empty
    tail = memory["prev"][0, 2:].clone()
    memory["kl_ring"][0, 2:] = 1.0  # unstable history of the next block's slots
    out = policy.vocab_pass(spec_set(), logits, memory, active, torch.tensor([True]), 2)
    assert out["stable"][0].tolist() == [False, False, False, False]
    assert torch.allclose(memory["prev"][0, :2], logits[0, :2].double().softmax(-1).float())
    assert memory["kl_ring"][0, :2, 0].tolist() == [1.0, 1.0] and tail.sum() > 0


def test_less_accepts_after_persist_forwards_and_restarts_with_the_block():
    policy = make_policy("less", tau=0.5, drift=0.04, persist=2)
    memory = _memory(policy, 1)
    logits = torch.log(torch.tensor([[[0.9, 0.05, 0.02] + [0.01] * 3 + [1e-9] * 4]]))
    active = torch.ones(1, 1, dtype=torch.bool)

    def accepted(fresh):
        return policy.vocab_pass(spec_set(), logits, memory, active, torch.tensor([fresh]), 1)[
            "accepted"].item()

    # forward 1: no previous pass (drift 1); forward 2: one previous top-1 of the two asked; forward 3: accepted
    assert [accepted(True), accepted(False), accepted(False)] == [False, False, True]
    assert accepted(True) is False  # a new block forgets
    assert [accepted(False), accepted(False)] == [False, True]
    # a top-1 that was another token at the last forward breaks persistence for the next two
    memory["top1"][0, 0, -1] = 3
    assert [accepted(False), accepted(False), accepted(False)] == [False, False, True]


# ---- the drivers ---------------------------------------------------------------------------------------------------

_PROMPTS = {}


def _prompts(name):
    if name not in _PROMPTS:
        tok = tracelock.load_tokenizer(name)
        qs = ["Zoe has 9 books. She finds 4 more books. How many books does Zoe have now?",
              "Tom has 3 apples and eats 1. How many are left?", "Write a function that adds two numbers."]
        _PROMPTS[name] = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"] for q in qs]
    return _PROMPTS[name]


def _args(rule, name):
    return {"pc": {"background": name}, "hierarchy": {"tau": 0.9}}.get(rule, {})


@pytest.fixture(scope="module", params=["llada", "dream"])
def tiny(request, tmp_path_factory):
    return eos_prone_model(tmp_path_factory.mktemp(request.param), request.param, 16)


@pytest.mark.parametrize("rule", NEW_RULES)
def test_fused_equals_reference(tiny, rule):
    """On a CPU in fp32 the fused loop (its ops as dispatched: the Triton kernels under the interpreter in CI) and the
    reference give the same tokens and steps, in blocks, on the whole answer, and with the end-of-text hold."""
    prompts = random_prompts(tiny)
    args = _args(rule, "testbed")
    kws = (dict(block=4), dict(), dict(block=4, policy_args={**args, "hold_end": True}))
    # their kernels are slow under the CPU interpreter (tests/test_kernel_*.py check them)
    if rule in ("klass", "less"):
        prompts, kws = prompts[:1], kws[:1] if rule == "less" else kws[:2]
    for kw in kws:
        kw = {"policy_args": args, **kw}
        got, stats = tracelock.fused_generate(tiny, prompts, policy=rule, gen_length=16, **kw)
        want, ref = reference_generate(tiny, prompts, policy=rule, gen_length=16, **kw)
        assert torch.equal(got, want) and stats.steps == ref.steps, (rule, kw)


def _engine_matches(model, rule, compile=False, **kw):
    """Three prompts through a two-slot engine (the third takes a freed slot, whose memory must start over), each as
    fused_generate decodes it alone."""
    prompts = _prompts("testbed")
    engine = DecodeEngine(model, slots=2, prompt_len=64, gen_length=32, policy=rule,
                          policy_args=_args(rule, "testbed"), compile=compile, **kw)
    owner = {engine.admit(prompts[0]): 0, engine.admit(prompts[1]): 1}
    done = {}
    while engine.step():
        for slot in engine.finished_slots():
            done[owner[slot]] = engine.result(slot)
            engine.release(slot)
            if len(done) == 1:
                owner[engine.admit(prompts[2])] = 2
    for i, prompt in enumerate(prompts):
        tokens, stats = done[i]
        # the engine's ops are each op's default a graph holds (the specs on a CPU): compare with the same
        want, ref = tracelock.fused_generate(model, [prompt], policy=rule, policy_args=_args(rule, "testbed"),
                                             gen_length=32, impl="torch", **kw)
        assert torch.equal(tokens, want), (rule, kw, i)
        assert stats.steps == ref.steps and stats.commits_per_step == ref.commits_per_step, (rule, kw, i)


@pytest.mark.parametrize("rule", MEMORY_RULES)
@pytest.mark.parametrize("kw", [dict(block=16), dict(block=16, cache="dual")], ids=["block", "dual"])
def test_engine_slots_carry_and_drop_the_memory(rule, kw):
    _engine_matches(tracelock.load_model("testbed"), rule, **kw)


def test_compiled_engine_carries_the_memory():
    """KLASS in blocks: the memory covers the next block and moves at a block's start, inside the compiled graphs."""
    _engine_matches(tracelock.load_model("testbed"), "klass", compile=True, block=16)


def test_a_rule_without_memory_pays_nothing():
    model = tracelock.load_model("testbed")
    fused = op_set(model.device)
    for name in ("threshold", "hierarchy", "eb"):
        ctx = start_run(model, DecodeSettings(policy=name, gen_length=16, block=16), fused)
        assert allocate_memory(ctx, 4) == {}
        # its steps still score from the LM head's input (no logits written)
        assert ctx.window_logits_stats is fused.window_logits_stats
    credit = start_run(model, DecodeSettings(policy="credit", gen_length=16, block=16), fused)
    assert credit.window_logits_stats is None


# ---- errors --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, kwargs, exc, match", [
    ("credit", {"tau": 0.0}, ValueError, r"tau=0.0 must lie in \(0, 1\]"),
    ("credit", {"alpha": -1}, ValueError, "alpha=-1 must be a finite number >= 0"),
    ("credit", {"beta": 1.5}, ValueError, r"beta=1.5 must lie in \[0, 1\]"),
    ("hierarchy", {"low": 1.0}, ValueError, r"low=1.0 must lie in \[0, 1\)"),
    ("hierarchy", {"tau": 2}, ValueError, "tau=2 must lie in"),
    ("klass", {"kl": -0.1}, ValueError, "kl=-0.1 must be a finite number > 0"),
    ("klass", {"history": 0}, ValueError, "history=0 must be an int >= 1"),
    ("klass", {"form": "sdar"}, ValueError, "form='sdar' must be one of llada, dream"),
    ("less", {"drift": 1.0}, ValueError, r"drift=1.0 must lie in \[0, ln 2"),
    ("less", {"persist": 0}, ValueError, "persist=0 must be an int >= 1"),
    ("eb", {"gamma": -1}, ValueError, "gamma=-1 must be a finite number >= 0"),
    ("pc", {}, TypeError, "needs background"),
    ("pc", {"background": "nowhere.json"}, ValueError, "background='nowhere.json': no such file"),
    ("pc", {"background": "testbed", "alpha": 0}, ValueError, "alpha=0 must be a finite number > 0"),
    ("eb", {"hold_end": 1}, TypeError, "hold_end=1 must be a bool"),
    ("klass", {"tau": 0.9, "first_token": "yes"}, TypeError, "first_token='yes' must be a bool"),
])
def test_bad_knobs(spec, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        make_policy(spec, **kwargs)


def test_memory_rules_refuse_a_window_and_sampling():
    model = tracelock.load_model("testbed")
    ids = _prompts("testbed")[:1]
    with pytest.raises(ValueError, match="use block=N .* not window=16"):
        tracelock.fused_generate(model, ids, policy="credit", gen_length=32, window=16)
    with pytest.raises(ValueError, match="pass temperature=0, not 0.5"):
        tracelock.fused_generate(model, ids, policy="klass", gen_length=32, temperature=0.5)


def test_every_new_rule_is_registered_and_training_free():
    for name in NEW_RULES:
        assert not POLICIES[name].learned and POLICIES[name].deterministic
    assert {n for n, cls in POLICIES.items() if cls.reads_vocab} == set(MEMORY_RULES)


@pytest.mark.parametrize("name", ["testbed", "testbed-dream"])
def test_shipped_background_tables_are_a_fresh_count(name):
    from tracelock.models.loading import resolve_path
    from tracelock.testbed.background import testbed_background

    shipped = json.loads((resolve_path(name) / "background.json").read_text())
    assert shipped == json.loads(json.dumps(testbed_background(name)))
