"""Learn2PD (Bao et al., arXiv 2509.25188; BASELINES.md §5): a small learned filter per (backbone, block size)
that accepts a block's proposals from their confidences, trained on "already equals the final token" labels."""

from tracelock.l2p.filter import L2PFilter, load_filter, load_filters

__all__ = ["L2PFilter", "load_filter", "load_filters"]
