"""The decoding loop's KV cache (`tracelock.decode.kv_cache`) on real tiny checkpoints: refreshing every step is the
uncached decode, semi-AR blocks follow Fast-dLLM's per-block refresh (an independent loop written from its rules),
batch equals single, fused equals reference (TraceLock included), cached positions keep the refresh's taps."""

from functools import partial

import pytest
import torch

import tracelock
from tracelock.decode.canvas import prepare_canvas
from tracelock.decode.context import start_run
from tracelock.decode.kv_cache import DecodeKVCache
from tracelock.decode.settings import DecodeSettings
from tracelock.decode.step import forward_rows
from tracelock.models import write_tiny_checkpoint
from tracelock.models.query import CacheQuery, Outputs
from tracelock.ops import spec_set
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.testing import fresh_controller, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
G = 16


@pytest.fixture(scope="module", params=["llada", "dream"])
def peaked(request, tmp_path_factory):
    """A tiny checkpoint with a scaled-up LM head: confident proposals, so threshold rules commit several per step
    and rows advance at different speeds."""
    m = tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param,
                                                   seed=4))
    m.lm_head.weight.mul_(20.0)
    return m


@pytest.fixture(scope="module")
def tracelock_policy(peaked):
    controller, encoder = fresh_controller(peaked)
    return TraceLockPolicy(controller, encoder, theta=0.55)


def _spy_forwards(model, monkeypatch) -> list:
    """Record (a refresh, the query positions) of every backbone forward; the real forward still runs."""
    calls, real = [], model.forward

    def spy(*args, **kwargs):
        cache = kwargs.get("cache")
        calls.append((cache is not None and cache.store, None if cache is None else cache.query_positions))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    return calls


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("schedule", [{"block": 4}, {"window": 5}], ids=["block4", "window5"])
def test_refreshing_every_step_is_the_uncached_decode(peaked, cache, schedule):
    prompts = random_prompts(peaked)
    args = dict(policy="threshold", policy_args={"tau": 0.7}, gen_length=G, **schedule)
    plain, plain_stats = tracelock.reference_generate(peaked, prompts, **args)
    every, every_stats = tracelock.reference_generate(peaked, prompts, cache=cache, refresh_every=1, **args)
    assert torch.equal(plain, every)
    assert plain_stats.steps == every_stats.steps == every_stats.refreshes
    assert plain_stats.commits_per_step == every_stats.commits_per_step
    assert plain_stats.refreshes == [0, 0, 0]


