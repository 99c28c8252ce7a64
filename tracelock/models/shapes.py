"""Random-weight backbones at the released models' shapes, for timing without the weights.

The configs are LLaDA-8B-Instruct's and Dream-v0-Instruct-7B's (their released config.json), with their special-token
ids; ``layers`` keeps only the first layers (at least three, the layers TraceLock's taps read: a CPU-sized slice).
The weights are random, so the tokens mean nothing: use these for speed, never for quality.

Examples::

    model = random_backbone("llada-8b", device="cuda", dtype=torch.bfloat16)
    model = random_backbone("dream-7b", layers=3)   # CPU-sized slice
"""

import dataclasses
import math

import torch

from tracelock.models.backbone import DiffusionBackbone
from tracelock.models.spec import ModelSpec
from tracelock.models.tiny import dream_config, llada_config

# name: (family, (d_model, heads, kv heads, layers, mlp), vocab rows, max positions, special ids)
SHAPES = {
    "llada-8b": ("llada", (4096, 32, 32, 32, 12288), 126464, 4096,
                 dict(mask_token=126336, eos_token=126081, pad_token=126081, bos_token=126080, eot_token=126348)),
    "dream-7b": ("dream", (3584, 28, 4, 28, 18944), 152064, 131072,
                 dict(mask_token=151666, eos_token=151643, pad_token=151643, bos_token=151643, eot_token=151645)),
}


def shape_spec(name: str, layers: int | None = None) -> ModelSpec:
    """The `ModelSpec` of a released shape (``SHAPES``), with only its first ``layers`` layers when given."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    family, sizes, vocab, max_pos, ids = SHAPES[name]
    if layers is not None and not (isinstance(layers, int) and 3 <= layers <= sizes[3]):
        raise ValueError(f"layers={layers!r} must be an int in [3, {sizes[3]}] ({name} has {sizes[3]} layers; "
                         "TraceLock's taps read the last three)")
    make = llada_config if family == "llada" else dream_config
    spec = ModelSpec.from_config(make(*sizes, ids, vocab_rows=vocab, max_positions=max_pos))
    # without a tokenizer folder the end-of-turn and BOS ids come from the table above
    return dataclasses.replace(spec, eot_id=ids["eot_token"], bos_id=ids["bos_token"],
                               num_layers=layers or spec.num_layers)


def random_backbone(name: str, *, layers: int | None = None, device="cpu", dtype=torch.bfloat16,
                    seed: int = 0) -> DiffusionBackbone:
    """A frozen `DiffusionBackbone` of shape ``name`` (``SHAPES``) with `random_weights`."""
    return random_weights(shape_spec(name, layers), device=device, dtype=dtype, seed=seed)


def random_weights(spec: ModelSpec, *, device="cpu", dtype=torch.bfloat16, seed: int = 0) -> DiffusionBackbone:
    """A frozen `DiffusionBackbone` of ``spec`` with random weights, built directly on ``device`` in ``dtype``.

    Matrices are N(0, 1/fan_in) (activations stay O(1) through the layers), embeddings N(0, 1), norm weights
    1 + N(0, 0.01), biases N(0, 0.01): the logits are spread, as a trained model's are not, which is all a
    timing needs.
    """
    with torch.device("meta"):
        model = DiffusionBackbone(spec)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for key, p in model.released_weights().items():
        x = torch.randn(p.shape, generator=gen, device=device, dtype=dtype)
        if "norm" in key:
            x = x.mul_(0.1).add_(1.0)
        elif key.endswith(".bias"):
            x = x.mul_(0.1)
        elif key != "embed.weight":
            x = x.mul_(1 / math.sqrt(p.shape[1]))
        state[key] = x
    model.load_released(state)
    return model.eval().requires_grad_(False)
