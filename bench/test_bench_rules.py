"""Each rule published since Fast-dLLM against Fast-dLLM's threshold rule, per decoding step, in the same run: the
engine eager and compiled, on both bundled models (8 held-out math prompts, 64 tokens in blocks of 16, one engine
batch). A rule that remembers (credit, klass, less) pays for its vocabulary pass and its memory; the goal is a
compiled step at most 1.1x the threshold rule's.

Every engine is checked first: its rows equal `fused_generate` (the specs) on the same prompts. Then the rule and
the threshold rule are timed in alternating rounds (a load change on a shared machine falls on both) and the ratio of
their seconds per step goes into extra_info (`pytest bench/test_bench_rules.py --benchmark`; without the flag each
body runs once, uncompiled). Rules take different step counts, so the comparison is per step: the batch's wall time
over its steps (the engine's batched forwards).
"""

import statistics
import time

import pytest
import torch

import tracelock
from tracelock.decode.engine import DecodeEngine, prompt_bucket

ITEMS, GEN, BLOCK = 8, 64, 16
RULES = {"credit": {}, "klass": {}, "less": {}, "hierarchy": {"tau": 0.9}, "eb": {}, "pc": {"background": None}}


def _engine(model, prompts, policy, args, compile) -> DecodeEngine:
    bucket = prompt_bucket(max(map(len, prompts)), GEN, model.spec.max_positions)
    return DecodeEngine(model, policy=policy, policy_args=args, gen_length=GEN, block=BLOCK, slots=len(prompts),
                        prompt_len=bucket, compile=compile)


def _checked(engine, model, prompts, policy, args):
    """Decode once (a compiled engine compiles here) and check every row against fused_generate's specs."""
    rows = engine.run(prompts)
    for prompt, (tokens, stats) in zip(prompts, rows):
        want, ref = tracelock.fused_generate(model, [prompt], policy=policy, policy_args=args, gen_length=GEN,
                                             block=BLOCK, impl="torch")
        assert torch.equal(tokens, want) and stats.steps == ref.steps, policy
    return engine.forwards


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("compiled", [False, True], ids=["engine", "compiled-engine"])
def test_rule_step_against_threshold(request, benchmark, machine, bundled, rule, compiled):
    if compiled and benchmark.disabled:
        pytest.skip("the compiled engine is timed with --benchmark only (inductor compiles for minutes here)")
    name, model, prompts = bundled
    if benchmark.disabled:
        prompts = prompts[:2]  # a smoke run checks the engines on two prompts
    args = {k: name if k == "background" else v for k, v in RULES[rule].items()}
    policies = {rule: (rule, args), "threshold": ("threshold", {"tau": 0.9})}
    engines = {p: _engine(model, prompts, *spec, compiled) for p, spec in policies.items()}
    forwards = {}
    for p, engine in engines.items():
        engine.reset()
        engine.forwards = 0
        forwards[p] = _checked(engine, model, prompts, *policies[p])
    benchmark.group = f"rules-{name}-{'compiled' if compiled else 'engine'}-B{ITEMS}-gen{GEN}-block{BLOCK}"
    benchmark.extra_info.update(machine, model=name, items=len(prompts), rule=rule, args=args, forwards=forwards)
    if benchmark.disabled:
        return
    rounds = request.config.getoption("--bench-rounds")
    per_step = {p: [] for p in engines}
    for _ in range(rounds):
        for p, engine in engines.items():
            start = time.perf_counter()
            engine.run(prompts)
            per_step[p].append((time.perf_counter() - start) / forwards[p])
    ratios = [a / b for a, b in zip(per_step[rule], per_step["threshold"])]
    benchmark.extra_info.update(
        seconds_per_step={p: statistics.median(t) for p, t in per_step.items()},
        ratio_per_step=statistics.median(ratios), rounds=rounds)
    benchmark.pedantic(engines[rule].run, args=(prompts,), rounds=1, iterations=1)
