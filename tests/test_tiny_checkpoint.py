import json
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tracelock.models.tiny import PROFILES, VOCAB_ROWS, write_tiny_checkpoint
from tracelock.models.tiny_tokenizer import BASE_VOCAB, SPECIAL_TOKENS, UNK_TOKEN, WORDS

FAMILIES = ["llada", "dream"]
CASES = [
    pytest.param("llada", "micro", id="llada-micro"),
    pytest.param("dream", "micro", id="dream-micro"),
    pytest.param("llada", "kernel", id="llada-kernel"),
    pytest.param("dream", "kernel", id="dream-kernel"),
]
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
# every non-size field of the released configs
LLADA_FIXED = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModel": "modeling_llada.LLaDAModelLM",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
    },
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "embedding_dropout": 0.0,
    "flash_attention": False, "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
    "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
    "layer_norm_type": "rms", "layer_norm_with_affine": True, "mlp_ratio": 4, "model_type": "llada",
    "multi_query_attention": None, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
    "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
    "transformers_version": "4.46.3", "use_cache": False, "weight_tying": False,
}  # fmt: skip
DREAM_FIXED = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "hidden_act": "silu", "initializer_range": 0.02, "model_type": "Dream", "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": True, "use_mrope": False,
    "use_sliding_window": False,
}  # fmt: skip
PROMPT = [{"role": "user", "content": "What is 2 + 3 ?"}]
EXPECTED_CHAT = {
    "llada": "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3 ?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "dream": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3 ?"
    "<|im_end|>\n<|im_start|>assistant\n",
}


def _expected_shapes(family, profile):
    d, h, kv, n, f = PROFILES[profile][family]
    hd = d // h
    if family == "llada":
        p = "model.transformer."
        layer = {"attn_norm": (d,), "q_proj": (h * hd, d), "k_proj": (kv * hd, d), "v_proj": (kv * hd, d),
                 "attn_out": (d, h * hd), "ff_norm": (d,), "ff_proj": (f, d), "up_proj": (f, d),
                 "ff_out": (d, f)}  # fmt: skip
        out = {f"{p}blocks.{i}.{k}.weight": s for i in range(n) for k, s in layer.items()}
        return out | {p + "wte.weight": (VOCAB_ROWS, d), p + "ln_f.weight": (d,), p + "ff_out.weight": (VOCAB_ROWS, d)}
    layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
             "self_attn.q_proj.weight": (h * hd, d), "self_attn.q_proj.bias": (h * hd,),
             "self_attn.k_proj.weight": (kv * hd, d), "self_attn.k_proj.bias": (kv * hd,),
             "self_attn.v_proj.weight": (kv * hd, d), "self_attn.v_proj.bias": (kv * hd,),
             "self_attn.o_proj.weight": (d, h * hd), "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
             "mlp.down_proj.weight": (d, f)}  # fmt: skip
    out = {f"model.layers.{i}.{k}": s for i in range(n) for k, s in layer.items()}
    vocab = (VOCAB_ROWS, d)
    return out | {"model.embed_tokens.weight": vocab, "model.norm.weight": (d,), "lm_head.weight": vocab}


def _read_json(folder, name):
    return json.loads((folder / name).read_text())


def _load_sharded(folder):
    index = _read_json(folder, "model.safetensors.index.json")
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        state |= load_file(str(folder / name))
    return index, state


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {fam: write_tiny_checkpoint(root / fam, family=fam) for fam in FAMILIES}


@pytest.fixture(scope="module")
def tokenizers(micro):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        # AutoTokenizer also parses config.json; transformers 5 flags Dream's released `rope_scaling: null` key
        warnings.filterwarnings("ignore", message=".*rope_scaling", category=FutureWarning)
        return {fam: transformers.AutoTokenizer.from_pretrained(str(micro[fam])) for fam in FAMILIES}


