"""Trace diagnostics: divergence, Jaccard, acceptance and grids hand-computed on small handmade traces; the
correlation and threshold statistics on handmade controller steps; the controller-step recorder on a real TraceLock
decode (its records obey the commit rule and match the trace), and its file round trip."""

import math

import numpy as np
import pytest
import torch

import tracelock
from tracelock.eval.diagnostics import (
    GRID_DIFFERENT,
    GRID_MASKED,
    GRID_SAME,
    ControllerStepRecorder,
    ControllerSteps,
    cumulative_acceptance,
    divergence_over_items,
    probe_steps,
    read_controller_steps,
    score_confidence_correlation,
    threshold_over_steps,
    trace_divergence,
    trace_grid,
    write_controller_steps,
)
from tracelock.models import write_tiny_checkpoint
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.recording.recorder import TraceRecorder
from tracelock.testing import fresh_controller, random_prompts
from tracelock.traces.trace import Trace

pytestmark = pytest.mark.usefixtures("one_thread")
M, S, D = GRID_MASKED, GRID_SAME, GRID_DIFFERENT


def _trace(item, final, commit_step):
    G = len(final)
    return Trace(prompt=np.array([1, 2], np.int32), final=np.array(final, np.int32),
                 final_state=np.full(G, tracelock.states.LOCKED, np.uint8), commit_step=np.array(commit_step, np.int32),
                 steps=np.array([0], np.int32), proposals=np.full((1, G), -1, np.int32), mask_id=99,
                 num_steps=int(max(commit_step)) + 1, meta={"id": item})


# one position per step (4 steps) against two per step (2 steps); positions 1 and 3 end with different tokens
A = _trace("x", [10, 11, 12, 13], [0, 1, 2, 3])
B = _trace("x", [10, 21, 12, 23], [0, 0, 1, 1])


def test_probe_steps():
    assert probe_steps(4, 1).tolist() == [1, 2, 3, 4]
    assert probe_steps(40, 16).tolist() == [16, 32, 40]
    assert probe_steps(32, 16).tolist() == [16, 32]
    assert probe_steps(5, 16).tolist() == [5]
    with pytest.raises(ValueError, match="every=0 must be a positive int"):
        probe_steps(4, 0)


def test_trace_divergence_by_hand():
    d = trace_divergence(A, B, every=1)
    assert d.step.tolist() == [1, 2, 3, 4]
    # step 1: A committed {0}, B {0, 1}; step 2: A {0, 1}, B all; step 3: A {0, 1, 2}; step 4: both final
    np.testing.assert_allclose(d.mask_sym_diff, [1 / 4, 2 / 4, 1 / 4, 0])
    # both fully committed at step 4: the masked sets' Jaccard is undefined
    np.testing.assert_allclose(d.mask_jaccard, [2 / 3, 0, 0, np.nan])
    np.testing.assert_allclose(d.committed_jaccard, [1 / 2, 2 / 4, 3 / 4, 1])
    np.testing.assert_allclose(d.common_token_diff, [0, 1 / 4, 1 / 4, 2 / 4])
    # every 3 steps: step 3, then the last step 4
    assert trace_divergence(A, B, every=3).step.tolist() == [3, 4]
    # a trace against itself never diverges
    same = trace_divergence(A, A, every=1)
    assert not same.mask_sym_diff.any() and not same.common_token_diff.any()
    np.testing.assert_allclose(same.mask_jaccard, [1, 1, 1, np.nan])


def test_divergence_over_items_by_hand():
    # a second item, decoded identically in one step by both policies
    c = _trace("y", [5, 5, 5, 5], [0, 0, 0, 0])
    d = divergence_over_items([A, c], [c, B], every=2)
    assert d.items == 2 and d.step.tolist() == [2, 4]
    np.testing.assert_allclose(d.mask_sym_diff, [(2 / 4 + 0) / 2, 0])
    # the Jaccard overlaps average over the items that define them: item y is fully committed from step 1 on
    np.testing.assert_allclose(d.mask_jaccard, [0, np.nan])
    np.testing.assert_allclose(d.committed_jaccard, [(2 / 4 + 1) / 2, 1])
    np.testing.assert_allclose(d.common_token_diff, [(1 / 4 + 0) / 2, (2 / 4 + 0) / 2])
    with pytest.raises(ValueError, match="share no item id"):
        divergence_over_items([A], [c])
    other_prompt = _trace("x", [10, 11, 12, 13], [0, 1, 2, 3])
    other_prompt.prompt = np.array([7], np.int32)
    with pytest.raises(ValueError, match="different prompts or generation lengths"):
        trace_divergence(A, other_prompt)


