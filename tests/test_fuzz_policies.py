"""Property-based fuzzing of policy specs (`tracelock eval --policies`, `tracelock serve --policy`): text made of the
grammar's own pieces (policy names, keys, values, separators) and of anything at all. Each spec is parsed, every
policy it names is built and decodes a prompt on a tiny random checkpoint, or the first step that refuses it says
what is wrong with a clear error naming the option or the key."""

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tracelock
from tracelock.eval.runner import build_policy, parse_policies
from tracelock.policy_specs import POLICY_NAMES
from tracelock.serve.config import parse_served_policies

_spec = importlib.util.spec_from_file_location("fuzzing", Path(__file__).with_name("fuzzing.py"))
fuzzing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzzing)

pytestmark = pytest.mark.usefixtures("one_thread")

KEYS = ("tau", "k", "f", "eps", "steps", "first_token", "release_quirk", "theta", "cap", "threshold", "alg_temp",
        "schedule", "cache", "refresh_every", "refresh_shift", "block", "window", "bogus", "",
        # the rules since Fast-dLLM (credit, hierarchy, klass, less, eb, pc)
        "alpha", "gamma", "beta", "low", "kl", "history", "form", "drift", "persist", "lambd", "background",
        "hold_end", "per_step")
VALUES = ("0.9", "1", "0", "-1", "2", "1e9", "nan", "inf", "-inf", "true", "false", "null", "[]", "{}", '"x"',
          "block", "window", "full", "prefix", "dual", "abc", "", "0.5", "16", "3.5",
          "none", "testbed", "llada", "dream", "0.01")
NAMES = (*POLICY_NAMES, "oracle", "nope", "", "Confidence")


@st.composite
def spec_text(draw):
    """A policy spec: mostly the grammar's pieces, joined right or wrong; sometimes any text."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(alphabet=st.sampled_from(list(":,=. -_0123456789abcdefnptu\"[]{}")) | st.characters(),
                            max_size=30))
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        token = draw(st.sampled_from(NAMES))
        for _ in range(draw(st.integers(0, 3))):
            key, value = draw(st.sampled_from(KEYS)), draw(st.sampled_from(VALUES))
            token += draw(st.sampled_from([f":{key}={value}", f":{key}={value}", f":{key}", f"={value}",
                                           f"::{key}={value}"]))
        parts.append(token)
    return draw(st.sampled_from([",", ",", ", ", ",,", ":"])).join(parts)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tracelock.load_model(tracelock.write_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "m",
                                                                family="llada"))


def blame(text: str) -> set:
    """What a message about this spec may name: the option, the policy, or any key written in the spec."""
    keys = {pair.partition("=")[0] for token in text.split(",") for pair in token.split(":")[1:]}
    return {"--policies", "--policy", "policy", "policy_args", "gen_length", "block", "window", "cache",
            "refresh_every", "refresh_shift", "controller", "filters", *(k for k in keys if k)}


@fuzzing.fuzz_settings(ci=60)
@given(text=spec_text())
def test_eval_policy_specs_parse_build_and_decode_or_name_the_key(tiny, text):
    try:
        specs = parse_policies(text)
    except Exception as err:
        fuzzing.assert_clear(err, {"--policies"})
        return
    for spec in specs:
        if spec.name == "oracle":  # it replays another policy's tokens: built by the runner, not here
            continue
        def decode(spec=spec):
            policy = build_policy(spec, tiny)
            schedule = spec.args.get("schedule", "block")
            width = {"block": dict(block=4), "window": dict(window=4), "full": {}}.get(schedule, dict(block=4))
            cache = {k: spec.args[k] for k in ("cache", "refresh_every", "refresh_shift") if k in spec.args}
            return tracelock.fused_generate(tiny, [[5, 6, 7]], policy=policy, gen_length=8, **width, **cache)

        try:
            tokens, _ = fuzzing.bounded(decode, 120, f"policy {text!r}")
        except Exception as err:
            fuzzing.assert_clear(err, blame(text))
            continue
        assert tokens.shape == (1, 11) and tokens[0, :3].tolist() == [5, 6, 7]
        assert not bool((tokens[0, 3:] == tiny.spec.mask_id).any())


@fuzzing.fuzz_settings(ci=200)
@given(text=spec_text(), block=st.sampled_from([None, 16, 0, -4]), window=st.sampled_from([None, 16]),
       cache=st.sampled_from([None, "prefix", "dual"]))
def test_served_policy_specs_parse_or_name_the_key(text, block, window, cache):
    try:
        served = parse_served_policies(text, block=block, window=window, cache=cache)
    except Exception as err:
        fuzzing.assert_clear(err, {"--policy"})
        return
    for policy in served:
        assert policy.width >= 1 and policy.name in POLICY_NAMES
        assert not set(policy.args) & {"block", "window", "cache", "refresh_every", "refresh_shift", "schedule"}
