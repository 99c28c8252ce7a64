"""One commit rule on every path: the shipped controllers with every rule a controller can carry (hold_end x each
fallback, the reference release's inclusive rule), stop_at_eot on and off, decode the reference's tokens, steps and
commits per step in the eager fused loop (closed by `ops.commit_step`: the Triton kernel under TRITON_INTERPRET=1,
which tests/conftest.py sets), the engine and the compiled engine (fp32 CPU)."""

import pytest
import torch

import tracelock
from tracelock import ops
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.testbed import held_out
from tracelock.testing import assert_same_decode, decode_on_engine

pytestmark = pytest.mark.usefixtures("one_thread")

G, WINDOW = 32, 16
# {}: the controller's own rule (the shipped ones carry hold_end and their family's score as fallback)
RULES = [{}] + [dict(hold_end=hold, fallback=fallback) for hold in (False, True)
                for fallback in ("score", "confidence", "neg_entropy")] + [dict(reference_release=True)]


def _label(rule: dict) -> str:
    if not rule:
        return "shipped"
    return "release" if rule.get("reference_release") else f"hold{int(rule['hold_end'])}-{rule['fallback']}"


@pytest.fixture(scope="module", params=["testbed", "testbed-dream"])
def bundled(request):
    """(model, three held-out prompts of different lengths: a batch with left padding)."""
    name = request.param
    model, tok = tracelock.load_model(name), tracelock.load_tokenizer(name)
    examples = held_out("math", "test", 2) + held_out("code", "test", 1)
    return name, model, [tok(e.prompt, add_special_tokens=False)["input_ids"] for e in examples]


@pytest.mark.parametrize("stop_at_eot", [False, True], ids=["no-stop", "stop-at-eot"])
@pytest.mark.parametrize("rule", RULES, ids=_label)
def test_fused_equals_reference_in_every_driver(bundled, rule, stop_at_eot, monkeypatch):
    name, model, prompts = bundled
    policy = TraceLockPolicy(name, model=model, **rule)
    kw = dict(policy=policy, gen_length=G, window=WINDOW, stop_at_eot=stop_at_eot)
    ref, ref_stats = tracelock.reference_generate(model, prompts, **kw)
    calls = []
    real = ops.commit_step
    monkeypatch.setattr(ops, "commit_step", lambda *a, **k: calls.append(k.get("impl")) or real(*a, **k))
    got, stats = tracelock.fused_generate(model, prompts, **kw)
    monkeypatch.undo()
    # every step of the eager fused loop is closed by the commit op, through the dispatcher's default
    assert len(calls) == max(ref_stats.steps)
    assert torch.equal(got, ref)
    assert stats.steps == ref_stats.steps and stats.commits_per_step == ref_stats.commits_per_step
    alone = [tracelock.reference_generate(model, [p], **kw) for p in prompts]
    for compile in (False, True):
        # the compiled engine through dynamo with fullgraph=True and the eager backend (a graph break would raise;
        # tests/test_decode_compiled.py runs inductor)
        extra = dict(compile=True, backend="eager") if compile else {}
        rows, engine = decode_on_engine(model, prompts, **kw, **extra)
        assert engine.compiled == compile
        for r, want in enumerate(alone):
            assert_same_decode(rows[r], want, f"{_label(rule)} row {r} compile={compile}")

