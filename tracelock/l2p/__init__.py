"""Learn2PD (Bao et al., arXiv 2509.25188): a small learned filter per (backbone, block size)
that accepts a block's proposals from their confidences, trained on "already equals the final token" labels.

Names load lazily, so `tracelock --help` does not import torch through this package.
"""

import importlib

__all__ = ["L2PFilter", "load_filter", "load_filters"]


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module 'tracelock.l2p' has no attribute {name!r}")
    value = getattr(importlib.import_module("tracelock.l2p.filter"), name)
    globals()[name] = value
    return value
