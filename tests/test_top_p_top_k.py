"""``top_p`` and ``top_k`` in the decode step: Dream's sampler (``sample_tokens``: its filters on logits / T, then every
score from the kept tokens), token for token against Dream's own ``_sample`` (the ``generation_utils.py`` staged with
Fast-dLLM's checkout, loaded at run time; skipped without it) on the Dream-family testbed, and the same tokens from
`fused_generate` and `reference_generate`."""

import importlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import tracelock

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", autouse=True)
def _rope_table_restored():
    """Fast-dLLM's Dream code (loaded at run time) puts a "default" RoPE initialiser into transformers' global table,
    which transformers' own Llama / Qwen2 would then call in later tests: the table is put back after this file."""
    import transformers.modeling_rope_utils as rope

    saved = dict(rope.ROPE_INIT_FUNCTIONS)
    yield
    rope.ROPE_INIT_FUNCTIONS.clear()
    rope.ROPE_INIT_FUNCTIONS.update(saved)
ROOT = Path(__file__).resolve().parent.parent
CHAT = [{"role": "user", "content": "Zoe has 9 books. She finds 4 more books. How many books does Zoe have now?"}]


@pytest.fixture(scope="module")
def dream():
    model, tok = tracelock.load_model("testbed-dream"), tracelock.load_tokenizer("testbed-dream")
    ids = tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    return model, ids


@pytest.fixture(scope="module")
def dream_sampler(dream):
    """Dream's own ``DreamGenerationMixin._sample`` bound to Dream's own model on the testbed's weights."""
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    folder, why = peers.find_fastdllm(None)
    if folder is None or not (folder / "dream" / "model" / "generation_utils.py").is_file():
        pytest.skip(why or "no dream/model/generation_utils.py in the Fast-dLLM checkout")
    model, _ = dream
    config = json.loads((ROOT / "tracelock" / "testbed" / "model-dream" / "config.json").read_text())
    peer = peers.load_dream(folder, model, config)
    utils = importlib.import_module("fastdllm_dream.generation_utils")
    return peers, folder, peer, utils


@pytest.mark.parametrize(("alg", "temperature", "top_p", "top_k"), [
    ("entropy", 0.0, 0.95, None),  # Dream's README call: entropy, top_p 0.95 (greedy here)
    ("maskgit_plus", 0.0, 0.5, 3),
    ("entropy", 0.0, 0.8, None),
])
def test_top_p_top_k_equal_dreams_sampler(dream, dream_sampler, alg, temperature, top_p, top_k):
    model, ids = dream
    peers, folder, peer, utils = dream_sampler
    gen = 32
    config = peers.dream_generation_config(folder, model.spec, gen, gen, alg=alg)
    config.top_p, config.top_k, config.alg_temp, config.eps, config.temperature = top_p, top_k, 0.0, 1e-3, temperature
    config.max_length = len(ids) + gen
    torch.manual_seed(0)
    with torch.no_grad():
        theirs = utils.DreamGenerationMixin._sample(peer, torch.tensor([ids]), None, config, lambda i, x, lg: x,
                                                    lambda i, x, lg: lg)
    ours, stats = tracelock.fused_generate(model, [ids], policy=alg, gen_length=gen, temperature=temperature,
                                           policy_args={"steps": gen, "alg_temp": 0.0, "eps": 1e-3}, top_p=top_p,
                                           top_k=top_k, seed=0)
    assert torch.equal(ours, theirs) and stats.steps == [gen]


def test_filtered_sampling_is_the_same_in_fused_and_reference(dream):
    model, ids = dream
    args = dict(policy="maskgit_plus", gen_length=32, policy_args={"steps": 16}, temperature=1.0, top_p=0.9, top_k=5,
                seed=3)
    fused, a = tracelock.fused_generate(model, [ids, ids[3:]], **args)
    ref, b = tracelock.reference_generate(model, [ids, ids[3:]], **args)
    assert torch.equal(fused, ref) and a.steps == b.steps


def test_top_k_one_samples_the_argmax():
    model = tracelock.load_model("testbed")
    tok = tracelock.load_tokenizer("testbed")
    ids = tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    args = dict(policy="confidence", gen_length=32, block=16, top_k=1)
    greedy, _ = tracelock.fused_generate(model, [ids], **args)
    # one token kept: a sample at any temperature is the argmax, at the kept token's probability (1), as greedy's
    sampled, _ = tracelock.fused_generate(model, [ids], temperature=5.0, seed=7, **args)
    assert torch.equal(sampled, greedy)


@pytest.mark.parametrize(("field", "value"), [("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("top_k", 2.5)])
def test_bad_top_p_top_k_name_themselves(field, value):
    with pytest.raises(ValueError, match=field):
        tracelock.DecodeSettings(policy="confidence", gen_length=16, **{field: value})


def test_a_rule_with_memory_refuses_the_filters(dream):
    model, ids = dream
    with pytest.raises(ValueError, match="top_p"):
        tracelock.fused_generate(model, [ids], policy="credit", gen_length=16, top_p=0.9)
