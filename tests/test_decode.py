"""The decoding loop on real tiny checkpoints: step accounting, schedules, batching, fused == reference."""

import pytest
import torch

import tracelock
from tracelock import states
from tracelock.models import write_tiny_checkpoint
from tracelock.models.query import Outputs
from tracelock.policies import POLICIES, Policy
from tracelock.policies.base import topk_mask
from tracelock.testing import random_prompts

G = 16
DETERMINISTIC = [("confidence", {}), ("topk", {"k": 2}), ("maskgit_plus", {}), ("topk_margin", {}),
                 ("entropy", {}), ("threshold", {"tau": 0.5}), ("factor", {"f": 1.0}),
                 ("confidence", {"score": "neg_entropy"}), ("frechet", {"delta": 0.0})]


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=3)
    return tracelock.load_model(path)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A LLaDA-tiny whose LM head is scaled up: confident proposals, so threshold rules commit several per step."""
    m = tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("peaked"), family="llada", seed=4))
    m.lm_head.weight.mul_(20.0)
    return m


def test_policy_names_are_complete():
    assert sorted(POLICIES) == sorted(["random", "confidence", "origin", "maskgit_plus", "topk_margin", "entropy",
                                       "threshold", "factor", "frechet", "topk", "tracelock", "l2p",
                                       "l2p-hidden", "credit", "hierarchy", "klass", "less", "eb", "pc", "gate"])


@pytest.mark.parametrize("schedule", [{"block": 4}, {"window": 4}, {}], ids=["block4", "window4", "full"])
def test_confidence_one_per_step_takes_gen_length_steps(model, schedule):
    tokens, stats = tracelock.reference_generate(model, random_prompts(model)[:1], policy="confidence", gen_length=G,
                                                 **schedule)
    assert stats.steps == [G]
    assert stats.commits_per_step == [[1] * G]
    assert not (tokens == model.spec.mask_id).any()


def test_threshold_takes_fewer_steps_and_blocks_end_when_done(peaked):
    prompts = random_prompts(peaked)[:1]
    _, conf = tracelock.reference_generate(peaked, prompts, policy="confidence", gen_length=G, block=4)
    _, thr = tracelock.reference_generate(peaked, prompts, policy="threshold", gen_length=G, block=4)
    assert thr.steps[0] < conf.steps[0] == G
    # a block ends as soon as it has no active position: the next step already works on the next block
    assert all(n >= 1 for n in thr.commits_per_step[0])
    assert sum(thr.commits_per_step[0]) == G


def test_idle_steps_reproduce_the_release_floor(peaked):
    """The release's block = step // steps_per_block: floor (num_blocks - 1) * steps_per_block + 1."""
    prompts = random_prompts(peaked)[:1]
    _, fast = tracelock.reference_generate(peaked, prompts, policy="threshold", gen_length=G, block=8)
    _, idle = tracelock.reference_generate(peaked, prompts, policy="threshold", gen_length=G, block=8,
                                           idle_steps=True)
    floor = (G // 8 - 1) * 8 + 1
    assert fast.steps[0] < floor <= idle.steps[0]
    assert 0 in idle.commits_per_step[0]
    with pytest.raises(ValueError, match="needs block"):
        tracelock.reference_generate(peaked, prompts, policy="threshold", gen_length=G, idle_steps=True)


def test_window_commits_only_inside_the_window(peaked):
    prompts = random_prompts(peaked)[:1]
    _, stats = tracelock.reference_generate(peaked, prompts, policy="threshold", policy_args={"tau": 1e-9},
                                            gen_length=G, window=3)
    # tau ~ 0 commits every active slot of the window: 3 per step
    assert stats.commits_per_step[0][:5] == [3] * 5
    assert stats.steps[0] == -(-G // 3)


def test_threshold_dream_first_token_commits_each_block_start_from_the_refresh(model):
    """Fast-dLLM's Dream variant: a block's first step commits exactly its first position, then tau rules."""
    from tracelock.policies import ThresholdPolicy

    class Spy(ThresholdPolicy):
        firsts = []

        def select(self, inp, generator=None):
            mask = super().select(inp, generator)
            for row in (inp.region_step == 0).nonzero().flatten().tolist():
                start = inp.positions[row][inp.active[row]].min()
                self.firsts.append(inp.positions[row][mask[row]].tolist() == [start.item()])
            return mask

    prompts = random_prompts(model)
    spy = Spy(tau=1e-9, first_token=True)
    _, stats = tracelock.reference_generate(model, prompts, policy=spy, gen_length=G, block=4)
    # tau ~ 0: the refresh commits the block start, the next step the other three
    assert stats.commits_per_step == [[1, 3] * (G // 4)] * len(prompts)
    assert len(Spy.firsts) == len(prompts) * G // 4 and all(Spy.firsts)
    _, plain = tracelock.reference_generate(model, prompts, policy="threshold", policy_args={"tau": 1e-9},
                                            gen_length=G, block=4)
    assert plain.commits_per_step == [[4] * (G // 4)] * len(prompts)
    args = {"tau": 0.5, "first_token": True}
    ref, ref_stats = tracelock.reference_generate(model, prompts, policy="threshold", policy_args=args, gen_length=G,
                                                  block=4)
    for impl in ("torch", None):
        got, got_stats = tracelock.fused_generate(model, prompts, policy="threshold", policy_args=args, gen_length=G,
                                                  block=4, impl=impl)
        assert torch.equal(ref, got) and ref_stats.commits_per_step == got_stats.commits_per_step


@pytest.mark.parametrize("name,args", DETERMINISTIC, ids=[n for n, _ in DETERMINISTIC])
def test_batch_equals_single(model, name, args):
    prompts = random_prompts(model)
    batch, bstats = tracelock.reference_generate(model, prompts, policy=name, policy_args=args, gen_length=G, block=8)
    for row, prompt in enumerate(prompts):
        alone, stats = tracelock.reference_generate(model, [prompt], policy=name, policy_args=args, gen_length=G,
                                                    block=8)
        assert torch.equal(batch[row, -G:], alone[0, -G:]), f"row {row}"
        assert bstats.steps[row] == stats.steps[0]
        assert bstats.commits_per_step[row] == stats.commits_per_step[0]


# impl=None is what a user gets: here the Triton kernels under the interpreter (slow: three policies of different
# kinds), and the C++ commits when built
FUSED_CASES = ([(name, args, "torch") for name, args in DETERMINISTIC + [("random", {}), ("origin", {})]]
               + [(name, args, None) for name, args in DETERMINISTIC if name in ("confidence", "threshold", "topk")])


@pytest.mark.parametrize("stop_at_eot", [True, False], ids=["stop", "no-stop"])
@pytest.mark.parametrize("name,args,impl", FUSED_CASES, ids=[f"{n}-{i or 'default'}" for n, _, i in FUSED_CASES])
def test_fused_equals_reference(model, name, args, impl, stop_at_eot):
    prompts = random_prompts(model)
    ref, ref_stats = tracelock.reference_generate(model, prompts, policy=name, policy_args=args, gen_length=G,
                                                  window=6, stop_at_eot=stop_at_eot)
    got, got_stats = tracelock.fused_generate(model, prompts, policy=name, policy_args=args, gen_length=G, window=6,
                                              stop_at_eot=stop_at_eot, impl=impl)
    assert torch.equal(ref, got)
    assert ref_stats.steps == got_stats.steps
    assert ref_stats.commits_per_step == got_stats.commits_per_step


def _count_lm_head_calls(model, run) -> int:
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        run()
    finally:
        handle.remove()
    return len(calls)


def test_fused_greedy_never_writes_logits(model):
    """Greedy decoding scores the window from the LM head's input (window_logits_stats): the head module never
    runs; sampling needs the logits and does run it."""
    prompts = random_prompts(model)
    kwargs = dict(policy="confidence", gen_length=G, block=8, impl="torch")
    assert _count_lm_head_calls(model, lambda: tracelock.fused_generate(model, prompts, **kwargs)) == 0
    assert _count_lm_head_calls(model, lambda: tracelock.reference_generate(model, prompts, **kwargs)) == G
    sampled = lambda: tracelock.fused_generate(model, prompts, temperature=0.7, **kwargs)  # noqa: E731
    assert _count_lm_head_calls(model, sampled) == G


def test_fused_impl_names_map_to_each_op(model, monkeypatch):
    prompts = random_prompts(model)[:1]
    ref, _ = tracelock.reference_generate(model, prompts, policy="confidence", gen_length=G, block=8)
    monkeypatch.setenv("TRACELOCK_IMPL", "torch")
    assert torch.equal(tracelock.fused_generate(model, prompts, policy="confidence", gen_length=G, block=8)[0], ref)
    monkeypatch.setenv("TRACELOCK_IMPL", "cutlass")
    with pytest.raises(ValueError, match="unknown impl 'cutlass'.*known impls: torch, triton, cpp, cuda"):
        tracelock.fused_generate(model, prompts, policy="confidence", gen_length=G, block=8)


@pytest.mark.parametrize("generate", ["fused_generate", "reference_generate"])
def test_decoding_builds_no_autograd_graph(model, generate):
    """The loop runs under no_grad, whether or not the caller's weights require grad (a graph over every step's
    forward would hold each step's activations)."""
    seen = []
    hook = model.embed.register_forward_hook(lambda mod, args, out: seen.append(torch.is_grad_enabled()))
    model.requires_grad_(True)
    try:
        getattr(tracelock, generate)(model, random_prompts(model)[:1], policy="confidence", gen_length=G, block=8)
    finally:
        hook.remove()
        model.requires_grad_(False)
    assert seen and not any(seen)


def test_seeded_sampling_is_reproducible(model):
    prompts = random_prompts(model)
    runs = [tracelock.fused_generate(model, prompts, policy="random", gen_length=G, temperature=0.8, seed=s)[0]
            for s in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_stop_at_eot_fills_the_tail(peaked):
    """Make the end token win everywhere: the first commit ends the row, the rest becomes pad in state eot."""
    spec = peaked.spec

    def favour_eos(module, inputs, logits):
        logits[..., spec.eos_id] += 1e4

    hook = peaked.lm_head.register_forward_hook(favour_eos)
    try:
        # window 1: the first commit lands on the first generated position
        tokens, stats = tracelock.reference_generate(peaked, random_prompts(peaked)[:1], policy="confidence",
                                                     gen_length=G, window=1, stop_at_eot=True)
        _, no_stop = tracelock.reference_generate(peaked, random_prompts(peaked)[:1], policy="confidence",
                                                  gen_length=G, window=1)
    finally:
        hook.remove()
    assert stats.steps == [1] and no_stop.steps == [G]
    assert stats.gen_lengths == [0]
    assert set(tokens[0, -G:].tolist()) <= {spec.eos_id, spec.pad_id}


def test_cfg_runs_and_changes_logits(model):
    prompts = random_prompts(model)[:1]
    plain, _ = tracelock.reference_generate(model, prompts, policy="confidence", gen_length=G)
    guided, stats = tracelock.reference_generate(model, prompts, policy="confidence", gen_length=G, cfg_scale=2.0)
    assert stats.steps == [G]
    assert not torch.equal(plain, guided)


def test_states_after_decoding(model):
    tokens, _ = tracelock.reference_generate(model, random_prompts(model)[:1], policy="threshold", gen_length=G)
    assert not (tokens == model.spec.mask_id).any()
    assert states.NAMES[states.EOT] == "eot"


@pytest.mark.parametrize("kwargs,match", [
    (dict(gen_length=0), "gen_length=0 must be a positive int"),
    (dict(gen_length=G, window=0), r"window=0 must be an int in \[1, gen_length"),
    (dict(gen_length=G, window=G + 1), "window=17"),
    (dict(gen_length=G, block=5), "block=5 does not divide gen_length=16"),
    (dict(gen_length=G, block=4, window=4), "not both"),
    (dict(gen_length=G, policy="threshold", policy_args={"tau": 1.5}), r"tau"),
    (dict(gen_length=G, policy="threshold", policy_args={"tau": 0.0}), r"tau"),
    (dict(gen_length=G, policy="beam"), "unknown policy 'beam'.*confidence.*threshold"),
    (dict(gen_length=G, policy="confidence", block=4, policy_args={"steps": 6}), "steps=6"),
])
def test_bad_input_names_the_fix(model, kwargs, match):
    kwargs.setdefault("policy", "confidence")
    with pytest.raises(ValueError, match=match):
        tracelock.reference_generate(model, random_prompts(model)[:1], **kwargs)


def test_bad_prompts_name_the_fix(model):
    with pytest.raises(ValueError, match="empty"):
        tracelock.reference_generate(model, [[]], policy="confidence", gen_length=G)
    with pytest.raises(ValueError, match=f"mask token \\(id {model.spec.mask_id}\\)"):
        tracelock.reference_generate(model, [[1, model.spec.mask_id, 2]], policy="confidence", gen_length=G)
    with pytest.raises(ValueError, match="exceeds the model's"):
        tracelock.reference_generate(model, [[1, 2]], policy="confidence", gen_length=model.spec.max_positions)
    with pytest.raises(ValueError, match="left padding"):
        tracelock.reference_generate(model, torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 1, 0]]),
                                     policy="confidence", gen_length=G)


class TapNormPolicy(Policy):
    """A stand-in for a learned policy: commits the active slot whose final tap has the largest norm."""

    name = "tap_norm"
    needs_taps = True

    def __init__(self):
        super().__init__()
        self.first_step = None

    def select(self, inp, generator=None):
        if self.first_step is None:
            self.first_step = inp
        h = inp.taps[2]
        score = h.norm(dim=-1).gather(1, inp.positions.clamp(max=h.shape[1] - 1))
        return topk_mask(score, inp.active, torch.ones_like(inp.region_step))


def test_policies_that_need_taps_plug_in(model):
    """Taps arrive for canvas positions [0, region end), with the family's shift, from the same forward."""
    prompt = random_prompts(model)[:1]
    policy = TapNormPolicy()
    _, stats = tracelock.reference_generate(model, prompt, policy=policy, gen_length=G, window=5)
    assert stats.steps == [G]
    first = policy.first_step
    P = len(prompt[0])
    assert all(t.shape == (1, P + 5, model.spec.hidden_size) for t in first.taps)
    canvas = torch.cat([torch.tensor(prompt), torch.full((1, G), model.spec.mask_id)], dim=1)
    with torch.no_grad():
        full = model(canvas, outputs=Outputs(taps=True)).taps
    rows = model.spec.output_rows(torch.arange(P + 5))
    for got, ref in zip(first.taps, full):
        assert torch.allclose(got[0], ref[0, rows], atol=1e-5)


def test_padded_rows_read_the_taps_they_read_alone(model):
    """Dream's shift reads row p - 1 for position p; a left-padded row's first real position has padding there, so
    it reads itself, as position 0 of the row unpadded does (LLaDA has no shift: nothing to check)."""
    prompt = random_prompts(model)[1]
    P, pad = len(prompt), 4
    alone = torch.tensor([prompt])
    padded = torch.tensor([[model.spec.pad_id] * pad + prompt])
    mask = torch.tensor([[False] * pad + [True] * P])
    with torch.no_grad():
        want = model.predict(alone, torch.arange(P)[None],
                             outputs=Outputs(taps=True, tap_positions=torch.arange(P)[None])).taps
        got = model.predict(padded, pad + torch.arange(P)[None], mask,
                            outputs=Outputs(taps=True, tap_positions=pad + torch.arange(P)[None])).taps
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
