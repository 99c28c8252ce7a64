"""The KV cache (`tracelock.decode.kv_cache`) per policy, and batched throughput (`tracelock.generate_many`).

``cache-*`` groups: one policy's fused decode with no cache, the prefix cache and the dual cache (blocks refresh at
every block start, TraceLock's window when it has moved half a window). Before timing, a cached run is checked
against the reference loop with the same cache (exact in fp32), and the uncached row against the plain decode.
extra_info has the metric, steps, refreshes and tokens/s, so the rows give accuracy next to wall-clock.

``throughput-*`` groups: all the target's prompts through `generate_many` with the prefix cache, one prompt per
batch against one batch of all of them (length-sorted); both must give the same tokens, checked first.
"""

import pytest

import tracelock

# explicit parameters (not the conftest's ``policy``, which would add every decode policy only to skip it)
CACHE_POLICIES = ["fastdllm-0.9", "tracelock"]
THROUGHPUT_POLICY = "fastdllm-0.9"


@pytest.fixture(scope="session")
def cached(target, policy_kwargs):
    """``cached(runner, policy, cache)``: (tokens, stats) of that loop with that cache, computed once per session."""
    runs = {}

    def get(runner: str, policy: str, cache):
        if (runner, policy, cache) not in runs:
            generate = {"reference": tracelock.reference_generate, "fused": tracelock.fused_generate}[runner]
            runs[runner, policy, cache] = generate(target.model, target.prompts, cache=cache, **policy_kwargs(policy))
        return runs[runner, policy, cache]

    return get


@pytest.fixture(scope="session")
def many(target, policy_kwargs):
    """``many(batch_size)``: `generate_many` of the target's prompts with the prefix cache, once per session."""
    runs = {}

    def get(size: int):
        if size not in runs:
            runs[size] = tracelock.generate_many(target.model, target.prompts, batch_size=size, cache="prefix",
                                                 **policy_kwargs(THROUGHPUT_POLICY))
        return runs[size]

    return get


@pytest.mark.parametrize("cache", [None, "prefix", "dual"], ids=["none", "prefix", "dual"])
@pytest.mark.parametrize("cache_policy", CACHE_POLICIES)
def test_cache(benchmark, target, controller, machine, decoded, cached, policy_kwargs, check_same, cache_policy,
               cache):
    policy = cache_policy
    if cache is None:
        tokens, stats = decoded("fused", policy)  # the uncached row is the decode group's own run
        agreement = 1.0
    else:
        agreement = check_same(cached("reference", policy, cache), cached("fused", policy, cache))
        tokens, stats = cached("fused", policy, cache)
    n = target.batch
    benchmark.group = f"cache-{target.name}-{policy}-B{n}-gen{target.gen_length}-width{target.block}"
    benchmark.extra_info.update(
        machine, policy=policy, cache=cache or "none", items=n, gen_length=target.gen_length, width=target.block,
        forwards=stats.forwards, mean_steps=sum(stats.steps) / n, mean_refreshes=sum(stats.refreshes) / n,
        gen_tokens=sum(stats.gen_lengths), metric=target.metric(tokens), agreement=agreement,
        controller=controller[1] if policy == "tracelock" else None)
    if benchmark.disabled:
        return
    kwargs = policy_kwargs(policy)
    benchmark.pedantic(lambda: tracelock.fused_generate(target.model, target.prompts, cache=cache, **kwargs),
                       rounds=5, warmup_rounds=1)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(seconds_per_sample=median / n, tokens_per_second=sum(stats.gen_lengths) / median)


@pytest.mark.parametrize("batch", ["single", "all"])
def test_throughput(benchmark, target, machine, policy_kwargs, many, batch):
    size = 1 if batch == "single" else target.batch
    outputs, stats = many(size)
    other, _ = many(target.batch + 1 - size)
    if target.float32:
        assert outputs == other, "batched and one-by-one decoding differ with the cache"
    else:
        same = sum(a == b for (a, _), (b, _) in zip(outputs, other)) / len(outputs)
        assert same >= 0.5, f"only {same:.0%} of prompts decode the same batched and one by one in bf16"
    benchmark.group = f"throughput-{target.name}-{THROUGHPUT_POLICY}-prefix-gen{target.gen_length}-width{target.block}"
    benchmark.extra_info.update(machine, policy=THROUGHPUT_POLICY, cache="prefix", prompts=stats.prompts,
                                batch_size=size, batches=stats.batches, tokens=stats.tokens, steps=stats.steps,
                                padding=stats.padding)
    if benchmark.disabled:
        return
    kwargs = dict(policy_kwargs(THROUGHPUT_POLICY), cache="prefix")
    benchmark.pedantic(lambda: tracelock.generate_many(target.model, target.prompts, batch_size=size, **kwargs),
                       rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(tokens_per_second=stats.tokens / benchmark.stats.stats.median)
