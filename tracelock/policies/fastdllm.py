"""Fast-dLLM v1 parallel rules (NVlabs/Fast-dLLM ``llada/generate.py``): threshold, factor.

Both are schedule-free: every step commits at least the most confident active slot, so a region of
size N ends within N steps. Confidences are this package's fp32 probabilities (upstream: float64).
"""

from __future__ import annotations

import math

import torch

from .base import Policy, StepInput, active_count, active_first_order, first_token_form, held_ends, topk_mask

__all__ = ["FactorPolicy", "ThresholdPolicy"]


class ThresholdPolicy(Policy):
    """Commit every active slot with confidence >= tau, and always the most confident one.

    Args:
        tau (float): threshold in (0, 1]. Default: 0.9 (Fast-dLLM paper default).
        first_token (bool): Fast-dLLM's Dream variant (``dream/model/generation_utils_block.py``, alg
            ``confidence_threshold``): a region's first step, which upstream runs as the cache refresh, commits
            only the region's first masked position, whatever its confidence; the threshold rule runs from the
            second step. Use it with Dream backbones in semi-AR blocks. Default: False (the LLaDA rule).
        hold_end (bool): not Fast-dLLM's: an end-of-text proposal commits only once no active slot left of it
            proposes text (`TraceLockPolicy`'s ``hold_end``, here so its effect can be told from the learned
            controller's: docs/frontier.md). Default: False.
    """

    name = "threshold"
    deterministic = True

    def __init__(self, tau: float = 0.9, first_token: bool = False, hold_end: bool = False) -> None:
        super().__init__()
        if not isinstance(tau, int | float) or not 0 < tau <= 1:
            raise ValueError(f"tau={tau!r} must lie in (0, 1]; Fast-dLLM's default is 0.9")
        if not isinstance(first_token, bool):
            raise TypeError(f"first_token={first_token!r} must be a bool (True: Fast-dLLM's Dream variant)")
        if not isinstance(hold_end, bool):
            raise TypeError(f"hold_end={hold_end!r} must be a bool (True: hold end-of-text behind the text)")
        self.tau = float(tau)
        self.first_token = first_token
        self.hold_end = hold_end

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        conf = inp.signals.confidence
        active = inp.active & ~held_ends(inp) if self.hold_end else inp.active
        top1 = topk_mask(conf, active, torch.ones_like(inp.region_step))
        # upstream drops slot k >= 1 only when conf < threshold, so the boundary commits
        chosen = top1 | (active & (conf >= self.tau))
        return first_token_form(inp, chosen) if self.first_token else chosen


class FactorPolicy(Policy):
    """Fast-dLLM's factor rule: the longest prefix of sorted confidences with c_(n) >= 1 - f/(n+1).

    The first (n = 1) is forced. Upstream (``get_transfer_index_dynamic``) breaks at the first failure
    ``top_i`` and then increments it when ``top_i == N - 1``, so when only the last of N >= 2 fails it
    still commits all N; ``release_quirk=True`` reproduces that bug, the default commits the valid prefix.

    Args:
        f (float): the factor, > 0. Default: 1.0.
        release_quirk (bool): reproduce the upstream N - 1 increment. Default: False.
        hold_end (bool): not Fast-dLLM's: an end-of-text proposal commits only once no active slot left of it
            proposes text (as ``threshold``'s ``hold_end``); the held slots leave the sorted confidences. Default:
            False.
    """

    name = "factor"
    deterministic = True

    def __init__(self, f: float = 1.0, release_quirk: bool = False, hold_end: bool = False) -> None:
        super().__init__()
        if not isinstance(f, int | float) or not (f > 0 and math.isfinite(f)):
            raise ValueError(f"f={f!r} must be a finite float > 0 (the n-th needs conf >= 1 - f/(n+1))")
        if not isinstance(hold_end, bool):
            raise TypeError(f"hold_end={hold_end!r} must be a bool (True: hold end-of-text behind the text)")
        self.f = float(f)
        self.release_quirk = bool(release_quirk)
        self.hold_end = hold_end

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        conf = inp.signals.confidence
        active = inp.active & ~held_ends(inp) if self.hold_end else inp.active
        order = active_first_order(conf, active)
        sorted_conf = conf.gather(-1, order)
        n = torch.arange(1, conf.shape[-1] + 1, device=conf.device, dtype=torch.float64)
        # upstream builds the thresholds as Python floats; the comparison then runs in the tensor's dtype
        thresh = (1 - self.f / (n + 1)).to(conf.dtype)
        n_active = active_count(active)
        ok = (sorted_conf >= thresh) & (n <= n_active.unsqueeze(-1))
        ok[:, 0] = n_active > 0
        length = ok.long().cumprod(dim=-1).sum(dim=-1)
        if self.release_quirk:
            length = torch.where((n_active >= 2) & (length == n_active - 1), n_active, length)
        return topk_mask(conf, active, length)
