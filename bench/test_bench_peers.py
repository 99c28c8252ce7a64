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
