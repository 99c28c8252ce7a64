"""Train a Learn2PD filter: full-batch BCE-with-logits and AdamW, as upstream (lr 3e-3, 40,000 epochs, CPU).

The traces are split by trace into train and validation (``val_fraction``); the validation metrics (BCE, accuracy
at 0.5, precision of the accepts at the deployment threshold) go into the filter's JSON with the provenance.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from tracelock.l2p.filter import DEFAULT_THRESHOLD, FilterConfig, L2PFilter

__all__ = ["fit_filter", "split_by_group"]


def split_by_group(groups: torch.Tensor, val_fraction: float, seed: int) -> tuple:
    """(train, val) example indices, whole traces on one side; val is empty when ``val_fraction`` is 0."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction!r} must lie in [0, 1)")
    ids = torch.unique(groups)
    order = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]
    n_val = int(round(val_fraction * len(ids)))
    if n_val >= len(ids):
        raise ValueError(f"val_fraction={val_fraction} leaves no training trace out of {len(ids)}; lower it")
    val = torch.isin(groups, order[:n_val])
    return (~val).nonzero().flatten(), val.nonzero().flatten()


@torch.no_grad()
def _metrics(filt: L2PFilter, x: torch.Tensor, y: torch.Tensor, threshold: float) -> dict:
    logits = filt(x)
    accepted = torch.sigmoid(logits) > threshold
    return dict(bce=float(nn.functional.binary_cross_entropy_with_logits(logits, y)),
                accuracy=float(((logits > 0) == (y > 0.5)).float().mean()),
                accept_rate=float(accepted.float().mean()),
                accept_precision=float(y[accepted].mean()) if accepted.any() else None)


@torch.enable_grad()  # trains whatever the caller's grad mode (inside torch.no_grad() too)
def fit_filter(inputs: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor, *, family: str, eos_id,
               backbone: dict, hidden: int | None = None, epochs: int = 40_000, lr: float = 3e-3,
               val_fraction: float = 0.1, seed: int = 0, log=None) -> L2PFilter:
    """Train one filter on `tracelock.l2p.data.block_examples` output.

    Args:
        inputs, labels, groups: the examples ([N, block] or [N, block, C]; [N, block]; [N]).
        family (str), eos_id (int), backbone (dict): the backbone's, recorded in the filter.
        hidden (int, optional): hidden width. Default: the block size (upstream's size, about 2K parameters at 32).
        epochs (int): full-batch AdamW steps. Default: 40,000 (upstream).
        lr (float): AdamW learning rate. Default: 3e-3 (upstream).
        val_fraction (float): share of traces held out for the metrics. Default: 0.1.
        seed (int): initialisation and split seed. Default: 0.
        log (callable, optional): called with a progress line every hundredth of the epochs.

    Returns:
        L2PFilter: in eval mode, its ``config.train`` holding the settings and the validation metrics.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs={epochs!r} must be a positive int (full-batch steps; upstream uses 40000)")
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be > 0 (upstream uses 3e-3)")
    block = labels.shape[1]
    features = 1 if inputs.dim() == 2 else inputs.shape[2]
    train_idx, val_idx = split_by_group(groups, val_fraction, seed)
    torch.manual_seed(seed)
    cfg = FilterConfig(block=block, hidden=hidden or block, features=features, family=family, eos_id=eos_id,
                       backbone=backbone)
    filt = L2PFilter(cfg)
    opt = torch.optim.AdamW(filt.parameters(), lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    x, y = inputs[train_idx].float(), labels[train_idx].float()
    start = time.perf_counter()
    for epoch in range(epochs):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(filt(x), y)
        loss.backward()
        opt.step()
        if log is not None and (epoch + 1) % max(1, epochs // 100) == 0:
            log(f"epoch {epoch + 1}/{epochs}: train bce {loss.item():.4f}")
    threshold = DEFAULT_THRESHOLD.get(family, 0.9)
    filt.eval()
    cfg.train = dict(epochs=epochs, lr=lr, seed=seed, val_fraction=val_fraction, examples=len(train_idx),
                     val_examples=len(val_idx), seconds=round(time.perf_counter() - start, 2),
                     train_metrics=_metrics(filt, x, y, threshold),
                     val_metrics=_metrics(filt, inputs[val_idx].float(), labels[val_idx].float(), threshold)
                     if len(val_idx) else None)
    return filt.requires_grad_(False)
