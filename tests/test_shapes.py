"""Random-weight backbones at the released shapes: the configs match the released config.json files exactly, the
weights follow the stated init, and bad arguments name the fix."""

import dataclasses

import pytest
import torch

from tracelock.models import DiffusionBackbone, ModelSpec, write_tiny_checkpoint
from tracelock.models.query import Outputs
from tracelock.models.shapes import random_weights, shape_spec


@pytest.mark.parametrize("name,params,eot,mask,kv", [
    ("llada-8b", 8_015_581_184, 126348, 126336, 32),  # parameters of the released safetensors
    ("dream-7b", 7_615_616_512, 151645, 151666, 4),
])
def test_shapes_have_the_released_parameter_counts_and_ids(name, params, eot, mask, kv):
    spec = shape_spec(name)
    with torch.device("meta"):
        model = DiffusionBackbone(spec)
    assert sum(p.numel() for p in model.parameters()) == params
    assert (spec.eot_id, spec.mask_id, spec.num_kv_heads, spec.head_dim) == (eot, mask, kv, 128)
    assert shape_spec(name, layers=3).num_layers == 3


def test_bad_shape_arguments_name_the_fix():
    with pytest.raises(ValueError, match="known shapes: llada-8b, dream-7b"):
        shape_spec("llada-70b")
    with pytest.raises(ValueError, match=r"int in \[3, 28\].*taps read the last three"):
        shape_spec("dream-7b", layers=2)


def test_random_weights_follow_the_init_and_the_seed(tmp_path):
    spec = ModelSpec.from_pretrained(write_tiny_checkpoint(tmp_path, family="dream"))
    model = random_weights(spec, dtype=torch.float32, seed=1)
    params = model.released_weights()  # the released names, views into the fused products
    gate = params["blocks.0.mlp.gate_proj.weight"]
    assert abs(gate.std().item() * gate.shape[1] ** 0.5 - 1) < 0.05  # N(0, 1/fan_in)
    assert abs(params["blocks.0.attn_norm.weight"].mean().item() - 1) < 0.05
    assert abs(params["embed.weight"].std().item() - 1) < 0.05
    assert not any(p.requires_grad for p in model.parameters())
    again, other = random_weights(spec, dtype=torch.float32, seed=1), random_weights(spec, dtype=torch.float32, seed=2)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(other.lm_head.weight, model.lm_head.weight)
    out = model(torch.full((1, 8), spec.mask_id), outputs=Outputs(taps=True))
    assert torch.isfinite(out.logits).all() and len(out.taps) == 3


def test_taps_need_three_layers(tmp_path):
    spec = ModelSpec.from_pretrained(write_tiny_checkpoint(tmp_path, family="llada"))
    model = random_weights(dataclasses.replace(spec, num_layers=2), dtype=torch.float32)
    with pytest.raises(ValueError, match="has 2 layers; use a model with at least 3"):
        model(torch.full((1, 8), spec.mask_id), outputs=Outputs(taps=True))
