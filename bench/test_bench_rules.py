"""Each rule published since Fast-dLLM against Fast-dLLM's threshold rule, per decoding step, in the same run: the
engine eager and compiled, on both bundled models (8 held-out math prompts, 64 tokens in blocks of 16, one engine
batch). A rule that remembers (credit, klass, less) pays for its vocabulary pass and its memory; the goal is a
compiled step at most 1.1x the threshold rule's.

Every engine is checked first: its rows equal `fused_generate` (the specs) on the same prompts. Then the rule and
the threshold rule are timed in alternating rounds (a load change on a shared machine falls on both) and the ratio of
their seconds per step goes into extra_info (`pytest bench/test_bench_rules.py --benchmark`; without the flag each
body runs once, uncompiled). Rules take different step counts, so the comparison is per step: the batch's wall time
over its steps (the engine's batched forwards). A forward runs only the live rows (padded to a power of two), and a
rule whose rows finish at other times runs forwards of other widths, so the ratios are read three ways: per full-batch
step (the first GEN / BLOCK steps, when every row is live in both rules: a step commits within one block, so no row
can finish sooner; the cleanest, the same work but the rule's), per row-step (wall time over the rows its forwards
ran; a narrow forward costs more per row, which favours the rule that keeps its rows longer) and per step.
"""

import statistics
import time

import pytest
import torch

import tracelock
from tracelock.decode.engine import DecodeEngine, prompt_bucket
from tracelock.decode.runner import row_bucket

ITEMS, GEN, BLOCK = 8, 64, 16
RULES = {"credit": {}, "klass": {}, "less": {}, "hierarchy": {"tau": 0.9}, "eb": {}, "pc": {"background": None}}


class RowCountingEngine(DecodeEngine):
    """The engine, counting the rows its forwards ran (``row_steps``: each step's live rows padded as the forward
    pads them); the bundled benchmarks run without a KV cache, so a step is one forward of that many rows."""

    row_steps = 0

    def step(self) -> bool:
        ran = super().step()
        if ran:
            self.row_steps += row_bucket(self.last_step[0], self.num_slots)
        return ran


def _engine(model, prompts, policy, args, compile) -> DecodeEngine:
    bucket = prompt_bucket(max(map(len, prompts)), GEN, model.spec.max_positions)
    return RowCountingEngine(model, policy=policy, policy_args=args, gen_length=GEN, block=BLOCK, slots=len(prompts),
                        prompt_len=bucket, compile=compile)


def _full_batch_steps(engine, prompts) -> float:
    """Seconds of the first GEN / BLOCK steps of a run, every row live in each (checked); the engine is left free."""
    engine.reset()
    for prompt in prompts:
        engine.admit(prompt)
    start = time.perf_counter()
    for _ in range(GEN // BLOCK):
        engine.step()
        assert engine.last_step[0] == len(prompts), "a row finished within its first GEN / BLOCK steps"
    seconds = time.perf_counter() - start
    engine.reset()
    return seconds


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
    forwards, row_steps = {}, {}
    for p, engine in engines.items():
        engine.reset()
        engine.forwards = engine.row_steps = 0
        forwards[p] = _checked(engine, model, prompts, *policies[p])
        row_steps[p] = engine.row_steps
    benchmark.group = f"rules-{name}-{'compiled' if compiled else 'engine'}-B{ITEMS}-gen{GEN}-block{BLOCK}"
    benchmark.extra_info.update(machine, model=name, items=len(prompts), rule=rule, args=args, forwards=forwards,
                                row_steps=row_steps)
    if benchmark.disabled:
        _full_batch_steps(engines[rule], prompts)  # its check that every row stays live
        return
    rounds = request.config.getoption("--bench-rounds")
    seconds, full = {p: [] for p in engines}, {p: [] for p in engines}
    for _ in range(rounds):
        for p, engine in engines.items():
            start = time.perf_counter()
            engine.run(prompts)
            seconds[p].append(time.perf_counter() - start)
            full[p].append(_full_batch_steps(engine, prompts))

    def ratio(per: dict, times=seconds) -> float:
        return statistics.median((a / per[rule]) / (b / per["threshold"])
                                 for a, b in zip(times[rule], times["threshold"]))

    benchmark.extra_info.update(
        seconds_per_full_batch_step={p: statistics.median(t) / (GEN // BLOCK) for p, t in full.items()},
        seconds_per_step={p: statistics.median(t) / forwards[p] for p, t in seconds.items()},
        seconds_per_row_step={p: statistics.median(t) / row_steps[p] for p, t in seconds.items()},
        ratio_per_full_batch_step=ratio(dict.fromkeys(engines, 1), full), ratio_per_row_step=ratio(row_steps),
        ratio_per_step=ratio(forwards), rounds=rounds)
    benchmark.pedantic(engines[rule].run, args=(prompts,), rounds=1, iterations=1)
