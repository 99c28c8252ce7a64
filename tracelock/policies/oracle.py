"""The oracle: commit exactly the proposals that already equal a reference run's final tokens.

It shows how much room a learned commitment policy has: with the final canvas of a careful run (e.g.
confidence, one token per step) as reference, it commits every proposal that is already right, and
falls back to the single most confident active slot when none is. Not in the name registry: it needs
the reference tokens.
"""

import torch

from tracelock.policies.base import Policy, StepInput, topk_mask


class OraclePolicy(Policy):
    """Args:
        reference (torch.LongTensor): [B, L] final canvases of the reference run, same batch and layout.
    """

    name = "oracle"
    deterministic = True

    def __init__(self, reference: torch.Tensor):
        super().__init__()
        self.reference = reference

    def select(self, inp: StepInput, generator=None) -> torch.Tensor:
        target = self.reference.to(inp.positions.device)[inp.rows].gather(1, inp.positions)
        right = inp.active & (inp.signals.proposal == target)
        fallback = topk_mask(inp.signals.confidence, inp.active, torch.ones_like(inp.region_step))
        return torch.where(right.any(1, keepdim=True), right, fallback)

    def __repr__(self) -> str:
        return "OraclePolicy()"
