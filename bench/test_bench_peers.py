"""Fast-dLLM's own code (`bench/peers.py`) against tracelock, same checkpoint, same prompts, same rule.

One group per rule (``peer-{backbone}-{rule}-B{n}-gen{G}-block{w}``), five rows, each timed over all n prompts
(seconds per item = the median / n):

- ``fastdllm``: Fast-dLLM's function on each prompt in turn (its code decodes one prompt at a time);
- ``tracelock-eager-B1`` / ``tracelock-compiled-B1``: `fused_generate` on each prompt alone, the eager loop / compiled;
- ``tracelock-eager-B{n}`` / ``tracelock-compiled-B{n}``: one batch of all n prompts.

Every row is checked before it is timed. LLaDA rules: Fast-dLLM's canvas equals tracelock's token for token, and every
tracelock row equals the eager one (fp32). Fast-dLLM's Dream sampler commits a block's first position from the
refresh, where tracelock recomputes the row left of it (bench/README.md): its rows report the agreement rate and must
agree on >= 90% of the generated tokens. The compiled rows compile on their first call (tens of seconds per graph on
a CPU; ``first_call_seconds`` in extra_info), so the smoke run (no ``--benchmark``) skips them:
tests/test_decode_compiled.py checks the compiled path in CI.
"""

import json
import time
from pathlib import Path

import peers  # bench/peers.py (bench/ is on sys.path: conftest.py)
import pytest
import torch

import tracelock

ROWS = ["fastdllm", "tracelock-eager-B1", "tracelock-compiled-B1", "tracelock-eager-Bn", "tracelock-compiled-Bn"]


@pytest.fixture(scope="session")
def fastdllm(request):
    folder, why = peers.find_fastdllm(request.config.getoption("--peer-fastdllm"))
    if folder is None:
        pytest.skip(why)
    return folder


def _official_config(request, target) -> dict:
    """The official config.json (as a dict) of the target's checkpoint, for Fast-dLLM's model classes."""
    opt = request.config.getoption
    if opt("--shape") != "testbed":
        from tracelock.models.shapes import SHAPES
        from tracelock.models.tiny import dream_config, llada_config

        family, sizes, vocab, max_pos, ids = SHAPES[opt("--shape")]
        make = llada_config if family == "llada" else dream_config
        config = make(*sizes, ids, vocab_rows=vocab, max_positions=max_pos)
        config["n_layers" if family == "llada" else "num_hidden_layers"] = target.model.spec.num_layers
        return config
    folder = Path(opt("--model-path")) if opt("--model-path") else Path(tracelock.__file__).parent / "testbed" / "model"
    return json.loads((folder / "config.json").read_text())


class Race:
    """One backbone, its prompts, and the settings of every row of a rule."""

    def __init__(self, name, model, prompts, gen_length, block, settings, run_peer):
        self.name, self.model, self.prompts, self.gen_length, self.block = name, model, prompts, gen_length, block
        self.settings = dict(settings, gen_length=gen_length, block=block)
        self.run_peer = run_peer  # prompt -> (canvas [1, P + G], NFE)
        self.runs = {}

    def body(self, row: str):
        """The row's work over all prompts: a list of (canvas, steps) per prompt, or one batch."""
        kw = self.settings
        if row == "fastdllm":
            return lambda: [self.run_peer(p) for p in self.prompts]
        compile = row.startswith("tracelock-compiled")
        if row.endswith("B1"):
            return lambda: [tracelock.fused_generate(self.model, [p], compile=compile, **kw) for p in self.prompts]
        return lambda: tracelock.fused_generate(self.model, self.prompts, compile=compile, **kw)

    def result(self, row: str):
        """The row's generated tokens per prompt [G] and its steps per prompt (NFE for Fast-dLLM), computed once."""
        if row not in self.runs:
            start = time.perf_counter()
            out = self.body(row)()
            seconds = time.perf_counter() - start
            G = self.gen_length
            if row == "fastdllm":
                tokens, steps = [c[0, -G:].cpu() for c, _ in out], [None if n is None else int(n) for _, n in out]
            elif row.endswith("B1"):
                tokens, steps = [c[0, -G:].cpu() for c, _ in out], [s.steps[0] for _, s in out]
            else:
                canvas, stats = out
                tokens, steps = list(canvas[:, -G:].cpu()), stats.steps
            self.runs[row] = tokens, steps, seconds
        return self.runs[row]


def _peer_rule_ids():
    return list(peers.LLADA_RULES) + [peers.DREAM_RULE]


