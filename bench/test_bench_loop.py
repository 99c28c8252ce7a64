"""The decode loop's own cost per step, before (the eager loop) and after (the compiled static-shape engine).

The backbone is a *micro* one: the target's spec (vocabulary, special ids, family) with hidden size 8, one head, three
layers (what the taps need) and an MLP of 16, random weights, so a forward costs almost nothing and a step's time is
the loop's overhead: the Python, the small ops, the host reads. Rules: Fast-dLLM's threshold 0.9 in blocks with the
dual cache, and confidence one per step in blocks without a cache; batch 1 and the target's batch. Per step = the
median / the forwards of the run. Before timing, the compiled run's tokens and steps are checked equal to the eager
loop's. Like the other compiled rows, the smoke run skips the compiled ones (their first call compiles).
"""

import dataclasses

import pytest
import torch

import tracelock
from tracelock.models.shapes import random_weights

RULES = {
    "fastdllm-0.9-dual": dict(policy="threshold", policy_args={"tau": 0.9}, cache="dual"),
    "confidence": dict(policy="confidence"),
}


@pytest.fixture(scope="session")
def micro(target):
    spec = dataclasses.replace(target.model.spec, hidden_size=8, num_heads=1, num_kv_heads=1, head_dim=8,
                               num_layers=3, intermediate_size=16)
    return random_weights(spec, device=target.model.device, dtype=torch.float32, seed=0)


@pytest.mark.parametrize("batch", ["B1", "Bn"])
@pytest.mark.parametrize("loop", ["eager", "compiled"])
@pytest.mark.parametrize("rule", list(RULES))
def test_loop_overhead(request, benchmark, target, machine, micro, rule, loop, batch):
    if loop == "compiled" and benchmark.disabled:
        pytest.skip("the compiled loop compiles on its first call (tens of seconds per graph on a CPU): it runs with "
                    "--benchmark; tests/test_decode_compiled.py checks the compiled path")
    prompts = target.prompts[:1] if batch == "B1" else target.prompts
    kw = dict(RULES[rule], gen_length=target.gen_length, block=target.block)
    want, want_stats = tracelock.fused_generate(micro, prompts, **kw)
    tokens, stats = tracelock.fused_generate(micro, prompts, compile=loop == "compiled", **kw)
    assert torch.equal(tokens, want) and stats.steps == want_stats.steps and stats.forwards == want_stats.forwards
    n = len(prompts)
    benchmark.group = f"loop-micro-{rule}-B{n}-gen{target.gen_length}-block{target.block}"
    benchmark.extra_info.update(machine, rule=rule, loop=loop, items=n, forwards=stats.forwards,
                                mean_steps=sum(stats.steps) / n,
                                micro_params=sum(p.numel() for p in micro.parameters()))
    if benchmark.disabled:
        return
    compile = loop == "compiled"
    benchmark.pedantic(lambda: tracelock.fused_generate(micro, prompts, compile=compile, **kw),
                       rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1)
    benchmark.extra_info.update(seconds_per_step=benchmark.stats.stats.median / stats.forwards)