def test_cumulative_acceptance_by_hand():
    steps, frac = cumulative_acceptance([A, B])
    assert steps.tolist() == [0, 1, 2, 3, 4]
    # A: 0, 1/4, 2/4, 3/4, 1; B: 0, 2/4, 1, 1, 1 (finished after 2 steps)
    np.testing.assert_allclose(frac, [0, 3 / 8, 6 / 8, 7 / 8, 1])
    with pytest.raises(ValueError, match="traces is empty"):
        cumulative_acceptance([])


def test_trace_grid_by_hand():
    steps, grid = trace_grid(A, B)
    assert steps.tolist() == [1, 2, 3, 4]
    assert grid.tolist() == [[S, S, S, S],  # committed at step 0 by both, same token
                             [D, D, D, D],  # B commits first, then the tokens differ
                             [M, D, S, S],  # masked in both, then only in A, then the same token
                             [M, D, D, D]]  # masked in both, then only in A, then different tokens
    steps, grid = trace_grid(A, B, every=2)
    assert steps.tolist() == [2, 4] and grid[:, 1].tolist() == [S, D, S, D]


def _handmade_steps(item_ids=("a", "b"), offset=0.0):
    """Step 0: row 0 with three slots and row 1 with one; step 1: row 0 with one slot."""
    return ControllerSteps(
        item_ids=list(item_ids), row=np.array([0, 1, 0], np.int32), step=np.array([0, 0, 1], np.int32),
        tau=np.array([0.0, math.log(3), -math.log(3)], np.float32), num_slots=np.array([3, 1, 1], np.int32),
        position=np.array([0, 1, 2, 0, 1], np.int32), confidence=np.array([0.1, 0.2, 0.3, 0.4, 0.9], np.float32),
        score=np.array([1, 2, 5, 2, 0], np.float32) + offset, chosen=np.array([0, 0, 1, 1, 1], bool), gen_length=4)


def test_correlation_and_threshold_by_hand():
    corr = score_confidence_correlation(_handmade_steps())
    assert corr["step"].tolist() == [0, 1] and corr["slots"].tolist() == [4, 1]
    # step 0 pools both rows: confidence (.1, .2, .3, .4) against score (1, 2, 5, 2); score ranks (1, 2.5, 4, 2.5)
    assert corr["pearson"][0] == pytest.approx(0.3 / math.sqrt(0.05 * 9))
    assert corr["spearman"][0] == pytest.approx(3 / math.sqrt(5 * 4.5))
    # one slot: no correlation
    assert math.isnan(corr["pearson"][1]) and math.isnan(corr["spearman"][1])
    thr = threshold_over_steps(_handmade_steps())
    assert thr["step"].tolist() == [0, 1] and thr["rows"].tolist() == [2, 1]
    # sigmoid(0) = 1/2, sigmoid(log 3) = 3/4, sigmoid(-log 3) = 1/4
    np.testing.assert_allclose(thr["mean"], [0.625, 0.25], rtol=1e-6)
    np.testing.assert_allclose(thr["quantiles"][0, list(thr["q"]).index(0.5)], 0.625, rtol=1e-6)
    with pytest.raises(ValueError, match="quantiles=.* must be a sequence of numbers in"):
        threshold_over_steps(_handmade_steps(), quantiles=(1.5,))


def test_controller_steps_file_round_trip(tmp_path):
    path = tmp_path / "controller_steps.safetensors"
    write_controller_steps(path, [_handmade_steps(), _handmade_steps(("c", "d"), offset=1.0)])
    got = read_controller_steps(path)
    assert got.item_ids == ["a", "b", "c", "d"] and got.gen_length == 4
    assert got.row.tolist() == [0, 1, 0, 2, 3, 2]
    np.testing.assert_array_equal(got.score[5:], _handmade_steps().score + 1.0)
    assert got.chosen.dtype == bool and got.chosen.tolist() == [False, False, True, True, True] * 2
    with pytest.raises(ValueError, match="an item id appears in more than one part"):
        write_controller_steps(path, [_handmade_steps(), _handmade_steps()])
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="bad.safetensors is not a readable safetensors file"):
        read_controller_steps(tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError, match="written by `tracelock eval` for TraceLock policies"):
        read_controller_steps(tmp_path / "missing.safetensors")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("llada"), family="llada", seed=3))


