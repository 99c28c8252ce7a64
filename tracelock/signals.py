"""Per-step signals of the candidate positions: proposal, confidence, margin, neg-entropy, eos prob.

Everything is computed in fp32 from max-shifted exponentials (a logsumexp); the probabilities over the
vocabulary live only for the entropy reduction. Semantics follow LLaDA's ``generate`` (scores from softmax(logits)
at T = 1, even when the token is sampled) and Dream's ``diffusion_generate`` (from softmax(logits / T) when T > 0);
docs/design.md, "Where the rules come from".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Signals", "apply_cfg", "compute_signals", "filter_top_p_top_k", "gumbel_noise"]


@dataclass
class Signals:
    """Signals of the candidate slots at one step.

    Args:
        proposal (torch.LongTensor): [B, R] proposed token (argmax, or a sample when T > 0).
        confidence (torch.Tensor): [B, R] fp32 probability of ``proposal``.
        margin (torch.Tensor): [B, R] fp32 ``p1 - p2`` of the two largest probabilities.
        neg_entropy (torch.Tensor): [B, R] fp32 ``sum p log p`` (<= 0, higher = more certain).
        eos_prob (torch.Tensor): [B, R] fp32 probability of ``eos_id`` (zeros when it is None).
    """

    proposal: torch.Tensor
    confidence: torch.Tensor
    margin: torch.Tensor
    neg_entropy: torch.Tensor
    eos_prob: torch.Tensor


def gumbel_noise(shape, *, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log U)`` in fp32, U ~ U[0, 1) drawn from ``generator``.

    U = 0 gives -inf (that entry is never picked), a 2^-24 event per entry.
    """
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    return -torch.log(-torch.log(u))


def compute_signals(
    logits: torch.Tensor,
    *,
    eos_id: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    tempered: bool = False,
) -> Signals:
    """The `Signals` of every candidate slot from its logits.

    Args:
        logits (torch.Tensor): [B, R, V] logits of the candidate slots, any float dtype.
        eos_id (int, optional): token whose probability goes into ``eos_prob``. Default: None.
        temperature (float): 0 takes the argmax (ties to the lowest index); T > 0 samples
            softmax(logits / T) by Gumbel-max with ``generator``. Default: 0.0.
        generator (torch.Generator, optional): RNG for the sample. Default: None (global RNG).
        tempered (bool): score from softmax(logits / T) when T > 0 (Dream) instead of
            softmax(logits) (LLaDA). Default: False.

    Returns:
        Signals: each field [B, R].
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    x = logits.float()
    if temperature > 0:
        # Gumbel-max samples softmax(x / T); LLaDA's float64 exp(l) / (-log U)^T is the same law
        noisy = x / temperature + gumbel_noise(x.shape, device=x.device, generator=generator)
        proposal = noisy.argmax(dim=-1)
        del noisy
    else:
        proposal = x.argmax(dim=-1)
    s = x / temperature if (tempered and temperature > 0) else x
    # shift by the max: d <= 0 and z in [1, V] keep the entropy within ~1 ulp of a float64 reference
    # (an unshifted s - logsumexp(s) loses ~10x that at V = 126k)
    top = s.topk(min(2, s.shape[-1]), dim=-1).values
    m = top[..., :1]
    d = s - m
    q = d.exp()
    z = q.sum(dim=-1)
    # q = 0 where the logit is -inf: 0 * -inf would be nan, the limit is 0
    neg_entropy = torch.where(q > 0, q * d, 0.0).sum(dim=-1) / z - z.log()
    del q
    confidence = d.gather(-1, proposal.unsqueeze(-1)).squeeze(-1).exp() / z
    p2 = (top[..., 1] - m[..., 0]).exp() / z if top.shape[-1] > 1 else torch.zeros_like(z)
    margin = 1 / z - p2
    if eos_id is None:
        eos_prob = torch.zeros_like(confidence)
    else:
        eos_prob = d[..., eos_id].exp() / z
    return Signals(proposal, confidence, margin, neg_entropy, eos_prob)


def apply_cfg(cond_logits: torch.Tensor, uncond_logits: torch.Tensor, scale: float) -> torch.Tensor:
    """LLaDA classifier-free guidance: ``un + (scale + 1) * (cond - un)``.

    Args:
        cond_logits (torch.Tensor): [..., V] logits with the prompt.
        uncond_logits (torch.Tensor): [..., V] logits with the prompt positions masked.
        scale (float): LLaDA's ``cfg_scale``; 0 returns ``cond_logits`` unchanged.
    """
    if scale == 0:
        return cond_logits
    return uncond_logits + (scale + 1) * (cond_logits - uncond_logits)


def filter_top_p_top_k(
    logits: torch.Tensor, *, top_p: float | None = None, top_k: int | None = None, temperature: float = 0.0
) -> torch.Tensor:
    """Dream's top-p then top-k filter: removed entries become ``finfo.min``.

    Dream applies it to logits / T (even at T = 0, then to the raw logits); the masks here are
    computed on that tempered view but the returned logits stay untempered, so they go straight
    into :func:`compute_signals` with the same temperature.

    Args:
        logits (torch.Tensor): [..., V].
        top_p (float, optional): keep the smallest prefix of cumulative probability > top_p
            (the first token always). None or >= 1 disables it. Default: None.
        top_k (int, optional): keep entries >= the k-th largest. Default: None.
        temperature (float): Dream's temperature. Default: 0.0.
    """
    fill = torch.finfo(logits.dtype).min
    view = logits / temperature if temperature > 0 else logits
    if top_p is not None and top_p < 1:
        sorted_logits, order = view.sort(dim=-1, descending=True)
        cum = sorted_logits.float().softmax(dim=-1).cumsum(dim=-1)
        remove = cum > top_p
        # shift right so the token that crosses top_p is kept (Dream's top_p_logits)
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        mask = torch.zeros_like(remove).scatter_(-1, order, remove)
        logits, view = logits.masked_fill(mask, fill), view.masked_fill(mask, fill)
    if top_k is not None:
        kth = view.topk(min(top_k, view.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(view < kth, fill)
    return logits
