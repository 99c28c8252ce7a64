"""Trace recording and the canonical store on tiny random checkpoints: every observed step rebuilds exactly."""

import json

import numpy as np
import pytest

import tracelock
from tracelock import states
from tracelock.models import write_tiny_checkpoint
from tracelock.recording.recorder import TraceRecorder, record
from tracelock.testing import random_prompts
from tracelock.traces.store import (
    CorruptShardError,
    TraceWriter,
    iter_traces,
    load_index,
    store_bytes_per_trace,
    verify,
)
from tracelock.traces.trace import NO_PROPOSAL

G = 16
EOS_BIAS = 3.0  # makes the tiny models propose the end token now and then: EOT states and early stops


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    m = tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param,
                                                   seed=3))

    # raise the eos logit by EOS_BIAS through the LM head's input (the final norm's output): fused_generate
    # scores greedy steps from that input with window_logits_stats and never calls the lm_head module
    w = m.lm_head.weight[m.spec.eos_id].detach()
    shift = EOS_BIAS * w / w.dot(w)

    def favour_eos(module, inputs, normed):
        return normed + shift

    m.norm.register_forward_hook(favour_eos)
    return m


def _decode_observed(model, prompts, **kwargs):
    """Decode with a recorder, keeping a copy of every StepRecord the loop hands out."""
    seen = []
    rec = TraceRecorder(model.spec, prompts, G, **{k: kwargs.pop(k) for k in ("fraction", "keep_confidence")
                                                   if k in kwargs})

    def observer(step):
        seen.append(dict(rows=step.rows.tolist(), step=step.step.tolist(), x=step.x.clone(), state=step.state.clone(),
                         positions=step.positions.clone(), active=step.active.clone(),
                         proposal=step.signals.proposal.clone(), confidence=step.signals.confidence.clone()))
        rec(step)

    canvas, stats = tracelock.fused_generate(model, prompts, policy="confidence", gen_length=G, observer=observer,
                                             **kwargs)
    return rec.traces(canvas, [{"id": f"row{i}"} for i in range(len(prompts))]), seen, canvas, stats


@pytest.mark.parametrize("schedule", [dict(block=8), dict(window=5)], ids=["block8", "window5"])
@pytest.mark.parametrize("stop_at_eot", [False, True], ids=["no-stop", "stop"])
def test_recorder_rebuilds_every_step(model, schedule, stop_at_eot):
    prompts = random_prompts(model)
    traces, seen, canvas, stats = _decode_observed(model, prompts, stop_at_eot=stop_at_eot, fraction=0.5,
                                                   keep_confidence=True, **schedule)
    P = canvas.shape[1] - G
    assert [t.num_steps for t in traces] == stats.steps
    if stop_at_eot:
        assert min(stats.steps) < G, "the end-token bias should stop some row early"
    recorded = {(r, s): None for r, t in enumerate(traces) for s in t.steps.tolist()}
    for rec in seen:
        for i, (r, s) in enumerate(zip(rec["rows"], rec["step"])):
            t = traces[r]
            assert t.prompt.tolist() == prompts[r]
            # the canvas the backbone saw at this step, minus the row's left padding
            row = slice(P - len(prompts[r]), None)
            assert np.array_equal(t.x_at(s), rec["x"][i, row].numpy()), (r, s)
            assert np.array_equal(t.state_at(s), rec["state"][i, row].numpy()), (r, s)
            if (r, s) in recorded:
                k = t.steps.tolist().index(s)
                act = rec["active"][i]
                cols = (rec["positions"][i][act] - P).numpy()
                assert np.array_equal(t.proposals[k, cols], rec["proposal"][i][act].numpy())
                assert (t.proposals[k] != NO_PROPOSAL).sum() == len(cols)
                assert np.array_equal(t.confidence[k, cols], rec["confidence"][i][act].half().numpy())
                recorded.pop((r, s))
    assert not recorded, f"recorded steps that never happened: {list(recorded)}"
    end_ids = list(model.spec.end_ids) + [model.spec.pad_id]
    for r, t in enumerate(traces):
        assert t.steps[0] == 0 and t.steps[-1] == t.num_steps - 1
        assert np.array_equal(t.final, canvas[r, P:].numpy())
        # end and fill tokens are EOT, every other token LOCKED (the loss's eot category)
        assert np.array_equal(t.final_is_eot(), np.isin(t.final, end_ids))
        assert set(t.final_state.tolist()) <= {states.LOCKED, states.EOT}
        assert t.labels().shape == t.proposals.shape


