"""Smoke tests of `bench/peers_since.py`: the rules published after Fast-dLLM, each run through its own project's code
(dInfer, KLASS, PC-Sampler) on a bundled model, batch 1, greedy, gen 32.

Each runner returns a canvas [1, P + 32] holding the prompt, with no mask left except where the peer's own code
leaves masks: dInfer's block loop stops after the first block holding the eos token (`run_dinfer`), and KLASS's Dream
sampler stops after ``steps`` passes (`run_klass_dream`; none left at steps = gen_length). Each test is skipped, with
the reason and the option to pass, when the peer's checkout (or Fast-dLLM's, whose model classes decode the testbed's
weights) is absent.
"""

import json
from pathlib import Path

import peers  # bench/peers.py (bench/ is on sys.path: conftest.py)
import peers_since
import pytest
import torch

import tracelock
from tracelock.testbed.background import testbed_background

G = 32


def _folder(request, option: str, find):
    folder, why = find(request.config.getoption(option))
    if folder is None:
        pytest.skip(why)
    return folder


@pytest.fixture(scope="session")
def fastdllm(request):
    return _folder(request, "--peer-fastdllm", peers.find_fastdllm)


@pytest.fixture(scope="session")
def dinfer(request):
    return _folder(request, "--peer-dinfer", peers_since.find_dinfer)


@pytest.fixture(scope="session")
def klass(request):
    return _folder(request, "--peer-klass", peers_since.find_klass)


@pytest.fixture(scope="session")
def pcsampler(request):
    return _folder(request, "--peer-pcsampler", peers_since.find_pcsampler)


def _bundled(name: str):
    """A bundled model, its config.json and two chat prompts (the first validation item of math and of code)."""
    from tracelock.eval.tasks import make_task
    from tracelock.text import encode_prompt

    model, tok = tracelock.load_model(name), tracelock.load_tokenizer(name)
    folder = Path(tracelock.__file__).parent / "testbed" / ("model-dream" if name == "testbed-dream" else "model")
    items = [make_task(f"testbed:{task}@validation").items(1)[0] for task in ("math", "code")]
    return model, json.loads((folder / "config.json").read_text()), [encode_prompt(tok, it.prompt) for it in items]


@pytest.fixture(scope="session")
def llada(fastdllm):
    """(tracelock's LLaDA-family testbed, Fast-dLLM's LLaDA on its weights, prompts)."""
    model, config, prompts = _bundled("testbed")
    return model, peers.load_llada(fastdllm, model, config), prompts


@pytest.fixture(scope="session")
def dream(fastdllm):
    """(tracelock's Dream-family testbed, Fast-dLLM's Dream on its weights, prompts)."""
    model, config, prompts = _bundled("testbed-dream")
    return model, peers.load_dream(fastdllm, model, config), prompts


@pytest.fixture(scope="session")
def background():
    return testbed_background("testbed")


def _check(canvas, prompt, spec, forwards, most: int):
    """The canvas' shape and prompt, and 1..most forwards; returns the generated region's mask positions."""
    assert canvas.dtype == torch.long and canvas.shape == (1, len(prompt) + G)
    assert canvas[0, :len(prompt)].tolist() == prompt
    assert isinstance(forwards, int) and 1 <= forwards <= most
    return (canvas[0, len(prompt):] == spec.mask_id).nonzero().flatten().tolist()


@pytest.mark.parametrize("option, find", [("--peer-dinfer", peers_since.find_dinfer),
                                          ("--peer-klass", peers_since.find_klass),
                                          ("--peer-pcsampler", peers_since.find_pcsampler)])
def test_finder_names_the_option(tmp_path, option, find):
    folder, why = find(str(tmp_path))
    assert folder is None and option in why and str(tmp_path) in why


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("decoder", peers_since.DINFER_DECODERS)
def test_dinfer(dinfer, llada, decoder, block):
    """Masks are left only in the blocks after the first that holds the eos token (its loop stops there)."""
    model, peer, prompts = llada
    spec = model.spec
    for prompt in prompts:
        canvas, forwards = peers_since.run_dinfer(dinfer, peer, decoder, prompt, gen_length=G, block=block,
                                                  mask_id=spec.mask_id, eos_id=spec.eos_id)
        left = _check(canvas, prompt, spec, forwards, G + 4 * (G // block))
        blocks = canvas[0, len(prompt):].view(-1, block)
        with_eos = (blocks == spec.eos_id).any(-1).nonzero().flatten().tolist()
        stop = with_eos[0] if with_eos else len(blocks) - 1
        assert all(p // block > stop for p in left), (left, stop)
        assert not (blocks[:stop + 1] == spec.mask_id).any()


def test_klass_llada(klass, llada):
    model, peer, prompts = llada
    for prompt in prompts:
        canvas, used = peers_since.run_klass_llada(klass, peer, prompt, gen_length=G, steps=G, block=16,
                                                   conf_threshold=0.9, kl_threshold=0.01)
        assert _check(canvas, prompt, model.spec, used, G) == []
        assert not (canvas == peers_since.KLASS_MASK).any()


def test_klass_dream(klass, dream):
    """At steps = gen_length no mask is left; with fewer steps masks may be left (one commit per pass at least)."""
    model, peer, prompts = dream
    for prompt in prompts:
        canvas, forwards = peers_since.run_klass_dream(klass, peer, prompt, gen_length=G, steps=G,
                                                       conf_threshold=0.9, kl_threshold=0.001)
        assert _check(canvas, prompt, model.spec, forwards, G) == []
    canvas, forwards = peers_since.run_klass_dream(klass, peer, prompts[0], gen_length=G, steps=G // 4,
                                                   conf_threshold=0.9, kl_threshold=0.001)
    _check(canvas, prompts[0], model.spec, forwards, G // 4)


def test_pc_sampler(pcsampler, llada, background):
    model, peer, prompts = llada
    module = peers_since.pcsampler_module(pcsampler)
    for block in (32, 16):
        for prompt in prompts:
            canvas, forwards = peers_since.run_pc_sampler(pcsampler, peer, prompt, steps=G, gen_length=G, block=block,
                                                          lambd=0.25, alpha=10, background=background)
            assert _check(canvas, prompt, model.spec, forwards, G) == []
            assert forwards == G
            assert module.BASE_LINE is None  # reset for the next table


def test_eb_sampler(pcsampler, llada):
    model, peer, prompts = llada
    for prompt in prompts:
        canvas, forwards = peers_since.run_eb_sampler(pcsampler, peer, prompt, gamma=0.01, gen_length=G)
        assert _check(canvas, prompt, model.spec, forwards, G) == []


@pytest.mark.parametrize("name", ["testbed", "testbed-dream"])
def test_testbed_background(name, background):
    table = background if name == "testbed" else testbed_background(name)
    counts, spec = table["p_baseline_dict"], tracelock.load_model(name).spec
    assert table["num_token"] == sum(counts.values()) > 100_000
    assert all(isinstance(k, int) and 0 <= k < spec.vocab_size and v > 0 for k, v in counts.items())
    assert spec.eot_id in counts and spec.mask_id not in counts
