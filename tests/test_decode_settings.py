"""`DecodeSettings`: checked once where it is built, the same run whether passed whole or as keywords, keywords
overriding a given one, and the window cache's default refresh derived, not stored."""

from dataclasses import replace

import pytest
import torch

import tracelock
from tracelock import DecodeSettings
from tracelock.models import write_tiny_checkpoint
from tracelock.testing import random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("settings") / "m", family="llada"))


@pytest.mark.parametrize("fields, message", [
    (dict(temperature=-1), "temperature=-1 must be a finite number >= 0"),
    (dict(cfg_scale=float("inf")), "cfg_scale=inf must be a finite number >= 0"),
    (dict(block=5), "block=5 does not divide gen_length=16"),
    (dict(block=4, window=4), "pass block=4 or window=4, not both"),
    (dict(idle_steps=True), "idle_steps=True .* needs block=N"),
    (dict(cache="both"), "cache='both' must be None, 'prefix' or 'dual'"),
    (dict(window=4, refresh_shift=2), "pass cache='prefix' or cache='dual' with them"),
    (dict(policy_args=["tau", 0.9]), "policy_args must be a dict"),
])
def test_each_bad_value_is_named_where_the_settings_are_built(fields, message):
    with pytest.raises((ValueError, TypeError), match=message):
        DecodeSettings(**dict(dict(policy="threshold", gen_length=16), **fields))


def test_whole_or_as_keywords_is_one_run(tiny):
    prompts = random_prompts(tiny)
    fields = dict(policy="threshold", policy_args={"tau": 0.7}, gen_length=16, window=4, cache="dual")
    settings = DecodeSettings(**fields)
    a, a_stats = tracelock.fused_generate(tiny, prompts, settings)
    b, b_stats = tracelock.fused_generate(tiny, prompts, **fields)
    c, c_stats = tracelock.reference_generate(tiny, prompts, settings)
    assert torch.equal(a, b) and torch.equal(a, c) and a_stats.steps == b_stats.steps == c_stats.steps
    assert a_stats.settings == b_stats.settings and a_stats.settings["refresh_shift"] == 2
    # keywords override a given settings object's fields
    d, d_stats = tracelock.fused_generate(tiny, prompts, settings, window=8)
    assert d_stats.settings["window"] == 8 and d_stats.settings["refresh_shift"] == 4  # that window's default
    out, _ = tracelock.generate_many(tiny, prompts, settings, batch_size=2)
    assert [row for row, _ in out] == a[:, -16:].tolist()


def test_the_default_refresh_is_derived_not_stored():
    settings = DecodeSettings(policy="confidence", gen_length=16, window=4, cache="prefix")
    assert settings.refresh_shift is None and settings.effective_refresh_shift == 2
    assert replace(settings, window=8).effective_refresh_shift == 4
    assert DecodeSettings(policy="confidence", gen_length=16, block=4, cache="prefix").effective_refresh_shift is None


def test_unknown_or_missing_keywords_name_the_fields(tiny):
    prompts = random_prompts(tiny)
    with pytest.raises(TypeError, match="unexpected keyword argument 'polcy'.*did you mean 'policy'"):
        tracelock.fused_generate(tiny, prompts, polcy="threshold", gen_length=16)
    with pytest.raises(TypeError, match=r"fused_generate\(\) needs policy="):
        tracelock.fused_generate(tiny, prompts, gen_length=16)
    with pytest.raises(TypeError, match="settings must be a tracelock.DecodeSettings, got str"):
        tracelock.fused_generate(tiny, prompts, "threshold")
    with pytest.raises(ValueError, match="an engine does not run classifier-free guidance"):
        from tracelock.decode.engine import DecodeEngine

        DecodeEngine(tiny, DecodeSettings(policy="confidence", gen_length=16, cfg_scale=1.0))