def _fastdllm_cached(model, prompt, block, tau, dual):
    """Fast-dLLM v1's generate_with_prefix_cache / generate_with_dual_cache for one LLaDA row and the threshold rule,
    written from Fast-dLLM v1's rule: each block starts with a full forward that refreshes the cache and is also the
    block's first step; later steps recompute the block plus the suffix (prefix) or the block alone (dual)."""
    mask_id = model.spec.mask_id
    x = torch.tensor([prompt + [mask_id] * G])
    L, P, nfe = x.shape[1], len(prompt), 0

    def commit(logits, start, end):
        conf, x0 = torch.softmax(logits.double(), -1).max(-1)  # [1, block]
        masked = x[:, start:end] == mask_id
        conf = torch.where(masked, conf, -torch.inf)
        take = conf >= tau
        take[0, conf[0].argmax()] = True  # the top-1 is always committed
        x[:, start:end] = torch.where(take & masked, x0, x[:, start:end])

    for b in range(G // block):
        start, end = P + b * block, P + (b + 1) * block
        block_rows = torch.arange(start, end)[None]
        out = model(x, outputs=Outputs(positions=block_rows), cache=CacheQuery(store=True))
        nfe += 1
        commit(out.logits, start, end)
        while (x[:, start:end] == mask_id).any():
            query = torch.arange(start, end if dual else L)[None]
            logits = model(x, outputs=Outputs(positions=block_rows),
                           cache=CacheQuery(kv=out.kv_cache, query_positions=query)).logits
            nfe += 1
            commit(logits, start, end)
    return x, nfe


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_blocks_follow_fastdllm_per_block_refresh(peaked, cache, monkeypatch):
    if peaked.spec.family != "llada":
        pytest.skip("Fast-dLLM's Dream variant shifts block-local logits; ours recomputes the row before the block")
    block, tau = 4, 0.9
    for prompt in random_prompts(peaked):
        want, nfe = _fastdllm_cached(peaked, prompt, block, tau, cache == "dual")
        calls = _spy_forwards(peaked, monkeypatch)
        got, stats = tracelock.fused_generate(peaked, [prompt], policy="threshold", policy_args={"tau": tau},
                                              gen_length=G, block=block, cache=cache)
        monkeypatch.undo()
        assert torch.equal(got, want)
        assert stats.steps == [nfe] and stats.refreshes == [G // block]
        assert nfe > G // block  # cached steps really ran
        # NFE per block = 1 + k: a refresh opens every block, the cached steps query [block start, L or block end)
        starts = [len(prompt) + b * block for b in range(G // block)]
        refreshes = [i for i, (store, _) in enumerate(calls) if store]
        assert refreshes[0] == 0 and len(refreshes) == G // block
        for i, (store, query) in enumerate(calls):
            if not store:
                b = sum(r <= i for r in refreshes) - 1
                end = starts[b] + block if cache == "dual" else len(prompt) + G
                assert query[0].tolist() == list(range(starts[b], end))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_batch_equals_single_with_the_cache(peaked, cache):
    prompts = random_prompts(peaked)
    args = dict(policy="threshold", policy_args={"tau": 0.7}, gen_length=G, window=4, cache=cache, refresh_shift=2)
    batch, bstats = tracelock.fused_generate(peaked, prompts, **args)
    # rows refreshed at different steps, so some steps ran two forwards
    assert bstats.forwards > max(bstats.steps)
    for row, prompt in enumerate(prompts):
        alone, stats = tracelock.fused_generate(peaked, [prompt], **args)
        assert torch.equal(batch[row, -G:], alone[0, -G:]), f"row {row}"
        assert bstats.steps[row] == stats.steps[0] and bstats.refreshes[row] == stats.refreshes[0]
        assert bstats.commits_per_step[row] == stats.commits_per_step[0]


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("policy", ["threshold", "tracelock"])
def test_fused_equals_reference_with_the_cache(peaked, tracelock_policy, cache, policy):
    prompts = random_prompts(peaked)
    args = dict(policy=tracelock_policy if policy == "tracelock" else policy, gen_length=G, window=6, cache=cache,
                refresh_shift=3, refresh_every=4)
    ref, ref_stats = tracelock.reference_generate(peaked, prompts, **args)
    got, got_stats = tracelock.fused_generate(peaked, prompts, impl="torch", **args)
    assert torch.equal(ref, got)
    assert ref_stats.steps == got_stats.steps and ref_stats.refreshes == got_stats.refreshes
    assert ref_stats.commits_per_step == got_stats.commits_per_step
    assert min(ref_stats.refreshes) > 1 and max(ref_stats.refreshes) < max(ref_stats.steps)


def test_cached_positions_keep_the_refresh_taps(peaked, tracelock_policy):
    """A cached step's taps are the refresh's left of the pointer and right of the region, the step's own inside."""
    canvas = prepare_canvas(peaked.spec, random_prompts(peaked), None, G, peaked.device)
    B, L = canvas.x.shape
    rows = torch.arange(B)
    lo = torch.full((B,), canvas.prompt_len)
    hi, T = lo + 6, canvas.prompt_len + 10
    positions = lo[:, None] + torch.arange(6)
    settings = DecodeSettings(policy=tracelock_policy, gen_length=G, window=6, cache="dual", refresh_shift=4)
    # the raw taps (the spec set folds none): three of the model's width
    ctx = start_run(peaked, settings, spec_set())
    kv = DecodeKVCache(ctx, B, L)
    assert kv.taps is not None and len(kv.taps) == 3

    forward = partial(forward_rows, ctx, canvas)
    _, first = kv.step(forward, rows, positions, lo, hi, T)
    canvas.x[:, lo[0]:lo[0] + 3] = 7  # commits after the refresh; the pointer has not moved far enough
    _, second = kv.step(forward, rows, positions + 3, lo + 3, hi + 3, T)
    assert kv.refreshes.tolist() == [1] * B
    start, end = int(lo[0]), int(hi[0]) + 3  # the pointer, the region's end now
    query = torch.arange(start - peaked.spec.logit_shift, end).expand(B, -1)
    fresh = torch.arange(start, end).expand(B, -1)
    own = forward_rows(ctx, canvas, rows, positions, fresh, CacheQuery(kv.rows_cache(rows), query))[1]
    for old, new, step_own in zip(first, second, own):
        assert new.shape == (B, T, old.shape[-1]) and end < T
        torch.testing.assert_close(new[:, :start], old[:, :start], rtol=0, atol=0)
        torch.testing.assert_close(new[:, end:], old[:, end:], rtol=0, atol=0)
        torch.testing.assert_close(new[:, start:end], step_own, rtol=0, atol=0)
        assert not torch.equal(new[:, start:start + 3], old[:, start:start + 3])


def test_cache_arguments_name_the_fix(peaked):
    prompts = random_prompts(peaked)[:1]
    run = lambda **kw: tracelock.fused_generate(peaked, prompts, policy="confidence", gen_length=G, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="must be None, 'prefix' or 'dual'"):
        run(cache="both")
    with pytest.raises(ValueError, match="pass cache='prefix' or cache='dual'"):
        run(refresh_every=4)
    with pytest.raises(ValueError, match="semi-AR blocks refresh at every block start"):
        run(block=4, cache="prefix", refresh_shift=2)
    with pytest.raises(ValueError, match="refresh_every=0 must be a positive int"):
        run(window=4, cache="dual", refresh_every=0)
    with pytest.raises(ValueError, match="classifier-free guidance"):
        run(block=4, cache="prefix", cfg_scale=1.0)


@pytest.mark.parametrize("name", ["random", "confidence", "origin", "maskgit_plus", "topk_margin", "entropy", "factor",
                                  "frechet", "topk"])
def test_every_policy_decodes_with_the_cache(peaked, name):
    """Every policy of the common loop runs with both caches: fused == reference, nothing left masked."""
    prompts = random_prompts(peaked)
    for cache, schedule in (("prefix", {"block": 8}), ("dual", {"window": 6})):
        args = dict(policy=name, gen_length=G, cache=cache, **schedule)
        ref, ref_stats = tracelock.reference_generate(peaked, prompts, **args)
        got, got_stats = tracelock.fused_generate(peaked, prompts, impl="torch", **args)
        assert torch.equal(ref, got) and ref_stats.steps == got_stats.steps
        assert min(got_stats.refreshes) >= 1 and not (got[:, -G:] == peaked.spec.mask_id).any()
