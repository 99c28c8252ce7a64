"""The static-shape slot engine (`tracelock.decode.engine`), uncompiled, on real tiny checkpoints: every slot's row is
`fused_generate` on its prompt alone (tokens, steps, commits per step, refreshes) for every policy, schedule and
cache, batched and under continuous batching (admit between steps, cancel); one host read per step.

``TRACELOCK_TEST_COMPILE_BACKEND=inductor`` (or another torch.compile backend) runs the policy x schedule x cache
matrix on compiled engines instead (slow: a cold inductor compiles several hundred graphs).
"""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tracelock
from tracelock.decode.engine import DecodeEngine, prompt_bucket
from tracelock.decode.runner import row_bucket
from tracelock.policies import Policy
from tracelock.policies.l2p import L2PHiddenPolicy, L2PPolicy
from tracelock.policies.oracle import OraclePolicy
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.testing import (
    assert_same_decode,
    decode_on_engine,
    eos_prone_model,
    fresh_controller,
    random_prompts,
    step_l2p_filter,
)

pytestmark = pytest.mark.usefixtures("one_thread")
G = 16
COMPILE_BACKEND = os.environ.get("TRACELOCK_TEST_COMPILE_BACKEND") or None
SCHEDULES = [({"block": 4}, "block4"), ({"window": 8}, "window8"), ({}, "full")]
CACHES = [None, "prefix", "dual"]


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    return eos_prone_model(tmp_path_factory.mktemp(request.param), request.param, G)


def policies(model) -> list:
    """(label, policy, policy_args): every deterministic policy of the package."""
    controller, encoder = fresh_controller(model)
    out = [("confidence", "confidence", {}), ("topk", "topk", {"k": 2}), ("maskgit_plus", "maskgit_plus", {}),
           ("topk_margin", "topk_margin", {}), ("entropy", "entropy", {}), ("threshold", "threshold", {"tau": 0.7}),
           ("factor", "factor", {"f": 1.0}), ("frechet", "frechet", {"delta": 0.0}),
           ("tracelock", TraceLockPolicy(controller, encoder, theta=0.55), {}),
           ("tracelock-cap", TraceLockPolicy(controller, encoder, theta=0.55, cap=2), {}),
           ("l2p", L2PPolicy(step_l2p_filter(model), filter_block=4), {}),
           # the end-of-text hold of the rules that have one
           ("frechet-hold-end", "frechet", {"delta": -0.2, "hold_end": True}),
           ("factor-hold-end", "factor", {"f": 2.0, "hold_end": True}),
           ("confidence-hold-end", "confidence", {"steps": 8, "hold_end": True}),
           ("l2p-hold-end", L2PPolicy(step_l2p_filter(model), filter_block=4, hold_end=True), {}),
           # the rules since Fast-dLLM; credit, klass and less remember per slot (no window schedule)
           ("hierarchy", "hierarchy", {"tau": 0.7, "low": 0.2}), ("eb", "eb", {"gamma": 0.5}),
           ("pc", "pc", {"background": "testbed"}), ("credit-memory", "credit", {"tau": 0.7}),
           ("klass-memory", "klass", {"tau": 0.5, "kl": 0.05}), ("less-memory", "less", {"tau": 0.5})]
    if model.spec.family == "dream":
        out.append(("threshold-first-token", "threshold", {"tau": 0.7, "first_token": True}))
        out.append(("frechet-first-token", "frechet", {"delta": 0.0, "first_token": True}))
        out.append(("neg-entropy", "confidence", {"score": "neg_entropy"}))
    return out


@pytest.mark.parametrize("cache", CACHES, ids=["nocache", "prefix", "dual"])
def test_every_policy_and_schedule_equals_fused_generate(model, cache):
    """Each row of a batched engine (prompts padded to a bucket, rows finishing at different steps) is
    `fused_generate` on that prompt alone, and the batch is `fused_generate`'s batch."""
    prompts = random_prompts(model)
    for label, policy, args in policies(model):
        for schedule, sname in SCHEDULES:
            if "first-token" in label and "block" not in schedule or "memory" in label and "window" in schedule:
                continue
            kw = dict(policy=policy, policy_args=args, gen_length=G, cache=cache, **schedule)
            rows, engine = decode_on_engine(model, prompts, compile=COMPILE_BACKEND is not None,
                                            backend=COMPILE_BACKEND, **kw)
            batch, batch_stats = tracelock.fused_generate(model, prompts, impl="torch", **kw)
            where = f"{label} {sname} cache={cache}"
            for r, prompt in enumerate(prompts):
                assert_same_decode(rows[r], tracelock.fused_generate(model, [prompt], impl="torch", **kw), where)
                assert torch.equal(rows[r][0][0, -G:], batch[r, -G:]) and rows[r][1].steps == [batch_stats.steps[r]]
            assert engine.forwards == batch_stats.forwards, where


