"""Dream's ``diffusion_generate`` algorithms (DreamLM): origin, maskgit_plus, topk_margin, entropy.

Per schedule region, ``ts = linspace(1, eps, S + 1)`` in fp32 and step i uses t = ts[i], s = ts[i + 1].
``origin`` reveals each active slot with probability 1 - s/t (1 at the last step). The others commit
``k = int(n (1 - s/t))`` slots (``int(n)`` at the last step; k may be 0) by their score, with n the row's
active count in the region. Dream uses the batch average ``mask_count.sum() / B`` instead, which ties
a row's schedule to its batch mates: ``batch_average=True`` reproduces it. k is clamped to the row's
active candidates (upstream ``topk`` would otherwise pick committed slots and re-mask them). Once
``region_step >= S`` every active candidate is committed.
"""

from __future__ import annotations

import torch

from .base import Policy, StepInput, active_count, check_steps, gumbel_topk_mask, split_steps, topk_mask

__all__ = ["EntropyPolicy", "MaskGitPlusPolicy", "OriginPolicy", "TopKMarginPolicy"]


class _DreamPolicy(Policy):
    def __init__(
        self, steps: int | None = None, eps: float = 1e-3, alg_temp: float | None = None, batch_average: bool = False
    ) -> None:
        super().__init__()
        check_steps(steps)
        if not 0 < eps < 1:
            raise ValueError(f"eps={eps!r} must lie in (0, 1): the schedule runs t from 1 down to eps")
        if alg_temp is not None and not alg_temp >= 0:
            raise ValueError(f"alg_temp={alg_temp!r} must be None or >= 0 (None/0 = deterministic top-k)")
        self.steps, self.eps, self.alg_temp, self.batch_average = steps, eps, alg_temp, batch_average
        if alg_temp:
            self.deterministic = False
        self._keep = torch.zeros(0)

    @classmethod
    def deterministic_with(cls, **kwargs) -> bool:
        return cls.deterministic and not kwargs.get("alg_temp")

    def setup(self, *, gen_length: int, num_regions: int) -> None:
        super().setup(gen_length=gen_length, num_regions=num_regions)
        s = self._steps_per_region = split_steps(self.steps, gen_length, num_regions)
        # fp32 like upstream's torch.linspace, so int(n * (1 - s/t)) truncates at the same values
        ts = torch.linspace(1, self.eps, s + 1)
        self._keep = 1 - ts[1:] / ts[:-1]

    def _step_index(self, inp: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Clamped step index [B] and a [B] flag: last step of the budget, or past it."""
        s = self.steps_per_region()
        if self._keep.device != inp.region_step.device:
            # one copy per generation, not a host-to-device transfer every step
            self._keep = self._keep.to(inp.region_step.device)
        return inp.region_step.clamp(max=s - 1), inp.region_step >= s - 1


class OriginPolicy(_DreamPolicy):
    """Dream ``origin``: each active slot is revealed independently with probability 1 - s/t.

    Args:
        steps (int, optional): total steps, a multiple of the region count. Default: gen_length.
        eps (float): final timestep. Default: 1e-3.
    """

    name = "origin"
    deterministic = False

    def __init__(self, steps: int | None = None, eps: float = 1e-3) -> None:
        super().__init__(steps=steps, eps=eps)

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        i, last = self._step_index(inp)
        p = self._keep[i]
        u = torch.rand(inp.active.shape, generator=generator, device=inp.active.device)
        return inp.active & ((u < p.unsqueeze(-1)) | last.unsqueeze(-1))


class _DreamTopK(_DreamPolicy):
    score_field: str = ""

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        i, last = self._step_index(inp)
        n = inp.region_active.float()
        if self.batch_average:
            n = (n.sum() / n.shape[0]).expand_as(n)
        # float32 product then truncation toward zero, as upstream's int(tensor)
        k = torch.where(last, n, n * self._keep[i]).long()
        n_active = active_count(inp.active)
        k = torch.where(inp.region_step >= self.steps_per_region(), n_active, torch.minimum(k, n_active))
        score = getattr(inp.signals, self.score_field)
        if self.alg_temp:
            return gumbel_topk_mask(score, inp.active, k, self.alg_temp, generator)
        return topk_mask(score, inp.active, k)


_ARGS_DOC = """
    Args:
        steps (int, optional): total steps, a multiple of the region count. Default: gen_length.
        eps (float): final timestep. Default: 1e-3.
        alg_temp (float, optional): None/0 takes the top-k; > 0 samples k slots without replacement
            from softmax(score / alg_temp) with the step's generator. Default: None.
        batch_average (bool): use Dream's batch-average n. Default: False.
"""


class MaskGitPlusPolicy(_DreamTopK):
    name, score_field = "maskgit_plus", "confidence"
    __doc__ = "Dream ``maskgit_plus``: the k most probable proposals.\n" + _ARGS_DOC


class TopKMarginPolicy(_DreamTopK):
    name, score_field = "topk_margin", "margin"
    __doc__ = "Dream ``topk_margin``: the k largest top-2 margins p1 - p2.\n" + _ARGS_DOC


class EntropyPolicy(_DreamTopK):
    name, score_field = "entropy", "neg_entropy"
    __doc__ = "Dream ``entropy``: the k largest neg-entropies sum p log p.\n" + _ARGS_DOC
