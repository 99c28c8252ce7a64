"""The entropy-bounded sampler (EB-Sampler, arXiv 2505.24857): commit the lowest-entropy masked slots while the
entropy they add, beside the largest of them, stays within a budget ``gamma``.

Written from the rule as the third-party version staged with PC-Sampler computes it (``generate_with_eb_sampler``):
per step, sort the masked slots' entropies ``H`` (nats) ascending and commit the first ``k = #{j : sum_{i <= j} H_i -
max_{i <= j} H_i <= gamma}`` of them (at least one, at most all). That code has no blocks and no step cap; here the
rule runs in the region the schedule gives (the whole answer without ``block``). No state: the entropy is the step's
own signal (``neg_entropy``, computed in the logits' pass).
"""

from __future__ import annotations

import math

import torch

from .base import Policy, StepInput, active_count, check_flags, first_token_form, held_ends, topk_mask

__all__ = ["EntropyBoundPolicy"]


class EntropyBoundPolicy(Policy):
    """The most certain slots while their summed entropy, less its largest, is at most ``gamma``; always one.

    Args:
        gamma (float): the entropy budget in nats, >= 0 (the PC-Sampler authors' EB script: 0.01; the staged
            function's default 0.1). Default: 0.01.
        first_token (bool): the Dream form: a region's first step commits its first masked position only. Default:
            False.
        hold_end (bool): an end-of-text proposal commits only once no active slot left of it proposes text (held
            slots leave the sort). Default: False.
    """

    name = "eb"
    deterministic = True

    def __init__(self, gamma: float = 0.01, first_token: bool = False, hold_end: bool = False) -> None:
        super().__init__()
        if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not (math.isfinite(gamma) and gamma >= 0):
            raise ValueError(f"gamma={gamma!r} must be a finite number >= 0 (the entropy budget in nats; the "
                             "authors' script uses 0.01)")
        check_flags(first_token=first_token, hold_end=hold_end)
        self.gamma = float(gamma)
        self.first_token, self.hold_end = first_token, hold_end

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        active = inp.active & ~held_ends(inp) if self.hold_end else inp.active
        chosen = topk_mask(inp.signals.neg_entropy, active, self.counts(-inp.signals.neg_entropy, active))
        return first_token_form(inp, chosen) if self.first_token else chosen

    def counts(self, entropy: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """[B] how many of each row's active slots the bound admits (0 for a row with none active)."""
        # ascending entropy, inactive slots last (+inf), ties to the lowest slot
        h = torch.where(active, entropy, float("inf")).sort(dim=-1, stable=True).values
        n = active_count(active)
        valid = torch.arange(h.shape[-1], device=h.device) < n[:, None]
        h = torch.where(valid, h, 0.0)
        spent = h.cumsum(-1) - h.cummax(-1).values
        k = (valid & (spent <= self.gamma)).sum(-1)
        return torch.minimum(k.clamp(min=1), n)
