"""`ModelSpec`: everything decoding needs to know about a checkpoint, read from its folder.

Ids (mask, eos, pad, end-of-turn, bos), sizes and numerics come from ``config.json``,
``generation_config.json`` and the tokenizer files; nothing is hard-coded per checkpoint. What *is*
family knowledge (the config field names, the end-of-turn token string, Dream's logit shift) lives in
``FAMILIES``.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple  # config.json "model_type" values, lower-cased
    architectures: tuple  # config.json "architectures" entries
    logit_shift: int  # output row i predicts token i + shift (Dream keeps the AR alignment of Qwen2.5)
    eot_token: str  # end-of-turn string in the tokenizer
    mask_token: str  # mask string, used when the config has no mask_token_id
    bos_token: str
    fields: dict  # our name -> config.json key
    qkv_bias: bool
    rope_fp32: bool  # True: q/k upcast and rotated in fp32 (LLaDA); False: cos/sin cast to the activation dtype


LLADA = Family(
    name="llada",
    model_types=("llada",),
    architectures=("LLaDAModelLM",),
    logit_shift=0,
    eot_token="<|eot_id|>",
    mask_token="<|mdm_mask|>",
    bos_token="<|startoftext|>",
    fields=dict(hidden_size="d_model", num_layers="n_layers", num_heads="n_heads", num_kv_heads="n_kv_heads",
                intermediate_size="mlp_hidden_size", vocab_size="embedding_size", max_positions="max_sequence_length",
                rope_theta="rope_theta", rms_norm_eps="rms_norm_eps"),
    qkv_bias=False,
    rope_fp32=True,
)
DREAM = Family(
    name="dream",
    model_types=("dream",),
    architectures=("DreamModel",),
    logit_shift=1,
    eot_token="<|im_end|>",
    mask_token="<|mask|>",
    bos_token="<|beginoftext|>",
    fields=dict(hidden_size="hidden_size", num_layers="num_hidden_layers", num_heads="num_attention_heads",
                num_kv_heads="num_key_value_heads", intermediate_size="intermediate_size", vocab_size="vocab_size",
                max_positions="max_position_embeddings", rope_theta="rope_theta", rms_norm_eps="rms_norm_eps"),
    qkv_bias=True,
    rope_fp32=False,
)
FAMILIES = {f.name: f for f in (LLADA, DREAM)}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used as it is; the message names the file and the fix."""


def _read_json(path: Path, *, required: bool):
    if not path.exists():
        if required:
            raise CheckpointError(f"{path} is missing: a checkpoint folder needs config.json (the HF config of "
                                  "LLaDA or Dream); point --model / load_model at the folder that holds it")
        return None
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); re-download or rewrite the file") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a JSON {type(obj).__name__}, not an object; re-download or rewrite it")
    return obj


def _check_sizes(sizes: dict, fields: dict, where) -> None:
    """Every size a positive int (JSON has no other way to spell one), eps and theta positive numbers."""
    for ours, value in sizes.items():
        if ours == "num_kv_heads" and value is None:  # null in some released configs: as many as the heads
            continue
        real = ours in ("rope_theta", "rms_norm_eps")
        ok = isinstance(value, (int, float)) if real else isinstance(value, int)
        if isinstance(value, bool) or not ok or not value > 0:
            kind = "a positive number" if real else "a positive integer"
            raise CheckpointError(f"{where}: {fields[ours]!r} is {value!r}, which must be {kind}; re-download or "
                                  "fix config.json")


def detect_family(config: dict, path="config.json") -> Family:
    model_type = str(config.get("model_type", "")).lower()
    archs = tuple(config.get("architectures") or ())
    for fam in FAMILIES.values():
        if model_type in fam.model_types or any(a in fam.architectures for a in archs):
            return fam
    known = ", ".join(f"{f.name} (model_type {f.model_types[0]!r})" for f in FAMILIES.values())
    raise CheckpointError(f"{path}: unknown model family (model_type={model_type!r}, architectures={list(archs)}); "
                          f"tracelock supports {known}")


def _added_tokens(folder: Path) -> dict:
    """content -> id of the tokenizer's added tokens (tokenizer.json, else tokenizer_config.json)."""
    tok = _read_json(folder / "tokenizer.json", required=False)
    if tok is not None:
        return {t["content"]: int(t["id"]) for t in tok.get("added_tokens", [])}
    cfg = _read_json(folder / "tokenizer_config.json", required=False) or {}
    return {v["content"]: int(k) for k, v in cfg.get("added_tokens_decoder", {}).items()}


