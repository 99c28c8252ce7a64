"""CreditDecoding (arXiv 2510.06133; shipped in dInfer as ``CreditThresholdParallelDecoder``, Apache-2.0): a threshold
rule on logits fused with a decaying per-slot credit over the vocabulary, so a token a slot kept proposing gains
confidence and commits earlier.

Written from the rule as dInfer's code computes it: per step, every slot's credit decays by ``beta`` (it starts at
zero on its block's first step), a masked slot's top-1 token gains ``p1 ** gamma``, the logits become ``logits + alpha
log(C + 1)``, and dInfer's threshold rule (``get_transfer_index_threshold``) runs on them: the proposal is the fused
argmax; confidence ``c`` is its fused probability, -inf where the proposal is the mask token; a row commits every slot
with ``c >= min(max(c) - 1e-5, tau)`` (so always its most confident one, and any within 1e-5 of it). The vocabulary
work is one op, `tracelock.ops.credit_fuse` (spec: ``kernels.ref.credit_fuse_ref``); the commits go through
`tracelock.ops.commit_step` (``c >= bar`` as the sign of the margin ``c - bar``). Where every masked slot proposes the
mask token dInfer commits nothing (and loops); here the most confident slot still commits.
"""

from __future__ import annotations

import math

import torch

from tracelock.kernels.ref import commit_margin_threshold, commit_select_ref

from .base import CommitRule, Policy, StepInput, check_flags, first_token_form, held_ends

__all__ = ["CreditPolicy"]


def _unit(name: str, value, low_open: bool = False) -> float:
    lo = "(0" if low_open else "[0"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not (
            0 < value <= 1 if low_open else 0 <= value <= 1):
        raise ValueError(f"{name}={value!r} must lie in {lo}, 1]")
    return float(value)


class CreditPolicy(Policy):
    """CreditDecoding: dInfer's threshold rule on credit-fused logits.

    Args:
        tau (float): the threshold in (0, 1]. Default: 0.9 (dInfer's benchmarks; its guide uses 0.8 with credit).
        alpha (float): weight of the credit in the fused logits, >= 0 (``credit_alpha``; 0 is dInfer's plain
            threshold decoder). Default: 0.7.
        gamma (float): the boost exponent, ``p1 ** gamma`` (``boost_gamma``), >= 0. Default: 0.2.
        beta (float): the credit's decay per step in [0, 1] (``decay_beta``). Default: 0.8.
        first_token (bool): the Dream form (as ``threshold``'s): a region's first step commits its first masked
            position only. Not dInfer's. Default: False.
        hold_end (bool): not dInfer's: an end-of-text proposal commits only once no active slot left of it proposes
            text. Default: False.
    """

    name = "credit"
    deterministic = True
    reads_vocab = True

    def __init__(self, tau: float = 0.9, alpha: float = 0.7, gamma: float = 0.2, beta: float = 0.8,
                 first_token: bool = False, hold_end: bool = False) -> None:
        super().__init__()
        self.tau = _unit("tau", tau, low_open=True)
        for name, value in (("alpha", alpha), ("gamma", gamma)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0 (dInfer's default: "
                                 f"{ {'alpha': 0.7, 'gamma': 0.2}[name]})")
        self.alpha, self.gamma = float(alpha), float(gamma)
        self.beta = _unit("beta", beta)
        check_flags(first_token=first_token, hold_end=hold_end)
        self.first_token, self.hold_end = first_token, hold_end
        self._mask_id = self._eos_id = None

    def memory_spec(self, *, width: int, spec) -> dict:
        self._mask_id, self._eos_id = spec.mask_id, spec.eos_id
        return {"credit": ((width, spec.vocab_size), torch.float32)}

    def vocab_fields(self) -> dict:
        return {"proposal": torch.long, "confidence": torch.float32, "eos_prob": torch.float32}

    def vocab_pass(self, ops, logits, memory, active, fresh, width) -> dict:
        b, w, V = logits.shape
        proposal, confidence = ops.credit_fuse(
            logits.reshape(b * w, V), memory["credit"].view(b * w, V), active.reshape(-1),
            fresh.repeat_interleave(w), self.alpha, self.gamma, self.beta)
        proposal, confidence = proposal.view(b, w), confidence.view(b, w)
        # hold_end reads the end token's probability against the confidence: here the fused proposal's, so a slot
        # proposes the end exactly when its fused argmax is the end token
        ends = proposal == self._eos_id if self._eos_id is not None else torch.zeros_like(proposal, dtype=torch.bool)
        return {"proposal": proposal, "confidence": confidence, "eos_prob": torch.where(ends, confidence, 0.0)}

    def _rule(self, inp: StepInput) -> CommitRule:
        """dInfer's threshold as `commit_step`'s rule: score c, a per-row bar ``min(max c - 1e-5, tau)`` and
        ``sigmoid(c - bar) >= 1/2``, i.e. ``c >= bar``, exactly (the op decides on the margin's sign)."""
        held = held_ends(inp) if self.hold_end else None
        # dInfer never commits the mask token as a proposal
        proposes = inp.active if self._mask_id is None else inp.active & (inp.signals.proposal != self._mask_id)
        c = torch.where(proposes, inp.signals.confidence.float(), float("-inf"))
        bar = (torch.where(held, float("-inf"), c) if held is not None else c).amax(-1) - 1e-5
        return CommitRule(score=c, tau=bar.clamp(-1000, self.tau), theta=0.5, fallback_score=c, held=held,
                          inclusive=True)

    def commit_rule(self, inp: StepInput) -> CommitRule | None:
        # the Dream form's first step commits the region's first masked position: `select` decides it
        return None if self.first_token else self._rule(inp)

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        rule = self._rule(inp)
        chosen = commit_select_ref(rule.score - rule.tau[:, None], inp.active, commit_margin_threshold(0.5, True), 0,
                                   rule.fallback_score, rule.held)
        return first_token_form(inp, chosen) if self.first_token else chosen
