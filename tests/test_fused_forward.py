"""The backbone forward running the fused loop's ops: ``head_op`` in place of the LM head,
``tap_op`` in place of the raw taps, both equal to the spec applied to a plain forward's outputs; their errors;
and TraceLock decoding through them (fused == reference, and the fused steps really carry folded taps)."""

import importlib.util
from functools import partial
from pathlib import Path

import pytest
import torch

import tracelock
from tracelock import ops
from tracelock.features import AutoEncoder, LinearEncoder, TapEncoder, backbone_fingerprint
from tracelock.kernels.ref import tap_project_ref, window_logits_stats_ref
from tracelock.models import write_tiny_checkpoint
from tracelock.models.query import Outputs
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.testing import random_prompts

# the test controller lives in test_tracelock_policy.py (--import-mode=importlib: no sibling imports)
_spec = importlib.util.spec_from_file_location("_policy_tests", Path(__file__).with_name("test_tracelock_policy.py"))
_policy_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_policy_tests)
_controller = _policy_tests._controller

pytestmark = pytest.mark.usefixtures("one_thread")

HEAD = partial(ops.window_logits_stats, impl="torch")


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, profile="micro",
                                 seed=3)
    return tracelock.load_model(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def encoder(model):
    """A linear (foldable) encoder of the model's taps."""
    samples = torch.randn(256, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    return TapEncoder(LinearEncoder.fit_pca(samples, 8), LinearEncoder.fit_pca(samples, 4), backbone_fingerprint(model))


def _canvas(model, B=2, L=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.spec.vocab_size, (B, L), generator=g)
    ids[:, L // 2:] = model.spec.mask_id
    return ids


def _fold(model, N=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    D = model.spec.hidden_size
    return torch.randn(3, D, N, generator=g) / D ** 0.5, torch.randn(N, generator=g)


@torch.no_grad()
def test_head_op_equals_the_spec_on_the_lm_heads_input(model):
    ids = _canvas(model)
    rows = torch.tensor([[3, 11, 12, 20], [0, 12, 13, 22]])
    plain = model(ids, outputs=Outputs(positions=rows, logits=False, hidden=True))
    fused = model(ids, outputs=Outputs(positions=rows, head_op=HEAD))
    assert fused.logits is None and fused.hidden is None and fused.taps is None
    want = window_logits_stats_ref(plain.hidden.reshape(8, -1), model.lm_head.weight, model.spec.eos_id)
    assert len(fused.stats) == 5
    for got, ref in zip(fused.stats, want):
        assert got.shape == (2, 4) and torch.equal(got, ref.view(2, 4))
    # the head the op applies is the model's own: its argmax is the logits' argmax
    logits = model(ids, outputs=Outputs(positions=rows)).logits
    assert torch.equal(fused.stats[0], logits.argmax(-1))


@torch.no_grad()
def test_tap_op_equals_the_spec_on_the_taps(model):
    ids = _canvas(model)
    A, c = _fold(model)
    tap_rows = torch.arange(15).expand(2, 15)
    plain = model(ids, outputs=Outputs(logits=False, taps=True, tap_positions=tap_rows))
    fused = model(ids, outputs=Outputs(logits=False, taps=True, tap_positions=tap_rows,
                                       tap_op=lambda h1, h2, h3: ops.tap_project(h1, h2, h3, A, c, impl="torch")))
    assert fused.taps is None and fused.logits is None
    want = tap_project_ref(*(t.reshape(30, -1) for t in plain.taps), A, c).view(2, 15, -1)
    assert fused.tap_inputs.shape == (2, 15, 24) and torch.equal(fused.tap_inputs, want)


@torch.no_grad()
def test_predict_applies_the_shift_to_both_ops(model):
    """What the fused loop calls: predict with both ops equals the spec on predict's hidden and taps (Dream reads
    the row before each position, LLaDA the position itself: predict shifts once, for both)."""
    ids = _canvas(model, seed=2)
    A, c = _fold(model, N=8)
    positions = torch.tensor([[11, 12, 13], [14, 15, 22]])
    tap_rows = torch.arange(18).expand(2, 18)
    plain = model.predict(ids, positions, outputs=Outputs(hidden=True, taps=True, tap_positions=tap_rows))
    fused = model.predict(ids, positions, outputs=Outputs(taps=True, tap_positions=tap_rows, head_op=HEAD,
                                                          tap_op=lambda *h: tap_project_ref(*h, A, c)))
    want = window_logits_stats_ref(plain.hidden.reshape(6, -1), model.lm_head.weight, model.spec.eos_id)
    for got, ref in zip(fused.stats, want):
        assert torch.equal(got, ref.view(2, 3))
    want = tap_project_ref(*(t.reshape(36, -1) for t in plain.taps), A, c).view(2, 18, -1)
    assert torch.equal(fused.tap_inputs, want)
    # the shift is applied: the proposal at position p is the logits' argmax at output row p - shift
    rows = model.spec.output_rows(positions)
    assert model.spec.logit_shift == (1 if model.spec.family == "dream" else 0)
    assert torch.equal(fused.stats[0], model(ids).logits.argmax(-1).gather(1, rows))


def test_bad_op_combinations_name_the_fix(model):
    ids = _canvas(model)
    with pytest.raises(ValueError, match="head_op replaces the LM head.*pass logits=False"):
        model(ids, outputs=Outputs(head_op=HEAD, logits=True))
    with pytest.raises(ValueError, match="head_op replaces the LM head.*hidden=False"):
        model.predict(ids, torch.arange(3).expand(2, 3), outputs=Outputs(head_op=HEAD, hidden=True))
    with pytest.raises(ValueError, match="tap_op folds the three taps.*pass taps=True"):
        model(ids, outputs=Outputs(tap_op=lambda *h: h[0]))


class SeenPolicy(TraceLockPolicy):
    """TraceLock that records, per step, whether it got raw taps or folded tap inputs, and its slot scores."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._seen, self._scores = [], []

    def slot_scores(self, inp):
        self._seen.append((inp.taps is not None, inp.tap_inputs is not None))
        a, tau = super().slot_scores(inp)
        self._scores.append((a, tau))
        return a, tau


def test_fused_decode_folds_the_taps_in_the_forward(model, encoder):
    """fused_generate hands a linear-encoder TraceLock its controller inputs from the forward (never the taps) and
    gives the reference's tokens, step counts and slot scores; reference_generate hands it the taps."""
    ctrl = _controller(model, encoder, confidence_input=True, state_embedding=True)
    prompts = random_prompts(model, lengths=(7, 4))  # left padding in the batch
    kwargs = dict(gen_length=12, window=6)
    ref_policy, fused_policy = (SeenPolicy(ctrl, encoder, theta=0.6) for _ in range(2))
    ref_tokens, ref_stats = tracelock.reference_generate(model, prompts, policy=ref_policy, **kwargs)
    tokens, stats = tracelock.fused_generate(model, prompts, policy=fused_policy, **kwargs)
    assert set(ref_policy._seen) == {(True, False)}
    assert set(fused_policy._seen) == {(False, True)}
    assert torch.equal(tokens, ref_tokens)
    assert stats.steps == ref_stats.steps and stats.commits_per_step == ref_stats.commits_per_step
    assert len(fused_policy._scores) == len(ref_policy._scores) == max(stats.steps)
    for (a, tau), (ref_a, ref_tau) in zip(fused_policy._scores, ref_policy._scores):
        torch.testing.assert_close(a, ref_a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tau, ref_tau, rtol=1e-5, atol=1e-5)


def test_tap_fold_only_for_a_linear_encoder(model, encoder):
    policy = TraceLockPolicy(_controller(model, encoder), encoder)
    A, c = policy.tap_fold(model)
    assert A.shape == (3, model.spec.hidden_size, policy._controller.config.width) and c.shape == (A.shape[2],)
    # a nonlinear encoder cannot fold: no fold, so the fused loop passes the taps themselves
    D = model.spec.hidden_size
    torch.manual_seed(0)
    ae = TapEncoder(AutoEncoder(D, 8, 16), AutoEncoder(D, 4, 16), backbone_fingerprint(model)).eval()
    assert TraceLockPolicy(_controller(model, ae), ae).tap_fold(model) is None


def test_tap_inputs_without_the_fold_name_the_fix(model, encoder):
    step = _policy_tests._step(model)
    B, T = step.taps[0].shape[:2]
    step.taps, step.tap_inputs = None, torch.zeros(B, T, 32)
    with pytest.raises(ValueError, match=r"not this policy's folded taps: fold them with policy.tap_fold\(model\)"):
        TraceLockPolicy(_controller(model, encoder), encoder).select(step)
    step.tap_inputs = None
    with pytest.raises(ValueError, match="needs StepInput.positions, state and either taps or tap_inputs"):
        TraceLockPolicy(_controller(model, encoder), encoder).select(step)