@dataclass(frozen=True)
class ModelSpec:
    """What decoding needs to know about a backbone. Build it with :meth:`from_pretrained`."""

    family: str
    mask_id: int
    eos_id: int
    pad_id: int
    eot_id: int | None
    bos_id: int | None
    logit_shift: int
    vocab_size: int  # rows of the embedding and LM head, padding rows included
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    rope_fp32: bool
    chat_template: str | None = None

    @property
    def end_ids(self) -> tuple:
        """Token ids that end an answer: eos and, when the tokenizer has one, end-of-turn."""
        return tuple(dict.fromkeys(i for i in (self.eot_id, self.eos_id) if i is not None))

    def output_rows(self, positions: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """Backbone output rows that predict the tokens at canvas ``positions``.

        This is the one place the Dream shift is applied: row ``j - 1`` predicts token ``j``
        (``cat(logits[:, :1], logits[:, :-1])`` in Dream's sampler), and row 0 predicts itself
        (position 0 is always prompt). LLaDA rows are unshifted. ``first`` [B], the first real position of each
        left-padded row: that position predicts itself too, as position 0 of the row unpadded (its left
        neighbour is padding), so a padded row reads the rows it would read alone.
        """
        rows = positions - self.logit_shift
        return rows.clamp_min(0) if first is None else rows.maximum(first[:, None])

    @classmethod
    def from_pretrained(cls, path) -> "ModelSpec":
        folder = Path(path)
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is not a directory: pass the checkpoint folder (with config.json)")
        config = _read_json(folder / "config.json", required=True)
        return cls.from_config(config, folder)

    @classmethod
    def from_config(cls, config: dict, folder: Path | None = None) -> "ModelSpec":
        where = folder / "config.json" if folder else "config"
        fam = detect_family(config, where)
        sizes = {}
        for ours, key in fam.fields.items():
            if key not in config:
                raise CheckpointError(f"{where}: missing field {key!r} required for a {fam.name} checkpoint; "
                                      "spell out every field (the remote-code defaults differ from the real model)")
            sizes[ours] = config[key]
        _check_sizes(sizes, fam.fields, where)
        gen = (_read_json(folder / "generation_config.json", required=False) or {}) if folder else {}
        added = _added_tokens(folder) if folder else {}
        tok_cfg = (_read_json(folder / "tokenizer_config.json", required=False) or {}) if folder else {}

        mask_id = config.get("mask_token_id", added.get(fam.mask_token))
        eos_id = config.get("eos_token_id", gen.get("eos_token_id"))
        if isinstance(eos_id, list):
            eos_id = eos_id[0]
        pad_id = config.get("pad_token_id", eos_id)
        if mask_id is None or eos_id is None:
            missing = "mask_token_id" if mask_id is None else "eos_token_id"
            raise CheckpointError(f"{where}: no {missing} in config.json (nor the mask string {fam.mask_token!r} "
                                  "in the tokenizer); add it to config.json")
        bos_id = gen.get("bos_token_id", config.get("bos_token_id", added.get(fam.bos_token)))
        num_heads = int(sizes["num_heads"])
        num_kv = config.get(fam.fields["num_kv_heads"]) or num_heads
        if int(sizes["hidden_size"]) % num_heads or num_heads % int(num_kv):
            raise CheckpointError(f"{where}: hidden size {sizes['hidden_size']} / {num_heads} heads / {num_kv} "
                                  "key-value heads do not divide evenly; fix the config's sizes")
        template = tok_cfg.get("chat_template")
        if template is None and folder is not None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(
            family=fam.name, mask_id=int(mask_id), eos_id=int(eos_id), pad_id=int(pad_id),
            eot_id=added.get(fam.eot_token), bos_id=None if bos_id is None else int(bos_id),
            logit_shift=fam.logit_shift, vocab_size=int(sizes["vocab_size"]), hidden_size=int(sizes["hidden_size"]),
            num_layers=int(sizes["num_layers"]), num_heads=num_heads, num_kv_heads=int(num_kv),
            head_dim=int(sizes["hidden_size"]) // num_heads, intermediate_size=int(sizes["intermediate_size"]),
            max_positions=int(sizes["max_positions"]), rope_theta=float(sizes["rope_theta"]),
            rms_norm_eps=float(sizes["rms_norm_eps"]), qkv_bias=fam.qkv_bias, rope_fp32=fam.rope_fp32,
            chat_template=template,
        )
