"""The backbone's KV cache: a refresh stores every position's keys and values; a cached step recomputes only its
query rows against them. With nothing stale it equals the full forward; stale keys are really read."""

import pytest
import torch

import tracelock
from tracelock.models import write_tiny_checkpoint
from tracelock.models.query import CacheQuery, Outputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    return tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param,
                                                      seed=5))


def _canvas(model, B=3, L=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(5, 200, (B, L), generator=g)
    x[:, 12:] = model.spec.mask_id
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, :3] = False  # row 1 left-padded
    return x, mask


def _rows(B, lo, hi):
    return torch.arange(lo, hi).expand(B, -1)


def test_a_cached_step_over_a_fresh_cache_equals_the_full_forward(model):
    x, mask = _canvas(model)
    B, L = x.shape
    refresh = model(x, mask, cache=CacheQuery(store=True))
    n_kv, hd = model.spec.num_kv_heads, model.spec.head_dim
    assert len(refresh.kv_cache.keys) == model.spec.num_layers
    assert refresh.kv_cache.keys[0].shape == refresh.kv_cache.values[-1].shape == (B, n_kv, L, hd)
    window = _rows(B, 12, 16)
    full = model(x, mask, outputs=Outputs(positions=window, taps=True, tap_positions=window))
    # prefix-style rows [10, L) and dual-style rows [12, 16), the first with duplicated padding in one row
    prefix = _rows(B, 10, L).clone()
    prefix[2, -2:] = L - 1
    for query in (prefix, window):
        got = model(x, mask, outputs=Outputs(positions=window, taps=True, tap_positions=window),
                    cache=CacheQuery(kv=refresh.kv_cache, query_positions=query))
        torch.testing.assert_close(got.logits, full.logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(got.taps, full.taps):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_stale_keys_are_read_and_recomputing_every_row_refreshes_them(model):
    x, mask = _canvas(model)
    B, L = x.shape
    cache = model(x, mask, cache=CacheQuery(store=True)).kv_cache
    y = x.clone()
    y[:, 12:14] = 77  # two window positions committed since the refresh
    window = _rows(B, 12, 16)
    fresh = model(y, mask, outputs=Outputs(positions=window)).logits
    # dual-style: the prompt's keys and values still come from the old canvas, so the logits move
    stale = model(y, mask, outputs=Outputs(positions=window), cache=CacheQuery(kv=cache, query_positions=window)).logits
    assert (stale - fresh).abs().max() > 1e-4
    every_row = model(y, mask, outputs=Outputs(positions=window),
                      cache=CacheQuery(kv=cache, query_positions=_rows(B, 0, L))).logits
    torch.testing.assert_close(every_row, fresh, rtol=1e-5, atol=1e-5)
    # a cached step writes its rows' fresh keys and values into the cache in place: recomputing every row left the
    # cache of the new canvas
    refreshed = model(y, mask, cache=CacheQuery(store=True)).kv_cache
    for got, want in zip(cache.keys + cache.values, refreshed.keys + refreshed.values):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_select_and_store_move_rows_between_caches(model):
    """A refresh of some rows (`DecodeKVCache.store`) writes exactly those rows; `select` copies rows out."""
    from tracelock.decode.context import start_run
    from tracelock.decode.kv_cache import DecodeKVCache
    from tracelock.decode.settings import DecodeSettings
    from tracelock.ops import spec_set

    x, mask = _canvas(model)
    B, L = x.shape
    cache = model(x, mask, cache=CacheQuery(store=True)).kv_cache
    other = model(_canvas(model, seed=1)[0], mask, cache=CacheQuery(store=True)).kv_cache
    settings = DecodeSettings(policy="confidence", gen_length=4, block=4, cache="prefix")
    state = DecodeKVCache(start_run(model, settings, spec_set()), B, L)
    state.store(torch.arange(B), cache, None)
    rows = torch.tensor([0, 2])
    state.store(rows, other.select(rows), None)
    stored = state.rows_cache(torch.arange(B))
    for mine, theirs, before in zip(stored.keys + stored.values, other.keys + other.values, cache.keys + cache.values):
        assert torch.equal(mine[rows, :, :L], theirs[rows])
        assert torch.equal(mine[1, :, :L], before[1]) and not torch.equal(mine[1, :, :L], theirs[1])


def test_cached_step_arguments_name_the_fix(model):
    x, mask = _canvas(model)
    B = x.shape[0]
    cache = model(x, mask, cache=CacheQuery(store=True)).kv_cache
    with pytest.raises(ValueError, match="cache.kv and cache.query_positions go together"):
        model(x, mask, cache=CacheQuery(kv=cache))
    with pytest.raises(ValueError, match="not among query_positions"):
        model(x, mask, outputs=Outputs(positions=_rows(B, 11, 13)),
              cache=CacheQuery(kv=cache, query_positions=_rows(B, 12, 16)))
    with pytest.raises(ValueError, match="refresh with a full forward"):
        model(x, mask, cache=CacheQuery(kv=cache, query_positions=_rows(B, 12, 16), store=True))