def test_fraction_samples_steps_and_keeps_first_and_last(model):
    prompts = random_prompts(model)
    full = record(model, prompts, gen_length=G, block=8, batch_size=3)
    sampled = record(model, prompts, gen_length=G, block=8, batch_size=3, fraction=0.3, seed=5)
    for f, s in zip(full, sampled):
        assert f.steps.tolist() == list(range(f.num_steps))
        assert 2 <= len(s.steps) < f.num_steps and s.steps[0] == 0 and s.steps[-1] == s.num_steps - 1
        assert np.array_equal(s.proposals, f.proposals[s.steps])
        assert np.array_equal(s.commit_step, f.commit_step) and np.array_equal(s.final, f.final)
    assert [s.steps.tolist() for s in sampled] != [s.steps.tolist() for s in record(
        model, prompts, gen_length=G, block=8, batch_size=3, fraction=0.3, seed=6)]


def test_record_is_batch_invariant(model):
    prompts = random_prompts(model)
    one = record(model, prompts, gen_length=G, window=4, batch_size=1, fraction=0.5)
    three = record(model, prompts, gen_length=G, window=4, batch_size=3, fraction=0.5)
    for a, b in zip(one, three):
        assert np.array_equal(a.steps, b.steps) and np.array_equal(a.proposals, b.proposals)
        assert np.array_equal(a.final, b.final) and np.array_equal(a.commit_step, b.commit_step)
    assert one[0].meta["window"] == 4 and one[0].meta["policy"] == "confidence"


def test_recorder_bad_use_names_the_fix(model):
    with pytest.raises(ValueError, match="fraction=0"):
        TraceRecorder(model.spec, random_prompts(model), G, fraction=0)
    rec = TraceRecorder(model.spec, random_prompts(model), G)
    tracelock.fused_generate(model, random_prompts(model), policy="confidence", gen_length=G, block=8, observer=rec)
    with pytest.raises(RuntimeError, match="one fresh decoding run"):
        tracelock.fused_generate(model, random_prompts(model), policy="confidence", gen_length=G, block=8, observer=rec)


def _traces(model):
    metas = [{"id": f"t:{i}", "task": "unit", "nested": {"k": [1, 2]}, "i": i} for i in range(5)]
    traces = record(model, random_prompts(model, (9, 5, 12, 3, 7)), gen_length=G, block=8, fraction=0.5,
                    keep_confidence=True, batch_size=5, metas=metas)
    traces[1].confidence = None  # mixed shards: some traces without confidences
    return traces


def _assert_same(a, b):
    for name in ("prompt", "final", "final_state", "commit_step", "steps", "proposals"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (a.confidence is None) == (b.confidence is None)
    if a.confidence is not None:
        assert a.confidence.dtype == b.confidence.dtype and np.array_equal(a.confidence, b.confidence, equal_nan=True)
    assert (a.mask_id, a.num_steps) == (b.mask_id, b.num_steps)
    assert json.loads(json.dumps(a.meta)) == b.meta


def test_store_round_trip_is_exact(model, tmp_path):
    traces = _traces(model)
    with TraceWriter(tmp_path, shard_size=2) as writer:
        for t in traces:
            writer.add(t)
    back = list(iter_traces(tmp_path))
    assert len(back) == len(traces)
    for a, b in zip(traces, back):
        _assert_same(a, b)
    assert verify(tmp_path) == dict(shards=3, traces=5, bytes=load_index(tmp_path)["bytes"])
    assert 0 < store_bytes_per_trace(tmp_path) < 2000
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))
    with pytest.raises(ValueError, match="already in the store"):
        TraceWriter(tmp_path, shard_size=2).add(traces[0])


def test_store_detects_corruption_and_names_the_fix(model, tmp_path):
    with TraceWriter(tmp_path, shard_size=3) as writer:
        for t in _traces(model):
            writer.add(t)
    shard = tmp_path / load_index(tmp_path)["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    for read in (verify, lambda d: list(iter_traces(d))):
        with pytest.raises(CorruptShardError, match=f"{shard}.*corrupt.*delete .*re-run"):
            read(tmp_path)
    shard.write_bytes(bytes(data[:len(data) // 2]))
    with pytest.raises(CorruptShardError, match="truncated"):
        verify(tmp_path)
    # a reopened writer refuses a corrupt shard, and drops a deleted one from its record (its items are redone)
    with pytest.raises(CorruptShardError, match=str(shard)):
        TraceWriter(tmp_path, shard_size=3)
    shard.unlink()
    writer = TraceWriter(tmp_path, shard_size=3)
    assert writer.done_ids() == {"t:3", "t:4"}
    writer.close()
    assert [t.meta["id"] for t in iter_traces(tmp_path)] == ["t:3", "t:4"]


def test_store_rejects_bad_traces(model, tmp_path):
    t = _traces(model)[0]
    writer = TraceWriter(tmp_path)
    t.meta.pop("id")
    with pytest.raises(ValueError, match=r'meta\["id"\]'):
        writer.add(t)
    with pytest.raises(ValueError, match="shard_size=0"):
        TraceWriter(tmp_path, shard_size=0)
    with pytest.raises(FileNotFoundError, match="re-run `tracelock collect`"):
        load_index(tmp_path / "nowhere")