@pytest.fixture(scope="session")
def races(request, target, fastdllm):
    """``races(rule)``: the `Race` of a rule, built once per session."""
    built = {}

    def get(rule: str) -> Race:
        if rule in built:
            return built[rule]
        G, block = target.gen_length, target.block
        if rule == peers.DREAM_RULE:
            model, prompts, config = _dream_backbone(request, target)
            peer = peers.load_dream(fastdllm, model, config)
            gen_config = peers.dream_generation_config(fastdllm, model.spec, G, G)

            def run_peer(prompt):
                return peers.run_dream(peer, gen_config, prompt, block=block), None

            own = target.model.spec.family == "dream"
            name, settings = target.name if own else "tiny-dream", peers.DREAM_SETTINGS
        else:
            if target.model.spec.family != "llada":
                pytest.skip(f"{rule} is Fast-dLLM's LLaDA code; the target is a {target.model.spec.family} model")
            model, prompts = target.model, target.prompts
            module = peers.llada_generate_module(fastdllm)
            peer = peers.load_llada(fastdllm, model, _official_config(request, target))

            def run_peer(prompt):
                return peers.run_llada(module, peer, rule, prompt, gen_length=G, block=block,
                                       mask_id=model.spec.mask_id)

            name, settings = target.name, peers.LLADA_RULES[rule][2]
        built[rule] = Race(name, model, prompts, G, block, settings, run_peer)
        return built[rule]

    return get


def _dream_backbone(request, target):
    """(model, prompts, config) for the Dream rule: the target when it is a Dream model; else a tiny random Dream
    checkpoint (the code paths' cost and agreement, not a model's) with random prompts of the target's lengths."""
    if target.model.spec.family == "dream":
        return target.model, target.prompts, _official_config(request, target)
    from tracelock.models import write_tiny_checkpoint
    from tracelock.testing import random_prompts

    folder = write_tiny_checkpoint(Path(request.config.cache.mkdir("tracelock-bench-peer-dream")), family="dream",
                                   seed=4)
    model = tracelock.load_model(folder, device=target.model.device)
    prompts = random_prompts(model, lengths=[min(len(p), 64) for p in target.prompts], seed=0)
    return model, prompts, json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("rule", _peer_rule_ids())
