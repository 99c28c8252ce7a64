"""A LLaDA or Dream model loaded with transformers (the modelling code of the Fast-dLLM checkout staged beside the
repository, LLaDA's and Dream's own classes as real `PreTrainedModel`s; skipped without it) decodes through
`fused_generate` / `load_model` as the backbone loaded from the checkpoint does, sharing its tensors where the layout
allows; the raw errors of a name, a list mask and a dtype name are gone."""

import importlib.util
import json
import subprocess
import sys
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
def peers():
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder, why = module.find_fastdllm(None)
    if folder is None:
        pytest.skip(why)
    return module, folder


def _prompt(name):
    tok = tracelock.load_tokenizer(name)
    return tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(("name", "folder", "loader", "settings"), [
    ("testbed", "model", "load_llada", dict(policy="threshold", policy_args={"tau": 0.9}, gen_length=32, block=16)),
    ("testbed-dream", "model-dream", "load_dream", dict(policy="entropy", policy_args={"steps": 32}, gen_length=32)),
])
def test_a_transformers_module_decodes_as_the_loaded_backbone(peers, name, folder, loader, settings):
    module, checkout = peers
    model = tracelock.load_model(name)
    config = json.loads((ROOT / "tracelock" / "testbed" / folder / "config.json").read_text())
    hf = getattr(module, loader)(checkout, model, config)  # transformers' PreTrainedModel, its own modelling code
    assert isinstance(hf, __import__("transformers").PreTrainedModel)
    ids = _prompt(name)
    want, stats = tracelock.fused_generate(model, [ids], **settings)
    got, got_stats = tracelock.fused_generate(hf, [ids], **settings)
    assert torch.equal(got, want) and got_stats.steps == stats.steps
    ref, _ = tracelock.reference_generate(hf, [ids], **settings)
    assert torch.equal(ref, want)
    backbone = tracelock.load_model(hf)
    hf_embed = hf.get_input_embeddings().weight
    assert backbone.embed.weight.data_ptr() == hf_embed.data_ptr()  # shared, not copied
    # the module's own forward and the backbone's agree on the logits
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = hf(x).logits
        ours = backbone.predict(x, torch.arange(x.shape[1])[None]).logits
    if backbone.spec.logit_shift:  # Dream: row j is the output of position j - 1 (the sampler's shift)
        theirs = torch.cat([theirs[:, :1], theirs[:, :-1]], dim=1)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_bare_base_model_is_refused_naming_the_class_to_load(peers):
    module, checkout = peers
    model = tracelock.load_model("testbed")
    config = json.loads((ROOT / "tracelock" / "testbed" / "model" / "config.json").read_text())
    hf = module.load_llada(checkout, model, config)
    with pytest.raises(tracelock.models.CheckpointError, match="pass the whole language model"):
        tracelock.load_model(hf.model)


def test_the_raw_errors_are_clear_ones():
    model = tracelock.load_model("testbed")
    with pytest.raises(TypeError, match=r"load it first, model = tracelock.load_model\('testbed'\)"):
        tracelock.fused_generate("testbed", [[5, 6, 7]], policy="confidence", gen_length=8)
    tokens, _ = tracelock.fused_generate(model, torch.tensor([[5, 6, 7], [1, 5, 6]]), attention_mask=[[1, 1, 1],
                                                                                                    [0, 1, 1]],
                                         policy="confidence", gen_length=8)
    alone, _ = tracelock.fused_generate(model, [[5, 6]], policy="confidence", gen_length=8)
    assert torch.equal(tokens[1, 1:], alone[0])
    assert tracelock.load_model("testbed", dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="did you mean 'fp32'"):
        tracelock.load_model("testbed", dtype="bf32")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_transformers_opens_a_tiny_checkpoint_folder(tmp_path, family):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    folder = tracelock.write_tiny_checkpoint(tmp_path / family, family=family)
    # the class the config's auto_map names, from the folder (what AutoModel does with trust_remote_code=True; here
    # without AutoModel's registry, which the peers' modules loaded in this process fill with their own "llada")
    auto = json.loads((folder / "config.json").read_text())["auto_map"]["AutoModel"]
    hf = get_class_from_dynamic_module(auto, str(folder)).from_pretrained(folder, dtype=torch.float32)
    model = tracelock.load_model(folder)
    x = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, ours = hf(x).logits, model.predict(x, torch.arange(12).expand(2, 12)).logits
    if model.spec.logit_shift:
        theirs = torch.cat([theirs[:, :1], theirs[:, :-1]], dim=1)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    want, _ = tracelock.fused_generate(model, [[5, 6, 7, 8]], policy="confidence", gen_length=16, block=8)
    got, _ = tracelock.fused_generate(hf, [[5, 6, 7, 8]], policy="confidence", gen_length=16, block=8)
    assert torch.equal(got, want)


def test_automodel_opens_tiny_checkpoints_as_written(tmp_path):
    """The literal call, in a fresh process: ``AutoModel.from_pretrained(folder, trust_remote_code=True)``."""
    code = ("import sys, torch, tracelock\n"
            "from transformers import AutoModel\n"
            "for family in ('llada', 'dream'):\n"
            "    folder = tracelock.write_tiny_checkpoint(sys.argv[1] + '/' + family, family=family)\n"
            "    hf = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)\n"
            "    print(type(hf).__name__, tracelock.load_model(hf).spec.family)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["LLaDAModelLM", "llada", "DreamModel", "dream"]
