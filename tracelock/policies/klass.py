"""KLASS (KL-Adaptive Stability Sampling, arXiv 2511.05664, NeurIPS 2025; shkim0116/KLASS, MIT): commit the masked
slots that are confident and whose distribution has stopped moving, judged by the KL between consecutive steps.

Written from the rule as its code computes it. Each step, per slot: ``p = softmax(logits)`` (float64), ``conf =
max p``, ``KL = sum p (log(p + 1e-12) - log(p_prev + 1e-12))`` against the slot's distribution at the previous forward
(zeros before the first), kept in a ring of the last ``history`` values. A slot is *ready* when it is masked, its
confidence clears ``tau`` and every KL in its ring is ``< kl``. If a row has ready slots it commits all of them; else:

- ``form="llada"`` (``stable_confident_decode``, ``alg="klass"``): ``conf > tau`` (strict), and only from the region's
  step ``history - 1`` on; otherwise LLaDA's scheduled count (``steps``) of the most confident slots. KLASS ends a
  block after its ``steps`` share even with masks left; here, as in LLaDA's rules of this package, a block whose
  budget is spent commits what is left.
- ``form="dream"`` (its Dream ``_sample``, ``alg='klass'``, whole answer): ``conf >= tau``, no step gate; otherwise
  the one most confident slot (ranked by the softmax in the logits' dtype, as its code ranks it).

KLASS runs the whole sequence every step, so a block's slots already have a previous distribution and a KL ring
when the block starts. Here the memory covers the next block as well (the step reads its logits too), so the
same holds, except under a dual KV cache, which computes the block alone: there a block starts with empty memory
(its slots are ready from step ``history`` on). The vocabulary work is one op, `tracelock.ops.step_kl` (spec:
``kernels.ref.step_kl_ref``).
"""

from __future__ import annotations

import math

import torch

from .base import Policy, StepInput, check_flags, check_steps, first_token_form, held_ends, split_steps, topk_mask
from .llada import llada_schedule_k

__all__ = ["KlassPolicy"]

FORMS = ("llada", "dream")


class KlassPolicy(Policy):
    """Commit every confident slot whose last ``history`` step-to-step KLs are below ``kl``; else a fallback.

    Args:
        tau (float): the confidence bar in (0, 1] (``conf_threshold``). Default: 0.9.
        kl (float): the KL bar, > 0 (``kl_threshold``). Default: 0.01.
        history (int): how many consecutive KLs must be below it, >= 1 (``kl_history_length``). Default: 2.
        steps (int, optional): ``form="llada"``: total steps of LLaDA's schedule for the fallback, a multiple of the
            region count. Default: gen_length (KLASS's scripts: steps = gen_length).
        form (str): "llada" or "dream" (see the module docstring). Default: "llada".
        first_token (bool): a region's first step commits its first masked position only. Not KLASS's. Default: False.
        hold_end (bool): not KLASS's: an end-of-text proposal commits only once no active slot left of it proposes
            text. Default: False.
    """

    name = "klass"
    deterministic = True
    reads_vocab = True
    memory_lookahead = True

    def __init__(self, tau: float = 0.9, kl: float = 0.01, history: int = 2, steps: int | None = None,
                 form: str = "llada", first_token: bool = False, hold_end: bool = False) -> None:
        super().__init__()
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not 0 < tau <= 1:
            raise ValueError(f"tau={tau!r} must lie in (0, 1] (KLASS's conf_threshold; its scripts use 0.6-0.9)")
        if isinstance(kl, bool) or not isinstance(kl, int | float) or not (math.isfinite(kl) and kl > 0):
            raise ValueError(f"kl={kl!r} must be a finite number > 0 (KLASS's kl_threshold; its scripts use "
                             "0.001-0.015)")
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history={history!r} must be an int >= 1 (KLASS's kl_history_length: 2)")
        if form not in FORMS:
            raise ValueError(f"form={form!r} must be one of {', '.join(FORMS)} (KLASS's LLaDA or Dream code)")
        check_steps(steps)
        check_flags(first_token=first_token, hold_end=hold_end)
        self.tau, self.kl, self.history, self.steps, self.form = float(tau), float(kl), history, steps, form
        self.first_token, self.hold_end = first_token, hold_end

    def setup(self, *, gen_length: int, num_regions: int) -> None:
        super().setup(gen_length=gen_length, num_regions=num_regions)
        self._steps_per_region = split_steps(self.steps, gen_length, num_regions)

    def memory_spec(self, *, width: int, spec) -> dict:
        return {"prev": ((width, spec.vocab_size), torch.float32),
                "kl_ring": ((width, self.history), torch.float64)}

    def vocab_fields(self) -> dict:
        return {"confidence": torch.float32, "stable": torch.bool,
                **({"fallback": torch.float32} if self.form == "dream" else {})}

    def vocab_pass(self, ops, logits, memory, active, fresh, width) -> dict:
        b, w, V = logits.shape
        R = width
        prev, ring = memory["prev"], memory["kl_ring"]
        # a new region: its slots take the memory they gathered as the next region (the next region's slots, one
        # region wide, start empty); no copy of the [b, W, V] memory on the other steps
        new = fresh[:, None, None]
        for buf in (prev, ring):
            if R < w:
                buf[:, :R] = torch.where(new, buf[:, R:], buf[:, :R])
            buf[:, R if R < w else 0:].masked_fill_(new, 0)
        _, confidence, kl = ops.step_kl(logits.reshape(b * w, V), prev.view(b * w, V))
        ring.copy_(torch.cat([ring[..., 1:], kl.view(b, w, 1).to(ring.dtype)], -1))
        out = {"confidence": confidence.view(b, w).float(), "stable": (ring < self.kl).all(-1)}
        if self.form == "dream":
            # KLASS's Dream code ranks its one fallback by the softmax in the logits' dtype (ties to the lowest
            # position), not by its float64 confidence
            out["fallback"] = logits.softmax(dim=-1).amax(dim=-1).float()
        return out

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        active = inp.active & ~held_ends(inp) if self.hold_end else inp.active
        conf, stable = inp.vocab["confidence"], inp.vocab["stable"]
        if self.form == "llada":
            ready = active & stable & (conf > self.tau) & (inp.region_step >= self.history - 1)[:, None]
            fallback = topk_mask(conf, active, llada_schedule_k(inp, self.steps_per_region()))
        else:
            ready = active & stable & (conf >= self.tau)
            fallback = topk_mask(inp.vocab["fallback"], active, torch.ones_like(inp.region_step))
        chosen = torch.where(ready.any(-1, keepdim=True), ready, fallback)
        return first_token_form(inp, chosen) if self.first_token else chosen