def test_rows_finish_at_different_steps_and_l2p_cuts(model):
    """The fixtures make the matrix above meaningful: batch rows take different step counts, and Learn2PD's
    end-of-text prediction truncates a row (its tail masked) in the engine as in the eager loop."""
    prompts = random_prompts(model)
    rows, _ = decode_on_engine(model, prompts, policy="threshold", policy_args={"tau": 0.7}, gen_length=G, block=4)
    assert len({stats.steps[0] for _, stats in rows}) > 1
    filt = step_l2p_filter(model)
    rows, _ = decode_on_engine(model, prompts, policy=L2PPolicy(filt), gen_length=G, block=4)
    assert min(stats.gen_lengths[0] for _, stats in rows) < G


def test_l2p_hidden_and_raw_taps(model):
    """A policy that reads the raw taps (no tap fold): Learn2PD's hidden-state filter, with and without the cache."""
    from tracelock.features import LinearEncoder, TapEncoder, backbone_fingerprint

    samples = torch.randn(256, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    encoder = TapEncoder(LinearEncoder.fit_pca(samples, 2), LinearEncoder.fit_pca(samples, 1),
                         backbone_fingerprint(model))
    policy = L2PHiddenPolicy(step_l2p_filter(model, features=8), encoder=encoder)
    prompts = random_prompts(model)
    for cache in CACHES:
        kw = dict(policy=policy, gen_length=G, block=4, cache=cache)
        rows, _ = decode_on_engine(model, prompts, **kw)
        for r, prompt in enumerate(prompts):
            assert_same_decode(rows[r], tracelock.fused_generate(model, [prompt], impl="torch", **kw), f"cache={cache}")


@pytest.mark.parametrize("kw", [dict(policy="threshold", policy_args={"tau": 0.7}, block=4, cache="dual"),
                                dict(policy="confidence", window=8, cache="prefix", refresh_every=3),
                                dict(policy="factor", block=8, stop_at_eot=True)],
                         ids=["threshold-dual", "confidence-prefix", "factor-stop-at-eot"])
def test_continuous_batching(model, kw):
    """Two slots, five prompts: each waits for a free slot, joins the running batch between steps and leaves as
    soon as it finishes; every row still equals `fused_generate` on its prompt alone."""
    prompts = random_prompts(model, lengths=(9, 5, 12, 3, 7), seed=3)
    kw = dict(kw, gen_length=G)
    engine = DecodeEngine(model, slots=2, prompt_len=16, **kw)
    waiting, running, results, joined_late = list(range(len(prompts))), {}, {}, False
    while waiting or running:
        while waiting and engine.free_slots():
            i = waiting.pop(0)
            joined_late |= engine._steps > 0
            running[engine.admit(prompts[i])] = i
        assert engine.step()
        for slot in engine.finished_slots():
            results[running.pop(slot)] = engine.result(slot)
            engine.release(slot)
    assert joined_late and not engine.step()
    for i, prompt in enumerate(prompts):
        assert_same_decode(results[i], tracelock.fused_generate(model, [prompt], impl="torch", **kw), f"prompt {i}")


def test_cancel_frees_the_slot_and_spares_the_others(model):
    prompts = random_prompts(model)
    kw = dict(policy="confidence", gen_length=G, block=4, cache="dual")
    engine = DecodeEngine(model, slots=2, prompt_len=16, **kw)
    keep, drop = engine.admit(prompts[0]), engine.admit(prompts[1])
    for _ in range(3):
        engine.step()
    engine.cancel(drop)
    assert engine.free_slots() == [drop] and engine.busy_slots() == [keep]
    late = engine.admit(prompts[2])  # the freed slot takes a new row at once
    while engine.step():
        pass
    assert_same_decode(engine.result(keep), tracelock.fused_generate(model, [prompts[0]], impl="torch", **kw), "kept")
    assert_same_decode(engine.result(late), tracelock.fused_generate(model, [prompts[2]], impl="torch", **kw), "late")


def test_prefix_grows_left_to_right_up_to_the_end_token(model):
    prompt = random_prompts(model)[0]
    engine = DecodeEngine(model, slots=1, prompt_len=16, policy="threshold", policy_args={"tau": 0.7}, gen_length=G,
                          window=4)
    slot = engine.admit(prompt)
    seen = []
    while engine.step():
        seen.append(engine.prefix(slot))
    tokens, stats = engine.result(slot)
    final = tokens[0, len(prompt):].tolist()
    assert len(seen) == stats.steps[0] and all(len(a) <= len(b) for a, b in zip(seen, seen[1:]))
    assert all(final[:len(p)] == p for p in seen)
    assert seen[-1] == final[:stats.gen_lengths[0]]
    assert engine.finished(slot) and engine.finished_slots() == [slot]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cache", CACHES, ids=["nocache", "prefix", "dual"])
def test_one_host_read_per_step(model, cache):
    """A step reads one scalar from the device (the packed row counts) and runs no op whose output size depends on
    the data (nonzero, masked_select, boolean indexing), even while rows finish and the cache refreshes some rows."""
    engine = DecodeEngine(model, slots=3, prompt_len=16, policy="threshold", policy_args={"tau": 0.7}, gen_length=G,
                          window=4, cache=cache)
    for prompt in random_prompts(model):
        engine.admit(prompt)
    steps = 0
    while True:
        with _Ops() as spy:
            ran = engine.step()
        names = [op.split(".")[0] for op in spy.ops]
        reads = [n for n in names if n == "_local_scalar_dense"]
        dynamic = [n for n in names if n in ("nonzero", "masked_select", "unique", "_unique2", "unique_consecutive")]
        assert len(reads) == 1 and not dynamic, (reads, dynamic)
        if not ran:
            break
        steps += 1
    assert steps == int(engine.runner.counters.steps.max())


def test_settings_and_buckets():
    assert [prompt_bucket(n, 64, 4096) for n in (1, 16, 17, 100, 129, 1000, 1025)] == [16, 16, 32, 112, 192, 1024,
                                                                                       1280]
    assert prompt_bucket(420, 64, 500) == 436  # at most what the model allows beside gen_length
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        prompt_bucket(460, 64, 512)
    assert [row_bucket(n, 12) for n in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]


def test_bad_input_names_the_fix(model):
    engine = DecodeEngine(model, slots=1, prompt_len=8, policy="confidence", gen_length=G, block=4)
    with pytest.raises(ValueError, match="prompt bucket is 8; build an engine with prompt_len=prompt_bucket"):
        engine.admit(list(range(1, 10)))
    with pytest.raises(ValueError, match="empty"):
        engine.admit([])
    with pytest.raises(ValueError, match="mask token"):
        engine.admit([1, model.spec.mask_id])
    with pytest.raises(ValueError, match=f"token {model.spec.vocab_size} is outside this model's vocabulary"):
        engine.admit([1, model.spec.vocab_size])
    slot = engine.admit([1, 2])
    with pytest.raises(RuntimeError, match="all 1 slots are busy"):
        engine.admit([1, 2])
    with pytest.raises(RuntimeError, match="slot 0 is busy"):
        engine.admit([1, 2], slot=slot)
    with pytest.raises(ValueError, match=r"slot=3 must be an int in \[0, 1\)"):
        engine.release(3)
    engine.release(slot)
    with pytest.raises(ValueError, match="holds no prompt"):
        engine.result(slot)
    with pytest.raises(ValueError, match="slots=0 must be an int"):
        DecodeEngine(model, slots=0, policy="confidence", gen_length=G)
    with pytest.raises(ValueError, match="block=5 does not divide"):
        DecodeEngine(model, policy="confidence", gen_length=G, block=5)
    with pytest.raises(ValueError, match="exceeds the model's"):
        DecodeEngine(model, policy="confidence", gen_length=G, prompt_len=model.spec.max_positions)
    with pytest.raises(ValueError, match="oracle"):
        DecodeEngine(model, policy=OraclePolicy(torch.zeros(1, 1, dtype=torch.long)), gen_length=G)


class _NeverCommits(Policy):
    name = "never"

    def select(self, inp, generator=None):
        return torch.zeros_like(inp.active)


def test_a_policy_that_never_commits_is_stopped(model):
    kw = dict(policy=_NeverCommits(), gen_length=G, block=4)
    with pytest.raises(RuntimeError, match="left positions uncommitted after"):
        tracelock.fused_generate(model, random_prompts(model)[:1], **kw)
    engine = DecodeEngine(model, prompt_len=16, **kw)
    engine.admit(random_prompts(model)[0])
    with pytest.raises(RuntimeError, match="left positions uncommitted after"):
        while engine.step():
            pass


def test_sampling_runs_uncompiled_and_is_seeded(model):
    prompts = random_prompts(model)
    kw = dict(policy="random", gen_length=G, block=4, temperature=0.8, seed=5)
    with pytest.warns(UserWarning, match="runs its steps uncompiled"):
        first, engine = decode_on_engine(model, prompts, compile=True, **kw)
    assert not engine.compiled
    again, _ = decode_on_engine(model, prompts, **kw)
    other, _ = decode_on_engine(model, prompts, **dict(kw, seed=6))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))
    assert all(not (tokens == model.spec.mask_id).any() for tokens, _ in first)
