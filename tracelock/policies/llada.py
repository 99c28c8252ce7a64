"""LLaDA's remasking rules (ML-GSAI/LLaDA ``generate``): random, confidence, topk.

The schedule: a region with M active positions and S = steps // num_regions steps commits
``M // S + (1 if i < M % S else 0)`` at its step i (``get_num_transfer_tokens``), fixed when the region
begins. k = 0 steps commit nothing, as upstream. Once ``region_step >= S`` (the budget is spent but
positions remain, e.g. a window clamped k) every active candidate is committed.
"""

from __future__ import annotations

import torch

from .base import Policy, StepInput, active_count, check_steps, held_ends, split_steps, topk_mask

__all__ = ["ConfidencePolicy", "RandomPolicy", "TopKPolicy", "held_last_topk", "llada_schedule_k"]


def llada_schedule_k(inp: StepInput, steps_per_region: int) -> torch.Tensor:
    """[B] LLaDA's per-step count, clamped to the active candidates; all of them once S is spent."""
    m, i = inp.region_initial, inp.region_step
    k = m // steps_per_region + (i < m % steps_per_region).long()
    n_active = active_count(inp.active)
    return torch.where(i >= steps_per_region, n_active, torch.minimum(k, n_active))


def held_last_topk(score: torch.Tensor, active: torch.Tensor, held: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, R] the ``k[b]`` best active slots of each row with the ``held`` ones ranked after all the others: the
    free slots by score first, then, only where k exceeds them, the held ones by score."""
    free = active & ~held
    chosen = topk_mask(score, free, k)
    return chosen | topk_mask(score, active & held, (k - active_count(free)).clamp(min=0))


class _ScheduledPolicy(Policy):
    def __init__(self, steps: int | None = None) -> None:
        super().__init__()
        check_steps(steps)
        self.steps = steps

    def setup(self, *, gen_length: int, num_regions: int) -> None:
        super().setup(gen_length=gen_length, num_regions=num_regions)
        self._steps_per_region = split_steps(self.steps, gen_length, num_regions)


# the certainty scores a scheduled rule can rank by: the `tracelock.signals.Signals` field of each
SCORES = ("confidence", "margin", "neg_entropy")


class ConfidencePolicy(_ScheduledPolicy):
    """LLaDA ``low_confidence``: the scheduled k most certain active slots.

    ``score="neg_entropy"`` is the TraceLock paper's native Dream baseline: exactly the scheduled k per step (one per
    step at steps = gen_length) ranked by Dream's neg-entropy. Dream's own ``entropy`` rule ranks by the same score
    but truncates its per-step count (``int(n (1 - s/t))``), which in semi-AR blocks commits nothing at a block's
    first step and two slots at its last.

    Args:
        steps (int, optional): total steps, a multiple of the region count. Default: gen_length.
        score (str): the certainty to rank by: "confidence" (max probability, LLaDA), "margin" (p1 - p2) or
            "neg_entropy" (sum p log p, Dream). Default: "confidence".
        hold_end (bool): not LLaDA's: an end-of-text proposal with an active slot left of it that proposes text
            ranks after every other active slot (`held_ends`, as ``threshold``'s ``hold_end``), so it commits only
            once no text is left of it or in the same step as the last of that text; the schedule's count per step
            stays, and so do the steps. At one token per step a held end never commits. Default: False.
    """

    name = "confidence"
    deterministic = True

    def __init__(self, steps: int | None = None, score: str = "confidence", hold_end: bool = False) -> None:
        super().__init__(steps)
        if score not in SCORES:
            raise ValueError(f"score={score!r} is not a certainty score; choose one of {', '.join(SCORES)}")
        if not isinstance(hold_end, bool):
            raise TypeError(f"hold_end={hold_end!r} must be a bool (True: hold end-of-text behind the text)")
        self.score = score
        self.hold_end = hold_end

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        score = getattr(inp.signals, self.score)
        k = llada_schedule_k(inp, self.steps_per_region())
        if not self.hold_end:
            return topk_mask(score, inp.active, k)
        return held_last_topk(score, inp.active, held_ends(inp), k)


class RandomPolicy(_ScheduledPolicy):
    """LLaDA ``random``: the scheduled k active slots, by uniform random scores from ``generator``.

    Args:
        steps (int, optional): total steps, a multiple of the region count. Default: gen_length.
    """

    name = "random"
    deterministic = False

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        scores = torch.rand(inp.active.shape, generator=generator, device=inp.active.device)
        return topk_mask(scores, inp.active, llada_schedule_k(inp, self.steps_per_region()))


class TopKPolicy(Policy):
    """The k most confident active slots at every step (no schedule).

    Args:
        k (int): slots per step (fewer when fewer are active). Default: 1.
    """

    name = "topk"
    deterministic = True

    def __init__(self, k: int = 1) -> None:
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k={k!r} must be a positive int (slots committed per step)")
        self.k = k

    def setup(self, *, gen_length: int, num_regions: int) -> None:
        super().setup(gen_length=gen_length, num_regions=num_regions)
        # k per step: ceil(region / k) steps empty a region
        self._steps_per_region = -(-self._steps_per_region // self.k)

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        k = torch.full_like(inp.region_step, self.k)
        return topk_mask(inp.signals.confidence, inp.active, k)
