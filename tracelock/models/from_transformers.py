"""A LLaDA or Dream model already loaded with transformers (the checkpoint's remote code through ``AutoModel``, or any
module that holds the released layout: ``model.transformer.*`` for LLaDA, ``model.layers.*`` and ``lm_head`` for Dream)
as a `DiffusionBackbone`, without reading the checkpoint again.

The backbone shares the module's tensors where its layout is the released one (embedding, norms, output and down
projections, LM head); q/k/v and gate/up are concatenated into its fused products, which copies those. `as_backbone` is
what `fused_generate`, `reference_generate` and `load_model` call: a converted module is kept (weakly) for the next
call, so decoding it again converts nothing.
"""

import weakref
from pathlib import Path

import torch

from tracelock.models.backbone import DiffusionBackbone
from tracelock.models.keys import official_keys
from tracelock.models.spec import CheckpointError, ModelSpec

__all__ = ["as_backbone", "backbone_from_module"]

_CONVERTED = weakref.WeakKeyDictionary()


_WHOLE = ("pass the whole language model as the checkpoint's auto_map loads it (LLaDA: AutoModel / "
          "AutoModelForCausalLM, LLaDAModelLM; Dream: AutoModel, DreamModel), not its base model")


def _spec_of(module) -> ModelSpec:
    config = module.config
    if not hasattr(config, "to_dict"):  # LLaDA's inner LLaDAModel holds OLMo's ModelConfig, not a transformers one
        raise CheckpointError(f"{type(module).__name__} has no transformers config: {_WHOLE}")
    folder = Path(str(getattr(config, "_name_or_path", "") or "."))
    if (folder / "config.json").is_file():  # from_pretrained(folder): the tokenizer's ids and template too
        return ModelSpec.from_pretrained(folder)
    return ModelSpec.from_config(config.to_dict())


def backbone_from_module(module, *, dtype=None, device=None) -> DiffusionBackbone:
    """The `DiffusionBackbone` of a transformers LLaDA / Dream module (see the module docstring); ``dtype`` and
    ``device`` default to the module's (a change of either copies every tensor)."""
    spec = _spec_of(module)
    state = module.state_dict()
    expected = official_keys(spec)
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{type(module).__name__} has no tensor {missing[0]!r} ({len(missing)} missing): "
                              f"{_WHOLE}")
    first = state[next(iter(expected))]
    dtype, device = dtype or first.dtype, torch.device(device) if device is not None else first.device
    with torch.device("meta"):
        model = DiffusionBackbone(spec)
    # .to() returns the tensor itself when nothing changes: shared, not copied
    model.load_released({ours: state[key].to(device=device, dtype=dtype) for key, ours in expected.items()})
    return model.eval().requires_grad_(False)


def as_backbone(model) -> DiffusionBackbone:
    """``model`` itself when it is a `DiffusionBackbone`; a transformers LLaDA / Dream module converted once (kept for
    the next call); anything else is a `TypeError` that says what to pass."""
    if isinstance(model, DiffusionBackbone):
        return model
    if isinstance(model, str | Path):
        raise TypeError(f"model={str(model)!r} is a name or a path, not a loaded model: load it first, model = "
                        f"tracelock.load_model({str(model)!r})")
    if isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model.config, "to_dict"):
        if model not in _CONVERTED:
            _CONVERTED[model] = backbone_from_module(model)
        return _CONVERTED[model]
    raise TypeError(f"model must be a backbone from tracelock.load_model, or a LLaDA / Dream model loaded with "
                    f"transformers; got {type(model).__name__}")
