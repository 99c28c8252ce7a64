"""Official checkpoint key names (the released safetensors) -> parameter names of `DiffusionBackbone`."""

from tracelock.models.spec import ModelSpec

_LLADA_BLOCK = {
    "attn_norm.weight": "attn_norm.weight",
    "q_proj.weight": "attn.q_proj.weight",
    "k_proj.weight": "attn.k_proj.weight",
    "v_proj.weight": "attn.v_proj.weight",
    "attn_out.weight": "attn.o_proj.weight",
    "ff_norm.weight": "mlp_norm.weight",
    "ff_proj.weight": "mlp.gate_proj.weight",  # the gate: SiLU is applied to it
    "up_proj.weight": "mlp.up_proj.weight",
    "ff_out.weight": "mlp.down_proj.weight",  # the MLP down projection, not the LM head
}
_DREAM_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.q_proj.bias": "attn.q_proj.bias",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def official_keys(spec: ModelSpec) -> dict:
    """{official checkpoint key: our parameter name} for every tensor the checkpoint must hold."""
    if spec.family == "llada":
        prefix, block, top = "model.transformer.blocks", _LLADA_BLOCK, {
            "model.transformer.wte.weight": "embed.weight",
            "model.transformer.ln_f.weight": "norm.weight",
            "model.transformer.ff_out.weight": "lm_head.weight",  # the untied LM head
        }
    else:
        prefix, block, top = "model.layers", _DREAM_BLOCK, {
            "model.embed_tokens.weight": "embed.weight",
            "model.norm.weight": "norm.weight",
            "lm_head.weight": "lm_head.weight",
        }
    keys = dict(top)
    for i in range(spec.num_layers):
        keys.update({f"{prefix}.{i}.{k}": f"blocks.{i}.{v}" for k, v in block.items()})
    return keys
