"""A backbone's weight sample: what fingerprints (`tracelock.features.backbone_fingerprint`) compare to tell two
backbones of the same shape apart. Here, below the features layer, so that quantizing a model
(`tracelock.models.quantize`) can keep the sample of the checkpoint it quantized."""

import torch

# a weight sample of this many values tells two backbones of the same shape apart
WEIGHT_SAMPLE = 64


def weights_sample(model, k: int = WEIGHT_SAMPLE) -> list:
    """``k`` weights at fixed places of the backbone's matrices (norm weights start equal in every model, so they
    are left out), rounded to 5 significant digits so the list survives a JSON round trip unchanged. A quantized
    backbone (`tracelock.models.quantize`) gives the sample of the checkpoint it was quantized from."""
    if k == WEIGHT_SAMPLE and getattr(model, "checkpoint_sample", None) is not None:
        return list(model.checkpoint_sample)
    # the released layout's matrices (q/k/v and gate/up apart, as the checkpoints hold them), so a sample does not
    # depend on how the backbone fuses its products
    weights = model.released_weights() if hasattr(model, "released_weights") else dict(model.named_parameters())
    mats = [p for _, p in sorted(weights.items(), key=lambda kv: kv[0]) if p.dim() >= 2]
    picks = []
    for i in range(k):
        flat = mats[i % len(mats)].detach().reshape(-1)
        picks.append(flat[(i * 2654435761) % flat.numel()])
    return [float(f"{v:.5g}") for v in torch.stack(picks).float().cpu().tolist()]