def test_peer(request, benchmark, target, machine, races, fastdllm, rule, row):
    race = races(rule)
    n = len(race.prompts)
    if row.startswith("tracelock-compiled") and benchmark.disabled:
        pytest.skip("compiled rows compile on their first call (tens of seconds per graph on a CPU): they run with "
                    "--benchmark; tests/test_decode_compiled.py checks the compiled path")
    # check before timing: this row against the eager batch-1 rows, and Fast-dLLM against them
    want, want_steps, _ = race.result("tracelock-eager-B1")
    tokens, steps, first_seconds = race.result(row)
    agreement = sum(int((a == b).sum()) for a, b in zip(tokens, want)) / (n * race.gen_length)
    if row == "fastdllm" and rule == peers.DREAM_RULE:
        assert agreement >= 0.9, f"Fast-dLLM's Dream sampler agrees with tracelock on only {agreement:.1%}"
    elif race.model.dtype == torch.float32:
        assert agreement == 1.0, f"{row} differs from tracelock's eager decode ({agreement:.1%} equal tokens)"
        if row != "fastdllm":
            assert steps == want_steps
    row_label = row.replace("Bn", f"B{n}")
    benchmark.group = f"peer-{race.name}-{rule}-B{n}-gen{race.gen_length}-block{race.block}"
    if row == "fastdllm":
        benchmark.extra_info["peer"] = peers.fastdllm_version(fastdllm)
    benchmark.extra_info.update(
        machine, rule=rule, row=row_label, items=n, gen_length=race.gen_length, block=race.block,
        agreement=agreement, mean_steps=None if steps[0] is None else sum(steps) / n,
        settings={k: v for k, v in race.settings.items() if k != "policy_args"} | {"args": race.settings.get(
            "policy_args")}, first_call_seconds=first_seconds)
    if benchmark.disabled:
        return  # smoke run: the checked run above was this row's work
    body = race.body(row)
    walls = []

    def timed():
        start = time.perf_counter()
        body()
        walls.append(time.perf_counter() - start)

    benchmark.pedantic(timed, rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1)
    median = benchmark.stats.stats.median
    walls.sort()
    benchmark.extra_info.update(seconds_per_item=median / n, wall_seconds_per_item=walls[len(walls) // 2] / n)


# Fast-dLLM++'s Fréchet profile rule: the `frechet` policy against the peer's own code (checks, not timed)
FRECHET_DELTAS = (0.0, 0.3)
LLADA_FUNCTIONS = (("generate", None), ("generate_with_prefix_cache", "prefix"), ("generate_with_dual_cache", "dual"))


@pytest.fixture(scope="session")
def plusplus(request):
    folder, why = peers.find_plusplus(request.config.getoption("--peer-plusplus"))
    if folder is None:
        pytest.skip(why)
    return folder


def _bundled(name: str, n: int = 4):
    """A bundled model, its config.json and n validation items per task as chat prompts (token ids)."""
    from tracelock.eval.tasks import make_task
    from tracelock.text import encode_prompt

    model, tok = tracelock.load_model(name), tracelock.load_tokenizer(name)
    folder = Path(tracelock.__file__).parent / "testbed" / ("model-dream" if name == "testbed-dream" else "model")
    items = [it for task in ("math", "code") for it in make_task(f"testbed:{task}@validation").items(n)]
    return model, json.loads((folder / "config.json").read_text()), [encode_prompt(tok, it.prompt) for it in items]


def test_frechet_rule_equals_plusplus_on_random_profiles(plusplus):
    """One step: the policy's commits are the peer's `get_transfer_index_frechet_profile`'s on random float64 logits
    (sharp and flat, every delta sign, rows with few or no masked positions)."""
    from tracelock.policies import make_policy
    from tracelock.policies.base import StepInput
    from tracelock.signals import Signals

    module = peers.plusplus_generate_module(plusplus)
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        B, L, V = 3, 16, 20
        logits = torch.randn(B, L, V, dtype=torch.float64, generator=g) * 8 * torch.rand(1, generator=g).item()
        mask = torch.rand(B, L, generator=g) < torch.rand(1, generator=g).item()
        delta = float(torch.empty(1).uniform_(-0.5, 0.8, generator=g))
        _, want = module.get_transfer_index_frechet_profile(logits, 0.0, "low_confidence", mask,
                                                            torch.zeros(B, L, dtype=torch.long), delta)
        conf = torch.softmax(logits, -1).amax(-1).float()
        signals = Signals(logits.argmax(-1), conf, conf, conf, torch.zeros(B, L))
        count = mask.sum(-1)
        got = make_policy("frechet", delta=delta).select(StepInput(signals, mask, count * 0, count, count, 1))
        assert torch.equal(got, want), f"trial {trial}, delta {delta}"


def test_frechet_equals_plusplus_on_the_bundled_llada(plusplus):
    """`frechet:delta=D` on the bundled LLaDA-family model is Fast-dLLM++'s `generate`, `generate_with_prefix_cache`
    and `generate_with_dual_cache` with ``frechet_margin=D``, token for token and step for step (its NFE), 64/16."""
    model, config, prompts = _bundled("testbed", n=2)  # 2 items per task: each function and delta is what it checks
    module = peers.plusplus_generate_module(plusplus)
    peer = peers.load_plusplus_llada(plusplus, model, config)
    for delta in FRECHET_DELTAS:
        for function, cache in LLADA_FUNCTIONS:
            for i, prompt in enumerate(prompts):
                with torch.no_grad():
                    want, nfe = getattr(module, function)(peer, torch.tensor([prompt]), steps=64, gen_length=64,
                                                          block_length=16, temperature=0.0,
                                                          remasking="low_confidence", mask_id=model.spec.mask_id,
                                                          frechet_margin=delta)
                got, stats = tracelock.fused_generate(model, [prompt], policy="frechet", policy_args={"delta": delta},
                                                      gen_length=64, block=16, cache=cache)
                where = f"delta {delta}, {function}, item {i}"
                assert torch.equal(got, want), where
                assert stats.steps == [nfe], where


def test_frechet_dream_form_equals_plusplus_on_the_bundled_dream(plusplus):
    """`frechet:delta=D:first_token=true` on the bundled Dream-family model is Fast-dLLM++'s Dream block sampler with
    ``frechet_margin=D``, token for token and step for step, when the sampler's forwards are exact (its loop and rule
    unchanged; `peers.run_dream_exact`); with its own caches it agrees on >= 90% of the tokens (the caches'
    approximation, as Fast-dLLM's threshold)."""
    model, config, prompts = _bundled("testbed-dream", n=2)
    pkg = "fastdllmpp_dream"
    peer = peers.load_dream(plusplus, model, config, package=pkg)
    gen = peers.dream_generation_config(plusplus, model.spec, 64, 64, package=pkg)
    for delta in FRECHET_DELTAS:
        args = {"delta": delta, "first_token": True}
        for dual in (True, False):
            for i, prompt in enumerate(prompts):
                want, forwards = peers.run_dream_exact(plusplus, peer, gen, prompt, block=16, package=pkg,
                                                       dual_cache=dual, frechet_margin=delta)
                got, stats = tracelock.fused_generate(model, [prompt], policy="frechet", policy_args=args,
                                                      gen_length=64, block=16)
                where = f"delta {delta}, dual_cache={dual}, item {i}"
                assert torch.equal(got, want), where
                assert stats.steps == [forwards], where
        equal = total = 0
        for prompt in prompts:
            with torch.no_grad():
                want = peers.run_dream(peer, gen, prompt, block=16, frechet_margin=delta)
            got, _ = tracelock.fused_generate(model, [prompt], policy="frechet", policy_args=args, gen_length=64,
                                              block=16, cache="dual")
            equal, total = equal + int((got[0, -64:] == want[0, -64:]).sum()), total + 64
        assert equal / total >= 0.9, f"delta {delta}: the cached samplers agree on {equal / total:.1%} of the tokens"
