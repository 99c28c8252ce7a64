"""Property-based fuzzing of the public decoding API (`fused_generate`, `generate_many`) on a tiny random checkpoint:
generated ids (lists, ragged lists, tensors of every dtype and rank, out-of-vocabulary and mask ids), attention
masks, generation lengths, schedules, policy names and arguments, sampling, KV-cache modes and op backends, well
formed or not. Every call either decodes (and its output is sane: the prompts kept, every generated position filled
with a token of the vocabulary, one stats row per prompt) or is rejected by a clear error naming the argument."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tracelock
from tracelock.policy_specs import POLICY_NAMES

_spec = importlib.util.spec_from_file_location("fuzzing", Path(__file__).with_name("fuzzing.py"))
fuzzing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzzing)
assert_clear, fuzz_settings, bounded = fuzzing.assert_clear, fuzzing.fuzz_settings, fuzzing.bounded

pytestmark = pytest.mark.usefixtures("one_thread")

ARGUMENTS = ("input_ids", "prompts", "policy", "policy_args", "gen_length", "block", "window", "attention_mask",
             "temperature", "cfg_scale", "stop_at_eot", "idle_steps", "seed", "cache", "refresh_every",
             "refresh_shift", "impl", "compile", "batch_size", "model", "prompt", "tokens")
WEIRD = st.one_of(st.none(), st.booleans(), st.text(max_size=6), st.floats(allow_nan=True, allow_infinity=True),
                  st.integers(-(2 ** 70), 2 ** 70), st.lists(st.integers(-3, 3), max_size=3))


def small_int(lo=-3, hi=40):
    return st.integers(lo, hi)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tracelock.load_model(tracelock.write_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "m",
                                                                family="llada"))


def token_ids(vocab: int, mask_id: int):
    """A token id: in the vocabulary mostly; now and then outside it, the mask id, or not an int at all."""
    return st.one_of(st.integers(0, vocab - 1), st.integers(0, vocab - 1), st.integers(0, vocab - 1),
                     st.sampled_from([-1, vocab, mask_id, 2 ** 63 - 1]), st.floats(0, vocab), st.booleans())


@st.composite
def input_ids(draw, vocab: int, mask_id: int):
    """A batch of prompts in one of the forms a caller might pass."""
    ids = token_ids(vocab, mask_id)
    form = draw(st.sampled_from(["lists", "lists", "ragged", "flat", "tensor", "tensor", "odd"]))
    if form in ("lists", "ragged"):
        rows = draw(st.integers(0, 3))
        length = draw(st.integers(0, 6))
        return [draw(st.lists(ids, min_size=length if form == "lists" else 0, max_size=length if form == "lists"
                              else 8)) for _ in range(rows)]
    if form == "flat":
        return draw(st.lists(ids, max_size=5))
    if form == "tensor":
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
        dtype = draw(st.sampled_from([torch.int64, torch.int64, torch.int32, torch.uint8, torch.float32,
                                      torch.bool]))
        values = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
        if draw(st.booleans()) and values.numel():
            values.view(-1)[0] = draw(st.sampled_from([-1, vocab, mask_id]))
        return values.to(dtype)
    return draw(st.one_of(st.none(), st.text(max_size=8), st.integers(), st.lists(st.lists(st.lists(ids, max_size=2),
                                                                                          max_size=2), max_size=2)))


def policy_args():
    keys = st.sampled_from(["tau", "k", "eps", "alpha", "threshold", "first_token", "factor", "controller",
                            "filters", "temperature", "bogus", "schedule"])
    values = st.one_of(st.floats(-2, 2), st.integers(-2, 8), WEIRD)
    return st.one_of(st.none(), st.dictionaries(keys, values, max_size=3), WEIRD)


def decode_kwargs(vocab: int, mask_id: int):
    """`fused_generate`'s keyword arguments: most of them sensible, each now and then not."""
    def maybe(valid):
        return st.one_of(st.none(), valid, valid, WEIRD)

    return st.fixed_dictionaries({
        "policy": st.one_of(st.sampled_from(POLICY_NAMES), st.sampled_from(["confidence", "threshold"]),
                            st.sampled_from(["", "Confidence", "oracle", "nope"]), WEIRD),
        "policy_args": policy_args(),
        "gen_length": st.one_of(st.sampled_from([4, 8, 16]), small_int(-2, 24), WEIRD),
    }, optional={
        "block": maybe(small_int(-1, 17)),
        "window": maybe(small_int(-1, 17)),
        "attention_mask": st.one_of(st.none(), st.lists(st.lists(st.booleans(), max_size=6), max_size=3), WEIRD),
        "temperature": maybe(st.floats(0, 2)),
        "cfg_scale": maybe(st.floats(0, 3)),
        "stop_at_eot": maybe(st.booleans()),
        "idle_steps": maybe(st.booleans()),
        "seed": maybe(st.integers(-5, 2 ** 40)),
        "cache": maybe(st.sampled_from(["prefix", "dual"])),
        "refresh_every": maybe(small_int(-1, 9)),
        "refresh_shift": maybe(small_int(-1, 9)),
        "impl": maybe(st.sampled_from(["torch", "cpp", "triton", "auto"])),
        "compile": st.sampled_from([None, False, "bogus", 2]),  # True compiles for tens of seconds: not fuzzed
    })