def _policy(model, theta=0.6):
    """A TraceLock policy with a freshly initialised controller on PCA encoders of random samples."""
    controller, enc = fresh_controller(model)
    return TraceLockPolicy(controller, enc, theta=theta)


def test_recorder_on_a_real_tracelock_decode(model, tmp_path):
    G, policy = 16, _policy(model)
    prompts = random_prompts(model, lengths=(9, 5, 12))
    traces_rec = TraceRecorder(model.spec, prompts, G, keep_confidence=True)
    with ControllerStepRecorder(policy, G, item_ids=["p0", "p1", "p2"]) as rec:
        canvas, stats = tracelock.fused_generate(model, prompts, policy=policy, gen_length=G, window=8,
                                                 observer=lambda step: (traces_rec(step), rec(step)))
    # closed: the policy keeps nothing, and decoding without the recorder gives the same tokens
    assert not policy.record_scores and policy.last_scores is None
    plain, plain_stats = tracelock.fused_generate(model, prompts, policy=policy, gen_length=G, window=8)
    assert torch.equal(plain, canvas) and plain_stats.steps == stats.steps
    assert policy.last_scores is None
    traces = traces_rec.traces(canvas)
    cs = rec.steps()
    assert cs.item_ids == ["p0", "p1", "p2"]
    slot_step = cs.slot_steps()
    starts = np.concatenate([[0], np.cumsum(cs.num_slots)])
    cut = math.log(policy.theta / (1 - policy.theta))
    for r, trace in enumerate(traces):
        mine = np.flatnonzero(cs.row == r)
        assert cs.step[mine].tolist() == list(range(stats.steps[r]))
        for k, t in zip(mine, cs.step[mine]):
            sl = slice(starts[k], starts[k + 1])
            pos, chosen, score = cs.position[sl], cs.chosen[sl], cs.score[sl]
            assert np.all(slot_step[sl] == t)
            # the active slots are the masked positions of the window; the chosen ones are committed at step t
            assert set(pos.tolist()) <= set(np.flatnonzero(trace.commit_step >= t).tolist())
            assert sorted(pos[chosen].tolist()) == np.flatnonzero(trace.commit_step == t).tolist()
            assert chosen.sum() == stats.commits_per_step[r][t]
            # the commit rule: sigmoid(a - tau) > theta, or the best slot when none passes
            margin = score.astype(np.float64) - cs.tau[k]
            passes = margin > cut
            want = passes if passes.any() else np.arange(len(margin)) == np.argmax(margin)
            clear = np.abs(margin - cut) > 1e-4
            assert np.array_equal(chosen[clear], want[clear])
            # the confidence the recorder kept is the trace's (fp16 there)
            row = int(np.flatnonzero(trace.steps == t)[0])
            np.testing.assert_allclose(cs.confidence[sl], trace.confidence[row, pos].astype(np.float32), rtol=2e-3)
    # more than one commit in some step: the run exercises the threshold, not only the fallback
    assert cs.chosen.sum() > len(cs.step) and cs.chosen.sum() == G * len(prompts)
    # the per-step correlation equals numpy's on the pooled slots
    corr = score_confidence_correlation(cs)
    for s, p in zip(corr["step"], corr["pearson"]):
        on = slot_step == s
        if on.sum() > 1:
            assert p == pytest.approx(np.corrcoef(cs.confidence[on], cs.score[on])[0, 1], abs=1e-6)
    write_controller_steps(tmp_path / "c.safetensors", rec)
    back = read_controller_steps(tmp_path / "c.safetensors")
    for name in ControllerSteps.STEP_ARRAYS + ControllerSteps.SLOT_ARRAYS:
        np.testing.assert_array_equal(getattr(back, name), getattr(cs, name))


def test_recorder_errors(model):
    with pytest.raises(TypeError, match="policy must be a TraceLockPolicy instance"):
        ControllerStepRecorder(tracelock.policies.make_policy("confidence"), 16)
    policy, other = _policy(model), _policy(model)
    prompts = random_prompts(model, lengths=(6,))
    with ControllerStepRecorder(policy, 16) as rec, pytest.raises(RuntimeError, match="computed no scores"):
        tracelock.fused_generate(model, prompts, policy=other, gen_length=16, window=8, observer=rec)
