"""`fused_generate(..., compile=True)` and the compiled engine: the same tokens and steps as the eager loop (fp32 CPU),
no graph breaks, recompiles bounded, and a warning (never silence) where the eager loop has to run.

Inductor compiles are slow on a 2-core CPU (tens of seconds per graph when its cache is cold), so inductor runs three
settings chosen to cover the schedules, the caches, both families and batch 1 / > 1 with few graphs; every policy
goes through dynamo with ``fullgraph=True`` (the graph capture, which a graph break fails) and its graphs run by the
eager backend. ``TRACELOCK_TEST_COMPILE_BACKEND=inductor`` runs tests/test_decode_engine.py's whole matrix compiled.
"""

import os
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import tracelock
from tracelock.decode import compiled
from tracelock.decode.engine import DecodeEngine
from tracelock.policies.l2p import L2PPolicy
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.testing import (
    assert_same_decode,
    decode_on_engine,
    eos_prone_model,
    fresh_controller,
    random_prompts,
    step_l2p_filter,
)

pytestmark = pytest.mark.usefixtures("one_thread", "inductor_cache")
G = 16


@pytest.fixture(scope="module")
def inductor_cache():
    """Inductor's compiled kernels under .pytest_cache (kept between runs), unless the caller chose a folder."""
    folder = Path(__file__).resolve().parents[1] / ".pytest_cache" / "torchinductor"
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder))
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return eos_prone_model(tmp_path_factory.mktemp("llada"), "llada", G)


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    return eos_prone_model(tmp_path_factory.mktemp("dream"), "dream", G)


def _compare(model, prompts, **kw):
    eager, eager_stats = tracelock.fused_generate(model, prompts, impl="torch", **kw)
    got, stats = tracelock.fused_generate(model, prompts, compile=True, **kw)
    assert torch.equal(got, eager)
    assert stats.steps == eager_stats.steps and stats.commits_per_step == eager_stats.commits_per_step
    assert stats.refreshes == eager_stats.refreshes and stats.forwards == eager_stats.forwards
    assert stats.gen_lengths == eager_stats.gen_lengths and stats.settings == eager_stats.settings
    return stats