def names_of(kwargs: dict) -> set:
    """The argument names a message may blame: the arguments, and the policy's own argument keys."""
    keys = set(kwargs.get("policy_args") or {}) if isinstance(kwargs.get("policy_args"), dict) else set()
    return {*ARGUMENTS, *map(str, keys)}


def check_output(model, prompts, kwargs, tokens, stats) -> None:
    """A decode that was accepted: one row per prompt, the prompt kept (left-padded), every generated position a
    token of the vocabulary, never the mask."""
    spec = model.spec
    G = kwargs["gen_length"]
    assert tokens.dtype == torch.long and tokens.dim() == 2 and tokens.shape[0] == len(prompts)
    assert len(stats.steps) == len(prompts)
    for row, prompt in zip(tokens, prompts):
        prompt = [int(t) for t in prompt]
        P = tokens.shape[1] - G
        assert row[P - len(prompt):P].tolist() == prompt
        generated = row[P:]
        assert bool(((generated >= 0) & (generated < spec.vocab_size)).all())
        assert not bool((generated == spec.mask_id).any()), "a generated position left masked"


@fuzz_settings(ci=100)
@given(data=st.data())
def test_fused_generate_decodes_or_names_the_argument(tiny, data):
    spec = tiny.spec
    ids = data.draw(input_ids(spec.vocab_size, spec.mask_id), label="input_ids")
    kwargs = data.draw(decode_kwargs(spec.vocab_size, spec.mask_id), label="kwargs")
    try:
        tokens, stats = bounded(lambda: tracelock.fused_generate(tiny, ids, **kwargs), 120, "fused_generate")
    except Exception as err:
        assert_clear(err, names_of(kwargs))
        return
    if isinstance(ids, torch.Tensor):  # [B, P], or 1-D: one prompt
        prompts = ids.tolist() if ids.dim() == 2 else [ids.tolist()]
    else:
        prompts = ids
    if isinstance(kwargs.get("attention_mask"), torch.Tensor):  # a padded tensor batch: the kept tokens only
        return
    check_output(tiny, prompts, kwargs, tokens, stats)
    temperature = kwargs.get("temperature") or 0
    cfg = kwargs.get("cfg_scale") or 0
    assert math.isfinite(temperature) and math.isfinite(cfg), "a non-finite temperature or cfg_scale decoded"


@fuzz_settings(ci=40)
@given(data=st.data())
def test_generate_many_decodes_or_names_the_argument(tiny, data):
    spec = tiny.spec
    ids = data.draw(input_ids(spec.vocab_size, spec.mask_id), label="prompts")
    batch_size = data.draw(st.one_of(st.integers(-1, 4), WEIRD), label="batch_size")
    kwargs = data.draw(decode_kwargs(spec.vocab_size, spec.mask_id), label="kwargs")
    kwargs.pop("attention_mask", None)  # generate_many pads its own batches
    try:
        rows, stats = bounded(lambda: tracelock.generate_many(tiny, ids, batch_size=batch_size, **kwargs), 120,
                              "generate_many")
    except Exception as err:
        assert_clear(err, names_of(kwargs))
        return
    assert len(rows) == len(ids)
    for prompt, (generated, _) in zip(ids, rows):
        assert len(generated) == kwargs["gen_length"] and all(0 <= t < spec.vocab_size for t in generated)
        assert spec.mask_id not in generated, f"a generated position left masked for prompt {prompt}"
