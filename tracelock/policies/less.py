"""LESS (arXiv 2606.16908): commit a masked slot once its proposal has persisted and its top-8 distribution has
stopped drifting; else LLaDA's scheduled count.

Implemented from the paper's description (its code has no licence; nothing of it is used): a masked slot of the
region is accepted when its top-1 token equals its top-1 token at each of the previous ``persist`` forwards, its
top-1 probability is ``>= tau`` and the Jensen-Shannon divergence (natural log) between this forward's and the
previous forward's top-8 distributions (8 ids plus one bucket for the rest of the mass, compared over the union of
their ids: ``kernels.ref.topk_js_ref``) is ``<= drift``; a slot without a previous forward has drift 1. A row commits
all its accepted slots; if it has none, the ``k`` most confident, with ``k`` LLaDA's scheduled count (at least 1). A
slot's history starts over when its block starts. Per slot the memory is the last top-8 ids and probabilities and
the last ``persist`` top-1 ids; the vocabulary work is one op, `tracelock.ops.topk_js`.

The authors' Dream sampler adds frontier-first commitment and end-of-text tightening; they are not described in a
form this package could check, so the Dream backbone runs the same rule (use ``first_token`` for the Dream form of
a block's first step).
"""

from __future__ import annotations

import math

import torch

from .base import Policy, StepInput, check_flags, check_steps, first_token_form, held_ends, split_steps, topk_mask
from .llada import llada_schedule_k

__all__ = ["LessPolicy", "TOP_K"]

TOP_K = 8  # LESS's DRIFT_TOPK


class LessPolicy(Policy):
    """Commit slots whose top-1 persisted ``persist`` forwards with confidence >= ``tau`` and top-8 drift <= ``drift``.

    Args:
        tau (float): the confidence bar in (0, 1]. Default: 0.75 (the authors' LLaDA default).
        drift (float): the largest JS drift of the top-8 distribution, in [0, ln 2]. Default: 0.04.
        persist (int): forwards the top-1 token must have held before this one, >= 1. Default: 2.
        steps (int, optional): total steps of LLaDA's schedule for the fallback, a multiple of the region count.
            Default: gen_length.
        first_token (bool): the Dream form: a region's first step commits its first masked position only. Default:
            False.
        hold_end (bool): an end-of-text proposal commits only once no active slot left of it proposes text. Default:
            False.
    """

    name = "less"
    deterministic = True
    reads_vocab = True

    def __init__(self, tau: float = 0.75, drift: float = 0.04, persist: int = 2, steps: int | None = None,
                 first_token: bool = False, hold_end: bool = False) -> None:
        super().__init__()
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not 0 < tau <= 1:
            raise ValueError(f"tau={tau!r} must lie in (0, 1] (LESS's conf_threshold: 0.75)")
        if isinstance(drift, bool) or not isinstance(drift, int | float) or not (
                math.isfinite(drift) and 0 <= drift <= math.log(2)):
            raise ValueError(f"drift={drift!r} must lie in [0, ln 2 = 0.693] (a JS divergence in nats; LESS: 0.04)")
        if isinstance(persist, bool) or not isinstance(persist, int) or persist < 1:
            raise ValueError(f"persist={persist!r} must be an int >= 1 (LESS's persistence_len: 2)")
        check_steps(steps)
        check_flags(first_token=first_token, hold_end=hold_end)
        self.tau, self.drift, self.persist, self.steps = float(tau), float(drift), persist, steps
        self.first_token, self.hold_end = first_token, hold_end

    def setup(self, *, gen_length: int, num_regions: int) -> None:
        super().setup(gen_length=gen_length, num_regions=num_regions)
        self._steps_per_region = split_steps(self.steps, gen_length, num_regions)

    def memory_spec(self, *, width: int, spec) -> dict:
        return {"ids": ((width, TOP_K), torch.long), "probs": ((width, TOP_K), torch.float32),
                "top1": ((width, self.persist), torch.long), "seen": ((width,), torch.long)}

    def vocab_fields(self) -> dict:
        return {"confidence": torch.float32, "accepted": torch.bool}

    def vocab_pass(self, ops, logits, memory, active, fresh, width) -> dict:
        b, w, V = logits.shape
        # a new block: its slots' history starts over
        for buf in memory.values():
            buf.masked_fill_(fresh.view(-1, *[1] * (buf.dim() - 1)), 0)
        ids, probs, seen = memory["ids"], memory["probs"], memory["seen"]
        new_ids, new_probs, js = ops.topk_js(logits.reshape(b * w, V), ids.view(b * w, TOP_K),
                                             probs.view(b * w, TOP_K), (seen > 0).view(-1))
        new_ids, new_probs, js = new_ids.view(b, w, TOP_K), new_probs.view(b, w, TOP_K), js.view(b, w)
        top1, conf = new_ids[..., 0], new_probs[..., 0]
        held = (seen >= self.persist) & (memory["top1"] == top1[..., None]).all(-1)
        accepted = held & (conf >= self.tau) & (js <= self.drift)
        ids.copy_(new_ids)
        probs.copy_(new_probs)
        memory["top1"].copy_(torch.cat([memory["top1"][..., 1:], top1[..., None]], -1))
        seen.add_(1)
        return {"confidence": conf, "accepted": accepted}

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        active = inp.active & ~held_ends(inp) if self.hold_end else inp.active
        accepted = active & inp.vocab["accepted"]
        k = llada_schedule_k(inp, self.steps_per_region()).clamp(min=1)
        fallback = topk_mask(inp.vocab["confidence"], active, k)
        chosen = torch.where(accepted.any(-1, keepdim=True), accepted, fallback)
        return first_token_form(inp, chosen) if self.first_token else chosen