@pytest.mark.parametrize("family, profile", CASES)
def test_checkpoint_files_config_and_tensors(tmp_path, family, profile):
    folder = write_tiny_checkpoint(tmp_path, family=family, profile=profile)
    expected_files = {"config.json", "generation_config.json", "model.safetensors"} | TOKENIZER_FILES
    # and the modelling files the auto_map names (transformers opens the folder: tests/test_from_transformers.py)
    modelling = {f"{kind}_{family}.py" for kind in ("configuration", "modeling")}
    assert {p.name for p in folder.iterdir()} == expected_files | modelling

    cfg = _read_json(folder, "config.json")
    d, h, kv, n, f = PROFILES[profile][family]
    if family == "llada":
        sizes = {"d_model": d, "n_heads": h, "n_kv_heads": kv, "n_layers": n, "mlp_hidden_size": f,
                 "vocab_size": VOCAB_ROWS, "embedding_size": VOCAB_ROWS}  # fmt: skip
        fixed, ids = LLADA_FIXED, ("mask_token_id", "eos_token_id", "pad_token_id")
    else:
        sizes = {"hidden_size": d, "num_attention_heads": h, "num_key_value_heads": kv, "num_hidden_layers": n,
                 "max_window_layers": n, "intermediate_size": f, "vocab_size": VOCAB_ROWS}  # fmt: skip
        fixed, ids = DREAM_FIXED, ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")
    max_pos = "max_sequence_length" if family == "llada" else "max_position_embeddings"
    assert set(cfg) == set(fixed) | set(sizes) | set(ids) | {max_pos}
    assert {k: cfg[k] for k in fixed} == fixed
    assert {k: cfg[k] for k in sizes} == sizes
    assert d // h == (128 if profile == "kernel" else 16)
    assert cfg["mask_token_id"] != cfg["eos_token_id"] == cfg["pad_token_id"]
    tokenizer_size = len(BASE_VOCAB) + len(SPECIAL_TOKENS[family])
    assert all(5 < cfg[k] < tokenizer_size < VOCAB_ROWS for k in ids)

    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        assert fh.metadata() == {"format": "pt"}
    state = load_file(str(folder / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == _expected_shapes(family, profile)
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    for key, value in state.items():
        if "norm" in key or "ln_f" in key:
            assert (value != 1).float().mean() > 0.9, key
        if key.endswith(".bias"):
            assert (value != 0).float().mean() > 0.9, key
    emb, head = ("model.transformer.wte.weight", "model.transformer.ff_out.weight")
    if family == "dream":
        emb, head = ("model.embed_tokens.weight", "lm_head.weight")
    assert not torch.equal(state[emb], state[head])


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_config(micro, family):
    cfg = _read_json(micro[family], "config.json")
    gen = _read_json(micro[family], "generation_config.json")
    if family == "llada":
        bos = _read_json(micro[family], "tokenizer.json")["model"]["vocab"]["<|startoftext|>"]
        assert gen == {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": cfg["eos_token_id"],
                       "transformers_version": "4.46.3"}  # fmt: skip
    else:
        eos = cfg["eos_token_id"]
        assert gen == {"alg": "origin", "alg_temp": None, "bos_token_id": eos, "eos_token_id": eos, "eps": 0.001,
                       "mask_token_id": None, "output_history": False, "pad_token_id": eos, "steps": 512,
                       "temperature": 0.0, "top_k": None, "top_p": None, "transformers_version": "4.46.2"}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_seed_determinism(tmp_path, family):
    first = write_tiny_checkpoint(tmp_path / "a", family=family, seed=3)
    again = write_tiny_checkpoint(tmp_path / "b", family=family, seed=3)
    other = write_tiny_checkpoint(tmp_path / "c", family=family, seed=4)
    for name in ["model.safetensors", *TOKENIZER_FILES, "config.json", "generation_config.json"]:
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    state, other_state = load_file(str(first / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert all(not torch.equal(state[k], other_state[k]) for k in state)
    assert (first / "config.json").read_bytes() == (other / "config.json").read_bytes()


@pytest.mark.parametrize("shards", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_matches_single_file(tmp_path, micro, family, shards):
    folder = write_tiny_checkpoint(tmp_path, family=family, shards=shards)
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    assert {p.name for p in folder.glob("*.safetensors")} == set(names)
    assert not (folder / "model.safetensors").exists()
    index, state = _load_sharded(folder)
    assert sorted(set(index["weight_map"].values())) == names
    single = load_file(str(micro[family] / "model.safetensors"))
    # sorted like the released indexes (save_pretrained sorts the weight map)
    assert list(index["weight_map"]) == sorted(single)
    assert set(state) == set(single) and all(torch.equal(state[k], single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in single.values())
    for name in names:
        with safe_open(str(folder / name), "pt") as fh:
            assert fh.metadata() == {"format": "pt"}
            assert all(index["weight_map"][k] == name for k in fh.keys())
    # rewriting as one file removes the stale shards and index
    write_tiny_checkpoint(folder, family=family)
    assert {p.name for p in folder.glob("model[.-]*")} == {"model.safetensors"}


def test_shards_out_of_range(tmp_path):
    with pytest.raises(ValueError, match="shards"):
        write_tiny_checkpoint(tmp_path, family="llada", shards=0)
    with pytest.raises(ValueError, match="family"):
        write_tiny_checkpoint(tmp_path, family="llama")


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_special_ids_and_chat_template(micro, tokenizers, family):
    tok, cfg = tokenizers[family], _read_json(micro[family], "config.json")
    gen = _read_json(micro[family], "generation_config.json")
    assert tok.mask_token_id == cfg["mask_token_id"]
    assert tok.eos_token_id == cfg["eos_token_id"] and tok.pad_token_id == cfg["pad_token_id"]
    if family == "llada":
        assert tok.bos_token == "<|startoftext|>" and tok.bos_token_id == gen["bos_token_id"]
    else:
        assert tok.bos_token == "<|beginoftext|>" and tok.convert_tokens_to_ids("<|endoftext|>") == cfg["bos_token_id"]
    assert len(tok) == len(BASE_VOCAB) + len(SPECIAL_TOKENS[family]) < VOCAB_ROWS

    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED_CHAT[family]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    sid = tok.convert_tokens_to_ids
    nl, user, assistant = sid("\n"), sid("user"), sid("assistant")
    body = [sid(w) for w in ["What", "is", "2", "+", "3", "?"]]
    if family == "llada":
        start, end, eot = sid("<|start_header_id|>"), sid("<|end_header_id|>"), sid("<|eot_id|>")
        expected = [gen["bos_token_id"], start, user, end, nl, nl, *body, eot, start, assistant, end, nl, nl]
    else:
        start, end = sid("<|im_start|>"), sid("<|im_end|>")
        system = [sid(w) for w in ["system", "\n", "You", "are", "a", "helpful", "assistant", "."]]
        expected = [start, *system, end, nl, start, user, nl, *body, end, nl, start, assistant, nl]
    assert ids == expected
    assert tok.unk_token_id not in ids


def test_chat_template_llada_ignores_generation_flag(tokenizers):
    messages = [{"role": "system", "content": "  Be brief. "}, *PROMPT]
    text = tokenizers["llada"].apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == ("<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    + EXPECTED_CHAT["llada"].removeprefix("<|startoftext|>"))  # fmt: skip


def test_chat_template_dream_system_and_no_generation_prompt(tokenizers):
    messages = [{"role": "system", "content": "Be brief."}, *PROMPT]
    text = tokenizers["dream"].apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3 ?<|im_end|>\n"


def test_special_ids_differ_between_families(micro):
    llada, dream = (_read_json(micro[f], "config.json") for f in FAMILIES)
    assert llada["mask_token_id"] != dream["mask_token_id"]
    assert llada["eos_token_id"] != dream["eos_token_id"]


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_text_encoding(micro, tokenizers, family):
    tok, mask = tokenizers[family], _read_json(micro[family], "config.json")["mask_token_id"]
    words = [w for w in WORDS if w not in ("\n", " ")]
    ids = tok(" ".join(words), add_special_tokens=False)["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(w) for w in words]
    code = "def check(x):\n    return x ** 2 + 10\nprint(check(3))  # 19 @ $ ~"
    ids = tok(code, add_special_tokens=False)["input_ids"]
    assert mask not in ids and tok.unk_token_id not in ids
    assert tok.convert_ids_to_tokens(tok("cafe zebra", add_special_tokens=False)["input_ids"]) == [UNK_TOKEN] * 2
    # random tiny models can sample padding rows; decoding them must not raise
    assert isinstance(tok.decode([VOCAB_ROWS - 1, mask, 3]), str)


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_hf_reference_layout(micro, family):
    """The tensors load strictly into the HF parity oracles (`tracelock.testing.hf_reference`)."""
    transformers = pytest.importorskip("transformers")
    cfg = _read_json(micro[family], "config.json")
    state = load_file(str(micro[family] / "model.safetensors"))
    if family == "llada":
        hf_cfg = transformers.LlamaConfig(
            hidden_size=cfg["d_model"], intermediate_size=cfg["mlp_hidden_size"], num_attention_heads=cfg["n_heads"],
            num_key_value_heads=cfg["n_kv_heads"], num_hidden_layers=cfg["n_layers"],
            vocab_size=cfg["embedding_size"], tie_word_embeddings=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(hf_cfg)
        top = {"wte": "model.embed_tokens", "ln_f": "model.norm", "ff_out": "lm_head"}
        block = {"attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm", "q_proj": "self_attn.q_proj",
                 "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj",
                 "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj"}  # fmt: skip
        renamed = {}
        for key, value in state.items():
            # model.transformer.{name}.weight or model.transformer.blocks.{i}.{name}.weight
            parts = key.split(".")
            new = f"model.layers.{parts[3]}.{block[parts[4]]}" if parts[2] == "blocks" else top[parts[2]]
            renamed[new + ".weight"] = value
        state = renamed
    else:
        keys = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                "vocab_size", "tie_word_embeddings"]  # fmt: skip
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{k: cfg[k] for k in keys}))
    model.load_state_dict(state, strict=True)
