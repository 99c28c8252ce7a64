"""`tracelock.llada.generate`: LLaDA's generate for ported scripts, token for token LLaDA's reference (Fast-dLLM's
``generate`` without a threshold, which is LLaDA's, loaded from its checkout at run time; skipped without it)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import tracelock
from tracelock.llada import generate

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def testbed():
    model, tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    chat = [{"role": "user", "content": "Zoe has 9 books. She finds 4 more books. How many books does Zoe have now?"}]
    ids = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    return model, torch.tensor([ids])


@pytest.fixture(scope="module")
def reference(testbed):
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    folder, why = peers.find_fastdllm(None)
    if folder is None:
        pytest.skip(why)
    config = json.loads((ROOT / "tracelock" / "testbed" / "model" / "config.json").read_text())
    return peers.llada_generate_module(folder), peers.load_llada(folder, testbed[0], config)


@pytest.mark.parametrize(("steps", "gen_length", "block_length"), [(32, 64, 16), (16, 32, 32)])
def test_equals_lladas_generate(testbed, reference, steps, gen_length, block_length):
    model, prompt = testbed
    module, peer = reference
    with torch.no_grad():
        theirs, _ = module.generate(peer, prompt, steps=steps, gen_length=gen_length, block_length=block_length,
                                    temperature=0., remasking="low_confidence", mask_id=model.spec.mask_id)
    ours = generate(model, prompt, steps=steps, gen_length=gen_length, block_length=block_length, temperature=0.,
                    remasking="low_confidence")
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(remasking="lowest"), "'low_confidence' or 'random'"),
    (dict(mask_id=126336), "leave mask_id out"),
    (dict(gen_length=64, block_length=24), "multiple of block_length=24"),
    (dict(steps=30, gen_length=64, block_length=16), "steps=30"),
])
def test_lladas_mistakes_are_named(testbed, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(testbed[0], testbed[1], **kwargs)