def test_inductor_blocks_dual_cache(llada):
    """Fast-dLLM's rule in blocks with the dual cache, batch 1 (refresh and cached graphs, row count 1); a second
    call with other prompts of the same bucket compiles nothing."""
    kw = dict(policy="threshold", policy_args={"tau": 0.7}, gen_length=G, block=4, cache="dual")
    prompts = random_prompts(llada)
    stats = _compare(llada, prompts[:1], **kw)
    assert stats.refreshes == [G // 4] and stats.steps[0] > G // 4
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for prompt in prompts[1:]:
        _compare(llada, [prompt], **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_inductor_window_batch_dream(dream):
    """Confidence one per step in a window, no cache, Dream (the logit shift), batch 2 with padded prompts."""
    _compare(dream, random_prompts(dream)[:2], policy="confidence", gen_length=G, window=8)


def test_inductor_tracelock_prefix_cache(llada):
    """TraceLock (taps folded in the forward, the controller in the finishing graph) in a window with the prefix
    cache (refreshes by window shift and by count)."""
    controller, encoder = fresh_controller(llada)
    policy = TraceLockPolicy(controller, encoder, theta=0.55)
    stats = _compare(llada, random_prompts(llada)[:1], policy=policy, gen_length=G, window=6, cache="prefix",
                     refresh_shift=3, refresh_every=4)
    assert stats.refreshes[0] > 1


def _every_policy(model):
    """(policy, args, schedule and cache, batch): every policy once on LLaDA, what Dream's shift changes on Dream;
    each schedule, each cache, batch 1 and > 1 (rows finishing apart: forwards over fewer rows than slots)."""
    controller, encoder = fresh_controller(model)
    tracelock_policy = TraceLockPolicy(controller, encoder, theta=0.55)
    if model.spec.family == "dream":
        return [("threshold", {"tau": 0.7, "first_token": True}, dict(block=4, cache="dual"), 1),
                ("threshold", {"tau": 0.7, "hold_end": True}, dict(window=8), 1),
                (tracelock_policy, {}, dict(window=8, cache="prefix"), 1)]
    return [("confidence", {}, dict(block=4), 3), ("topk", {"k": 2}, dict(window=8, cache="prefix"), 1),
            ("maskgit_plus", {}, dict(cache="dual"), 1), ("topk_margin", {}, dict(block=4, cache="dual"), 1),
            ("entropy", {}, dict(window=8), 1), ("threshold", {"tau": 0.7}, dict(block=4, cache="prefix"), 2),
            ("factor", {}, dict(block=4, cache="prefix"), 1), (tracelock_policy, {}, dict(window=8, cache="dual"), 2),
            (TraceLockPolicy(controller, encoder, theta=0.55, cap=2), {}, dict(stop_at_eot=True), 1),
            # the shipped controllers' rule (hold_end, the backbone's score as fallback), closed by the commit op
            (TraceLockPolicy(controller, encoder, theta=0.55, hold_end=True, fallback="confidence"), {},
             dict(window=8), 2),
            (L2PPolicy(step_l2p_filter(model), filter_block=4), {}, dict(block=4, cache="prefix"), 1)]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_every_policy_captures_whole_and_matches(family, request):
    """Every policy's step traced by dynamo with fullgraph=True (a graph break would raise); the traced graphs give
    the eager loop's rows."""
    model = request.getfixturevalue(family)
    prompts = random_prompts(model)
    for policy, args, schedule, batch in _every_policy(model):
        counter = CompileCounter()
        kw = dict(policy=policy, policy_args=args, gen_length=G, **schedule)
        rows, engine = decode_on_engine(model, prompts[:batch], compile=True, backend=counter, **kw)
        assert engine.compiled and counter.frame_count == 2 + len(engine.runner.graphs)
        if batch > 1 and "threshold" in str(policy):
            assert len(engine.runner.graphs) > 2  # rows finished apart: forwards ran on fewer rows than slots
        for r, prompt in enumerate(prompts[:batch]):
            assert_same_decode(rows[r], tracelock.fused_generate(model, [prompt], impl="torch", **kw), f"{policy}")


def test_recompiles_are_bounded(llada):
    """Many prompts of one bucket through one engine, joining at different steps: each graph is compiled once (the
    prepare and finish graphs, a refresh and a cached forward per row count), whatever the prompts."""
    counter = CompileCounter()
    engine = DecodeEngine(llada, slots=2, prompt_len=16, policy="threshold", policy_args={"tau": 0.7}, gen_length=G,
                          block=4, cache="dual", compile=True, backend=counter)
    prompts = random_prompts(llada, lengths=(9, 5, 12, 3, 16, 7, 11, 2, 14, 6), seed=1)
    waiting = list(prompts)
    for rnd in range(2):  # the same prompts again: nothing new to compile
        waiting = list(prompts)
        while waiting or engine.busy_slots():
            while waiting and engine.free_slots():
                engine.admit(waiting.pop(0))
            engine.step()
            for slot in engine.finished_slots():
                engine.release(slot)
        if rnd == 0:
            first = counter.frame_count
    assert first == counter.frame_count <= 2 + 2 * 2
    assert sorted(engine.runner.graphs) == [("cached", 1), ("cached", 2), ("refresh", 1), ("refresh", 2)]


@pytest.mark.parametrize("kw,why", [
    (dict(policy="confidence", temperature=0.7), "sampling"),
    (dict(policy="confidence", temperature=0.7, top_p=0.9, top_k=5), "sampling"),
    (dict(policy="random"), "'random' policy draws"),
    (dict(policy="confidence", cfg_scale=1.5), "classifier-free guidance"),
], ids=["sampling", "top-p-top-k", "random", "cfg"])
def test_what_cannot_compile_warns_and_runs_eager(llada, kw, why):
    prompts = random_prompts(llada)
    want, want_stats = tracelock.fused_generate(llada, prompts, gen_length=G, block=4, seed=3, **kw)
    with pytest.warns(UserWarning, match=f"compile=True: .*{why}.*decoding with the eager loop instead"):
        got, stats = tracelock.fused_generate(llada, prompts, gen_length=G, block=4, seed=3, compile=True, **kw)
    assert torch.equal(got, want) and stats.steps == want_stats.steps


def test_an_observer_runs_eager_with_a_warning(llada):
    seen = []
    with pytest.warns(UserWarning, match="an observer reads every step"):
        tracelock.fused_generate(llada, random_prompts(llada)[:1], policy="confidence", gen_length=G, block=4,
                                 compile=True, observer=seen.append)
    assert len(seen) == G


def test_environment_switch(llada, monkeypatch):
    prompts = random_prompts(llada)[:1]
    # test_inductor_blocks_dual_cache's setting and prompt: its engine (and graphs) are reused, nothing compiles
    kw = dict(policy="threshold", policy_args={"tau": 0.7}, gen_length=G, block=4, cache="dual")
    calls = []
    real = compiled.generate_compiled
    monkeypatch.setattr("tracelock.generate.generate_compiled", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("TRACELOCK_COMPILE", "1")
    on = tracelock.fused_generate(llada, prompts, **kw)
    assert calls == [1]
    assert torch.equal(tracelock.fused_generate(llada, prompts, compile=False, **kw)[0], on[0]) and calls == [1]
    monkeypatch.setenv("TRACELOCK_COMPILE", "0")
    tracelock.fused_generate(llada, prompts, **kw)
    assert calls == [1]
    monkeypatch.setenv("TRACELOCK_COMPILE", "maybe")
    with pytest.raises(ValueError, match="TRACELOCK_COMPILE='maybe': use 1"):
        tracelock.fused_generate(llada, prompts, **kw)
    with pytest.raises(TypeError, match="compile='yes' must be True, False, 'cudagraphs' or None"):
        tracelock.fused_generate(llada, prompts, compile="yes", **kw)
    with pytest.raises(ValueError, match="never compiles"):
        tracelock.reference_generate(llada, prompts, compile=True, **kw)
