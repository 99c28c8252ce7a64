"""Tiny faithful LLaDA / Dream checkpoints, written offline in the released directory format.

Real config key names with every non-size field of the released configs, official tensor names and [out, in]
shapes in bf16, optional sharding with an index, `generation_config.json`, and a toy tokenizer carrying each
family's real special-token strings and chat template (docs/design.md, "Models").
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tracelock.atomic import atomic_write, atomic_write_text
from tracelock.models.tiny_tokenizer import write_tokenizer_files

# (d_model, n_heads, n_kv_heads, n_layers, mlp_hidden) per family and profile
PROFILES = {
    "micro": {"llada": (64, 4, 4, 4, 192), "dream": (112, 7, 1, 4, 592)},
    "kernel": {"llada": (256, 2, 2, 4, 768), "dream": (896, 7, 1, 4, 4736)},
}
# embedding / LM-head rows; the toy tokenizers stop below this, leaving padding rows as in the real checkpoints
VOCAB_ROWS = 512
# both are only read by loaders (RoPE tables, tokenizer truncation); long enough for any CPU generation test
MAX_POSITIONS = 1024


def llada_config(d: int, heads: int, kv: int, layers: int, mlp: int, ids: dict[str, int], *,
                 vocab_rows: int = VOCAB_ROWS, max_positions: int = MAX_POSITIONS) -> dict:
    """A complete LLaDA config.json (every released field) for the given sizes and special-token ids."""
    return {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": d,
        "embedding_dropout": 0.0,
        "embedding_size": vocab_rows,
        "eos_token_id": ids["eos_token"],
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": ids["mask_token"],
        "max_sequence_length": max_positions,
        "mlp_hidden_size": mlp,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": heads,
        "n_kv_heads": kv,
        "n_layers": layers,
        "pad_token_id": ids["pad_token"],
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": vocab_rows,
        "weight_tying": False,
    }


def dream_config(d: int, heads: int, kv: int, layers: int, mlp: int, ids: dict[str, int], *,
                 vocab_rows: int = VOCAB_ROWS, max_positions: int = MAX_POSITIONS) -> dict:
    """A complete Dream config.json (every released field) for the given sizes and special-token ids."""
    return {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": ids["eos_token"],
        "eos_token_id": ids["eos_token"],
        "hidden_act": "silu",
        "hidden_size": d,
        "initializer_range": 0.02,
        "intermediate_size": mlp,
        "mask_token_id": ids["mask_token"],
        "max_position_embeddings": max_positions,
        # the release sets it to its layer count
        "max_window_layers": layers,
        "model_type": "Dream",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "pad_token_id": ids["pad_token"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": vocab_rows,
    }


def generation_config(family: str, ids: dict[str, int]) -> dict:
    if family == "llada":
        return {
            "_from_model_config": True,
            "bos_token_id": ids["bos_token"],
            "eos_token_id": ids["eos_token"],
            "transformers_version": "4.46.3",
        }
    # Dream's config bos/eos/pad are all <|endoftext|>; mask_token_id stays null as released, so the mask id must
    # be read from config.json
    eos = ids["eos_token"]
    return {
        "alg": "origin",
        "alg_temp": None,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "eps": 0.001,
        "mask_token_id": None,
        "output_history": False,
        "pad_token_id": eos,
        "steps": 512,
        "temperature": 0.0,
        "top_k": None,
        "top_p": None,
        "transformers_version": "4.46.2",
    }


def _shapes(family: str, d: int, heads: int, kv: int, layers: int, mlp: int) -> dict[str, tuple[int, ...]]:
    """Official tensor name -> [out, in] shape, in the order the released state dicts list them."""
    hd = d // heads
    if family == "llada":
        p = "model.transformer."
        shapes = {p + "wte.weight": (VOCAB_ROWS, d)}
        for i in range(layers):
            b = f"{p}blocks.{i}."
            shapes |= {
                b + "attn_norm.weight": (d,),
                b + "q_proj.weight": (heads * hd, d),
                b + "k_proj.weight": (kv * hd, d),
                b + "v_proj.weight": (kv * hd, d),
                b + "attn_out.weight": (d, heads * hd),
                b + "ff_norm.weight": (d,),
                b + "ff_proj.weight": (mlp, d),
                b + "up_proj.weight": (mlp, d),
                b + "ff_out.weight": (d, mlp),
            }
        return shapes | {p + "ln_f.weight": (d,), p + "ff_out.weight": (VOCAB_ROWS, d)}
    shapes = {"model.embed_tokens.weight": (VOCAB_ROWS, d)}
    for i in range(layers):
        b = f"model.layers.{i}."
        shapes |= {
            b + "input_layernorm.weight": (d,),
            b + "self_attn.q_proj.weight": (heads * hd, d),
            b + "self_attn.q_proj.bias": (heads * hd,),
            b + "self_attn.k_proj.weight": (kv * hd, d),
            b + "self_attn.k_proj.bias": (kv * hd,),
            b + "self_attn.v_proj.weight": (kv * hd, d),
            b + "self_attn.v_proj.bias": (kv * hd,),
            b + "self_attn.o_proj.weight": (d, heads * hd),
            b + "post_attention_layernorm.weight": (d,),
            b + "mlp.gate_proj.weight": (mlp, d),
            b + "mlp.up_proj.weight": (mlp, d),
            b + "mlp.down_proj.weight": (d, mlp),
        }
    return shapes | {"model.norm.weight": (d,), "lm_head.weight": (VOCAB_ROWS, d)}


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if "norm" in name or name.endswith("ln_f.weight"):
        # non-unit so that a missing weight multiply changes the output
        x = 1.0 + 0.1 * x
    elif name.endswith(".bias"):
        x = 0.1 * x
    elif "wte" not in name and "embed_tokens" not in name:
        # N(0, 1/fan_in) keeps activations O(1) through the layers; the LM heads take this branch too
        x = x / shape[1] ** 0.5
    return x.to(torch.bfloat16).contiguous()


def tiny_state_dict(family: str, profile: str = "micro", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights for a tiny checkpoint, by official key name; deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return {k: _init(k, s, gen) for k, s in _shapes(family, *PROFILES[profile][family]).items()}


def _split(keys: list[str], sizes: list[int], k: int) -> list[list[str]]:
    """Consecutive keys into k non-empty shards of about equal bytes, like the released shard layouts."""
    groups: list[list[str]] = [[] for _ in range(k)]
    total, cum, s = sum(sizes), 0, 0
    for j, (key, size) in enumerate(zip(keys, sizes)):
        left = len(keys) - j
        if groups[s] and s < k - 1 and (cum >= total * (s + 1) / k or left <= k - 1 - s):
            s += 1
        groups[s].append(key)
        cum += size
    return groups


def save_weights(folder: Path, state: dict[str, torch.Tensor], shards: int) -> None:
    # a stale index or shard from an earlier write would be picked up by loaders next to the new files
    for old in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    if not 1 <= shards <= len(state):
        raise ValueError(f"shards must be between 1 and {len(state)}, got {shards}")
    if shards == 1:
        atomic_write(folder / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
        return
    keys = list(state)
    sizes = [state[k].numel() * state[k].element_size() for k in keys]
    weight_map = {}
    for i, group in enumerate(_split(keys, sizes, shards)):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in group}
        atomic_write(folder / name, lambda tmp, part=part: save_file(part, tmp, metadata={"format": "pt"}))
        weight_map |= dict.fromkeys(group, name)
    # sorted by key as in the released indexes (save_pretrained sorts the weight map)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(folder / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")


def write_tiny_checkpoint(
    path: str | Path, *, family: str, profile: str = "micro", seed: int = 0, shards: int = 1
) -> Path:
    """Write a complete tiny HF-style checkpoint folder for LLaDA or Dream, offline.

    Args:
        path (str | Path): output folder; created if missing, existing checkpoint files are overwritten.
        family (str): "llada" or "dream".
        profile (str): "micro" (CPU tests) or "kernel" (head_dim 128, real tile shapes). Default: "micro".
        seed (int): seed of the weights; the config and tokenizer do not depend on it. Default: 0.
        shards (int): 1 writes `model.safetensors`; k > 1 writes k shard files plus
            `model.safetensors.index.json`. Default: 1.

    Returns:
        Path: the folder, holding config.json, generation_config.json, the weights, tokenizer.json,
        tokenizer_config.json, special_tokens_map.json and the modelling files its auto_map names (tracelock's own,
        `tracelock.models.remote_code`), so ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` opens it.
    """
    if family not in ("llada", "dream"):
        raise ValueError(f"family must be 'llada' or 'dream', got {family!r}")
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer_files(folder, family, model_max_length=MAX_POSITIONS)
    # ids beyond the tokenizer are the padding rows; the mask/eos/pad ids must stay inside the tokenizer
    assert max(ids.values()) < VOCAB_ROWS
    sizes = PROFILES[profile][family]
    make_config = llada_config if family == "llada" else dream_config
    atomic_write_text(folder / "config.json", json.dumps(make_config(*sizes, ids), indent=2) + "\n")
    gen_config = generation_config(family, ids)
    atomic_write_text(folder / "generation_config.json", json.dumps(gen_config, indent=2) + "\n")
    save_weights(folder, tiny_state_dict(family, profile, seed), shards)
    # the modelling files the config's auto_map names, so transformers opens the folder (trust_remote_code=True)
    from tracelock.models.remote_code import FILES, FOLDER

    for name in FILES[family]:
        atomic_write_text(folder / name, (FOLDER / name).read_text())
    return folder
