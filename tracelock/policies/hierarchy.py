"""dInfer's hierarchy rule (``HierarchyDecoder``, inclusionAI/dInfer, Apache-2.0): commit at most one slot per run of
adjacent masked positions, so neighbours that depend on each other are not committed together.

Written from the rule as dInfer's code computes it (``HierarchyDecoder.get_transfer_index``): split the region's
masked slots into maximal runs of adjacent positions; in each run mark the slots whose confidence equals the run's
largest (a tie marks every one), keep a mark only if its confidence is ``> low``; add every slot with confidence
``> tau``; always add the row's most confident slot (ties to the lowest index). dInfer's code takes batch 1; here each
row runs the same rule. No state.
"""

from __future__ import annotations

import math

import torch

from .base import Policy, StepInput, check_flags, first_token_form, held_ends

__all__ = ["HierarchyPolicy"]


class HierarchyPolicy(Policy):
    """One commit per run of adjacent masked slots (above ``low``), plus every slot above ``tau``, plus the best.

    Args:
        tau (float, optional): commit every slot with confidence > tau as well; None: only the runs' best (dInfer's
            ``threshold``, default None). Default: None.
        low (float): a run's best commits only with confidence > low (``low_threshold``; dInfer's class default 0.4,
            its benchmarks pass 0.3). Default: 0.4.
        first_token (bool): the Dream form: a region's first step commits its first masked position only. Not
            dInfer's. Default: False.
        hold_end (bool): not dInfer's: an end-of-text proposal commits only once no active slot left of it proposes
            text (held slots leave the runs). Default: False.
    """

    name = "hierarchy"
    deterministic = True

    def __init__(self, tau: float | None = None, low: float = 0.4, first_token: bool = False,
                 hold_end: bool = False) -> None:
        super().__init__()
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, int | float) or not 0 < tau <= 1):
            raise ValueError(f"tau={tau!r} must lie in (0, 1] or be None (no threshold beside the runs)")
        if isinstance(low, bool) or not isinstance(low, int | float) or not (math.isfinite(low) and 0 <= low < 1):
            raise ValueError(f"low={low!r} must lie in [0, 1): a run's best commits above it (dInfer: 0.4 or 0.3)")
        check_flags(first_token=first_token, hold_end=hold_end)
        self.tau = None if tau is None else float(tau)
        self.low = float(low)
        self.first_token, self.hold_end = first_token, hold_end

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        active = inp.active & ~held_ends(inp) if self.hold_end else inp.active
        chosen = run_best(inp.signals.confidence, active, self.low, self.tau)
        return first_token_form(inp, chosen) if self.first_token else chosen


def run_best(confidence: torch.Tensor, active: torch.Tensor, low: float, tau: float | None) -> torch.Tensor:
    """[B, R] the hierarchy rule's commits among the ``active`` slots (adjacent slots are adjacent positions)."""
    B, R = active.shape
    lowest = torch.finfo(confidence.dtype).min
    c = torch.where(active, confidence, lowest)
    starts = active & ~torch.cat([active.new_zeros(B, 1), active[:, :-1]], dim=1)
    run = torch.where(active, starts.long().cumsum(-1) - 1, 0)
    best = torch.full_like(c, lowest).scatter_reduce(1, run, c, reduce="amax", include_self=True)
    chosen = (c == best.gather(1, run)) & (c > low)
    if tau is not None:
        chosen |= c > tau
    top = torch.zeros_like(active).scatter_(1, c.argmax(dim=-1, keepdim=True), True)
    return (chosen | top) & active
