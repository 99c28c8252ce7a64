"""Fast-dLLM++'s Fréchet profile decoding (arXiv 2606.02955; Ringo-Star/FastdLLM_plusplus, Apache-2.0): a
training-free parallel rule that generalises Fast-dLLM's factor rule from equal confidences to any profile.

Written from the rule as the paper and its code state it (``get_transfer_index_frechet_profile`` in its
``llada/generate.py``; the same lines in its Dream block sampler): sort the active slots' confidences
``c_(1) >= c_(2) >= ...``; for each prefix length n the Fréchet lower bound that all n proposals are right is
``L_n = sum_{j <= n} c_(j) - (n - 1)``, the bound on a competitor at the n-th is ``U_n = 1 - c_(n)``; commit the n
most confident slots with ``L_n - U_n > delta``, and always the most confident one. ``L_n - U_n`` never grows with n
(its step is ``2 c_(n+1) - c_(n) - 1 <= 0``), so the slots that pass are a prefix. At equal confidences ``1 - eps``
and ``delta = 0`` it is the factor rule with f = 1: ``(n + 1) eps < 1``.
"""

from __future__ import annotations

import math

import torch

from .base import Policy, StepInput, active_count, active_first_order, first_token_form, held_ends, topk_mask

__all__ = ["FrechetPolicy"]


class FrechetPolicy(Policy):
    """Commit the most confident active slots while ``sum c_(j) - (n - 1) - (1 - c_(n)) > delta``; always one.

    Scores are summed in float64 from this package's fp32 confidences (upstream: float64 probabilities on LLaDA,
    the logits' dtype in its Dream sampler). Like upstream, the passing count is the number of prefix lengths
    whose score clears delta, the first always counted.

    Args:
        delta (float): the safety margin: larger commits fewer per step; delta >= 1 commits one per step (no prefix
            of two or more scores above 1), a negative delta more. Fast-dLLM++'s ``frechet_margin``. Default: 0.0.
        first_token (bool): Fast-dLLM++'s Dream form (its Dream block sampler, as Fast-dLLM's ``threshold``
            ``first_token``): a region's first step, which upstream runs as the cache refresh, commits only the
            region's first masked position; the Fréchet rule runs from the second step. Use it with Dream backbones
            in semi-AR blocks. Default: False (the LLaDA form).
        hold_end (bool): not Fast-dLLM++'s: an end-of-text proposal commits only once no active slot left of it
            proposes text (as ``threshold``'s and TraceLock's ``hold_end``); the held slots leave the profile.
            Default: False.
    """

    name = "frechet"
    deterministic = True

    def __init__(self, delta: float = 0.0, first_token: bool = False, hold_end: bool = False) -> None:
        super().__init__()
        if isinstance(delta, bool) or not isinstance(delta, int | float) or not math.isfinite(delta):
            raise ValueError(f"delta={delta!r} must be a finite number (the margin L_n - U_n must clear; "
                             "0.0 is the rule's own boundary)")
        if not isinstance(first_token, bool):
            raise TypeError(f"first_token={first_token!r} must be a bool (True: Fast-dLLM++'s Dream form)")
        if not isinstance(hold_end, bool):
            raise TypeError(f"hold_end={hold_end!r} must be a bool (True: hold end-of-text behind the text)")
        self.delta = float(delta)
        self.first_token = first_token
        self.hold_end = hold_end

    def counts(self, conf: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """[B] how many of each row's active slots the rule commits (0 for a row with none active)."""
        order = active_first_order(conf, active)
        values = conf.gather(-1, order).double()
        n_active = active_count(active)
        cols = torch.arange(conf.shape[-1], device=conf.device)
        valid = cols < n_active.unsqueeze(-1)
        cum = torch.where(valid, values, torch.zeros_like(values)).cumsum(-1)
        score = cum - cols.double() - (1.0 - values)
        passing = valid & (score > self.delta)
        passing[:, 0] = n_active > 0  # the most confident always commits
        return passing.sum(-1)

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        conf = inp.signals.confidence
        active = inp.active & ~held_ends(inp) if self.hold_end else inp.active
        chosen = topk_mask(conf, active, self.counts(conf, active))
        return first_token_form(inp, chosen) if self.first_token else chosen
