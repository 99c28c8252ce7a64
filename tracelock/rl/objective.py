"""The pieces of the RL objective, each a plain function of tensors (hand-checked in tests/test_rl.py).

- sampling rule: ``p~ = clip((p - eta) / (1 - eta), eps, 1 - eps)`` on the eligible positions ``p > eta``;
- group-relative advantages ``A_j = (R_j - mean) / (std + eps)`` over each group of G rollouts of one prompt
  (population std);
- loss of a batch of rollouts: ``mean_j [ -A_j sum_t log pi(u_t | x_t) - beta sum_t H(pi(. | x_t)) ]`` with the
  Bernoulli log-likelihood and entropy summed over each step's eligible positions.
"""

from __future__ import annotations

import torch

__all__ = ["bernoulli_terms", "group_advantages", "rescaled_probs", "rl_loss"]


def rescaled_probs(p: torch.Tensor, eta: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(p~, eligible): the commit probabilities rescaled above the sample threshold ``eta`` and clipped to
    [eps, 1 - eps], and the positions allowed to commit (``p > eta``)."""
    if not 0 <= eta < 1:
        raise ValueError(f"eta={eta!r} must lie in [0, 1): the sample threshold on sigmoid(m)")
    if not 0 < eps < 0.5:
        raise ValueError(f"eps={eps!r} must lie in (0, 0.5): the clip keeps p~ in [eps, 1 - eps]")
    return ((p - eta) / (1 - eta)).clamp(eps, 1 - eps), p > eta


def bernoulli_terms(p_tilde: torch.Tensor, u: torch.Tensor, eligible: torch.Tensor) -> tuple:
    """([b] log-likelihood of the decisions ``u``, [b] entropy), each summed over the eligible positions of a step."""
    u = u.to(p_tilde.dtype)
    logp = u * torch.log(p_tilde) + (1 - u) * torch.log1p(-p_tilde)
    entropy = -(p_tilde * torch.log(p_tilde) + (1 - p_tilde) * torch.log1p(-p_tilde))
    zero = torch.zeros((), dtype=p_tilde.dtype, device=p_tilde.device)
    return torch.where(eligible, logp, zero).sum(-1), torch.where(eligible, entropy, zero).sum(-1)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[n] advantages of n = groups x ``group_size`` rewards laid out group by group."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().reshape(-1, group_size)
    mean, std = r.mean(1, keepdim=True), r.std(1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).reshape(-1)


def rl_loss(log_likelihood: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, beta: float) -> torch.Tensor:
    """The batch loss from per-rollout sums over steps ([n] each) and advantages [n]."""
    return (-advantages * log_likelihood - beta * entropy).mean()
