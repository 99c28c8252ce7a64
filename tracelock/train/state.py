"""Weights and optimiser moments as one flat safetensors dict (``model.<key>``, ``opt.<param index>.<key>``), so a
resumable run saves and restores both without pickling."""

from __future__ import annotations

import torch

__all__ = ["load_training_tensors", "training_tensors"]


def training_tensors(model, opt) -> dict:
    """The flat dict of ``model``'s state and ``opt``'s per-parameter state, on the CPU."""
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        tensors.update({f"opt.{i}.{k}": torch.as_tensor(v).cpu().contiguous() for k, v in st.items()})
    return tensors


def load_training_tensors(tensors: dict, model, opt) -> None:
    """Restore what `training_tensors` wrote into ``model`` and ``opt`` (in place)."""
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    sd = opt.state_dict()
    sd["state"] = {}
    for key, v in tensors.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            sd["state"].setdefault(int(i), {})[name] = v
    opt.load_state_dict(sd)
