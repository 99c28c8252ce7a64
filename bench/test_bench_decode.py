"""End-to-end decoding per policy on one backbone, prompts and setting: `fused_generate` vs `reference_generate`.

Each group is one policy with both loops; across groups the fused rows compare the policies (seconds per sample,
steps, tokens/s and the task metric of the same prompts, recorded in extra_info).
"""

import os

import pytest

import tracelock

RUNNERS = {"reference": tracelock.reference_generate, "fused": tracelock.fused_generate}


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_decode(request, benchmark, target, controller, l2p, machine, decoded, policy_kwargs, check_same, runner,
                policy):
    # check before timing: the loop being timed gives the reference's tokens and steps
    spec = None if target.float32 else decoded("fused-spec", policy)  # bf16: see check_same
    agreement = check_same(decoded("reference", policy), decoded("fused", policy), spec)
    tokens, stats = decoded(runner, policy)

    n = target.batch
    benchmark.group = f"decode-{target.name}-{policy}-B{n}-gen{target.gen_length}-width{target.block}"
    benchmark.extra_info.update(
        machine, runner=runner, policy=policy, items=n, gen_length=target.gen_length, width=target.block,
        schedule="window" if policy == "tracelock" else "block", forwards=stats.forwards,
        mean_steps=sum(stats.steps) / n, gen_tokens=sum(stats.gen_lengths), metric=target.metric(tokens),
        agreement=agreement, impl=os.environ.get("TRACELOCK_IMPL", "auto"),
        controller=controller[1] if policy == "tracelock" else None, filters=l2p[1] if policy == "l2p" else None)
    if benchmark.disabled:
        return  # smoke run: the checked run above was this very call (`decoded`); --benchmark times it
    kwargs = policy_kwargs(policy)
    benchmark.pedantic(lambda: RUNNERS[runner](target.model, target.prompts, **kwargs),
                       rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(seconds_per_sample=median / n, tokens_per_second=sum(stats.gen_lengths) / median)
