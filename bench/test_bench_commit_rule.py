"""The shipped commit rule in the engine: closed by the commit op (`ops.commit_step`, this release) against the same
rule closed in torch (`select` -> `scatter_slots` -> `apply_commits`, how the shipped controllers' steps ran
before), per item, on both bundled models with their shipped controllers (8 held-out math prompts, 64 tokens in a
window of 16, one engine batch). Both paths are checked to give the same tokens and steps before anything is timed;
then they are timed in alternating rounds and their ratio goes into extra_info (`pytest
bench/test_bench_commit_rule.py --benchmark`; without the flag each body runs once). Each path has its own engine,
built (and compiled) once and reused across rounds, so a row is the steady state. The compiled engine (inductor) is
timed only with ``--benchmark``: its compile is minutes on a 2-core CPU.
"""

import statistics
import time

import pytest
import torch

from tracelock.decode.engine import DecodeEngine, prompt_bucket
from tracelock.policies.tracelock import TraceLockPolicy

ITEMS, GEN, WINDOW = 8, 64, 16


class ClosedInTorch(TraceLockPolicy):
    """The same controller and rule with no commit rule for the op: every step is decided by `select` and written
    by `apply_commits`."""

    def commit_rule(self, inp):
        return None


def _engine(model, prompts, policy, compile) -> DecodeEngine:
    bucket = prompt_bucket(max(map(len, prompts)), GEN, model.spec.max_positions)
    return DecodeEngine(model, policy=policy, gen_length=GEN, window=WINDOW, slots=len(prompts), prompt_len=bucket,
                        compile=compile)


def _interleaved(engines, prompts, rounds: int) -> dict:
    """Seconds per batch of each path, the paths alternating round by round so that a load change on a shared
    machine falls on both: medians, and the median of the per-round ratios."""
    times = {p: [] for p in engines}
    for _ in range(rounds):
        for p, engine in engines.items():
            start = time.perf_counter()
            engine.run(prompts)
            times[p].append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(times["commit-op"], times["closed-in-torch"])]
    return dict(seconds_per_item={p: statistics.median(t) / ITEMS for p, t in times.items()},
                ratio_of_medians=statistics.median(times["commit-op"]) / statistics.median(times["closed-in-torch"]),
                median_round_ratio=statistics.median(ratios), rounds=rounds)


@pytest.mark.parametrize("compiled", [False, True], ids=["engine", "compiled-engine"])
def test_shipped_rule_in_the_engine(request, benchmark, machine, bundled, compiled):
    if compiled and benchmark.disabled:
        pytest.skip("the compiled engine is timed with --benchmark only (inductor compiles for minutes here)")
    name, model, prompts = bundled
    policies = {"commit-op": TraceLockPolicy(name, model=model), "closed-in-torch": ClosedInTorch(name, model=model)}
    engines = {p: _engine(model, prompts, policy, compiled) for p, policy in policies.items()}
    # check before timing: both paths decode the same tokens and steps (and a compiled engine compiles here)
    want, got = (engines[p].run(prompts) for p in ("closed-in-torch", "commit-op"))
    for (tokens, stats), (ref_tokens, ref_stats) in zip(got, want):
        assert torch.equal(tokens, ref_tokens) and stats.steps == ref_stats.steps
    steps = sum(stats.steps[0] for _, stats in got)
    benchmark.group = f"commit-rule-{name}-{'compiled' if compiled else 'engine'}-B{ITEMS}-gen{GEN}-window{WINDOW}"
    rule = policies["commit-op"]
    benchmark.extra_info.update(machine, model=name, items=ITEMS, mean_steps=steps / ITEMS,
                                commit_rule=dict(hold_end=rule.hold_end, fallback=rule.fallback))
    if benchmark.disabled:
        return  # smoke run: the checked decodes above ran both paths
    rounds = request.config.getoption("--bench-rounds")
    benchmark.extra_info.update(_interleaved(engines, prompts, rounds))
    # the table's row: the commit-op path (the ratio against the torch path is in extra_info)
    benchmark.pedantic(lambda: engines["commit-op"].run(prompts), rounds=rounds, warmup_rounds=0)
