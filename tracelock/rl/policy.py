"""TraceLock with sampled commits, for RL rollouts: ``u ~ Bernoulli(p~)`` on the eligible active slots.

At each step the controller scores the slots as in deployment (``p = sigmoid(a - tau)``); the slots with ``p > eta``
are eligible and each commits with probability ``p~`` (`tracelock.rl.objective.rescaled_probs`), drawn from the
loop's seeded generator. When none commits, the best active slot does (the deterministic fallback keeps the loop
moving; it is not a sampled decision, so it has no log-probability). Every step's inputs and decisions are kept, so
the loss can recompute the same probabilities with gradients (`step_terms`).
"""

from __future__ import annotations

import torch

from tracelock.policies.base import StepInput, topk_mask
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.rl.objective import bernoulli_terms, rescaled_probs

__all__ = ["SampledTraceLockPolicy"]


class SampledTraceLockPolicy(TraceLockPolicy):
    """Args:
        controller, encoder, model: as `TraceLockPolicy`.
        eta (float): sample threshold on ``sigmoid(m)``. Default: 0.5.
        eps (float): clip of the rescaled probabilities. Default: 0.05.
    """

    name = "tracelock-sampled"
    deterministic = False

    def __init__(self, controller, encoder=None, *, eta: float = 0.5, eps: float = 0.05, model=None) -> None:
        super().__init__(controller, encoder=encoder, model=model)
        rescaled_probs(torch.zeros(1), eta, eps)  # validates both
        self.eta, self.eps = float(eta), float(eps)
        self.records: list[dict] = []

    @property
    def controller(self):
        return self._controller

    def tap_fold(self, model):
        # the loss needs the encoder's codes (the projection is trained), so the taps come unfolded
        self._prepare(model.device, model.spec.hidden_size)
        return None

    def commit_rule(self, inp: StepInput):
        return None

    def _step_tensors(self, inp: StepInput) -> dict:
        B, T, D = inp.taps[0].shape
        self._prepare(inp.taps[0].device, D)
        key_mask, conf = self.context(inp, T)
        return dict(codes=self._encoder.codes(*inp.taps), state=inp.state[:, :T], key_mask=key_mask, conf=conf,
                    positions=inp.positions, active=inp.active)

    def _probs(self, t: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ctrl = self._controller
        a, tau = ctrl.forward_projected(ctrl.project(t["codes"]), t["state"], t["key_mask"], t["conf"])
        p = torch.sigmoid(a.gather(1, t["positions"]) - tau[:, None])
        p_tilde, eligible = rescaled_probs(p, self.eta, self.eps)
        return p_tilde, eligible & t["active"]

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        if inp.taps is None:
            raise ValueError("the sampled policy needs the raw taps; run it through fused_generate/reference_generate")
        t = self._step_tensors(inp)
        with torch.no_grad():
            p_tilde, eligible = self._probs(t)
        u = eligible & (torch.rand(p_tilde.shape, generator=generator, device=p_tilde.device) < p_tilde)
        best = topk_mask(p_tilde.masked_fill(~inp.active, -1.0), inp.active, torch.ones_like(inp.region_step))
        self.records.append(dict(t, rows=inp.rows.clone(), u=u, eligible=eligible))
        return u | (best & ~u.any(dim=1, keepdim=True))

    def step_terms(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([n_rows] log-likelihood, [n_rows] entropy) of the recorded rollouts, summed over their steps, recomputed
        with gradients through the controller."""
        logp = entropy = None
        for rec in self.records:
            p_tilde, _ = self._probs(rec)
            lp, h = bernoulli_terms(p_tilde, rec["u"], rec["eligible"])
            zeros = lp.new_zeros(n_rows)
            lp, h = zeros.index_add(0, rec["rows"], lp), zeros.index_add(0, rec["rows"], h)
            logp, entropy = (lp, h) if logp is None else (logp + lp, entropy + h)
        if logp is None:
            raise RuntimeError("no recorded steps: decode with this policy first")
        return logp, entropy
