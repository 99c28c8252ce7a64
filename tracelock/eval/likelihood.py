"""Log-likelihood of a continuation under a masked diffusion LM: LLaDA's Monte-Carlo estimate.

A masked diffusion model has no left-to-right factorisation, so ``log p(target | prefix)`` is not a sum of
next-token terms. LLaDA (Nie et al. 2025, eq. 6 and appendix) evaluates likelihood tasks with a Monte-Carlo
estimate of its training bound: draw a mask count ``l`` uniformly from ``1..T`` (T = target length), mask ``l``
target positions uniformly at random, and score the masked ones given the prefix and the unmasked rest:

    log p(target | prefix)  >=  E_l E_mask [ (T / l) * sum_{i masked} log p(target_i | prefix, target with mask) ]

The right side is what this module estimates. As in LLaDA's evaluation code, the mask counts of one batch are
stratified (evenly spread over ``1..T`` from a random start), which lowers the variance. For ``T = 1`` the
estimate is exact: the one target token is always masked.
"""

import torch
import torch.nn.functional as F


def _mask_counts(T: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """[rows] mask counts in 1..T, evenly spread from a random start (LLaDA's stratified draw)."""
    start = int(torch.randint(1, T + 1, (), generator=generator))
    spread = torch.round(torch.linspace(start, start + (rows - 1) * T / rows, rows)).long()
    return (spread - 1) % T + 1


@torch.no_grad()
def masked_loglikelihood(model, prefix: list, target: list, *, samples: int = 128, batch_size: int = 32,
                         seed: int = 0) -> float:
    """LLaDA's Monte-Carlo estimate of ``log p(target | prefix)`` (a lower bound; see the module docstring).

    Args:
        model: a `tracelock.load_model` backbone (LLaDA or Dream; Dream's logit shift is applied by its spec).
        prefix (list): token ids of the context (at least one).
        target (list): token ids of the continuation (at least one).
        samples (int): Monte-Carlo draws (masked copies of the target). Default: 128 (LLaDA's ``mc_num``).
        batch_size (int): draws per forward; ``samples`` must be a multiple of it. Default: 32.
        seed (int): seed of the draws; the estimate of one (prefix, target) depends on nothing else. Default: 0.

    Returns:
        float: the estimated log-likelihood in nats.
    """
    if not prefix or not target:
        raise ValueError(f"prefix ({len(prefix)} tokens) and target ({len(target)} tokens) must both be non-empty")
    if batch_size < 1 or samples < batch_size or samples % batch_size:
        raise ValueError(f"samples={samples} must be a positive multiple of batch_size={batch_size}")
    spec, device = model.spec, model.device
    if spec.mask_id in target or spec.mask_id in prefix:
        raise ValueError(f"the text contains the mask token (id {spec.mask_id}); it cannot be scored")
    P, T = len(prefix), len(target)
    if P + T > spec.max_positions:
        raise ValueError(f"context ({P} tokens) + continuation ({T}) exceed the model's {spec.max_positions} "
                         "positions; shorten the context")
    generator = torch.Generator().manual_seed(seed)
    seq = torch.tensor(prefix + target, dtype=torch.long)
    goal = torch.tensor(target, dtype=torch.long, device=device)
    positions = torch.arange(P, P + T, device=device).expand(batch_size, T)
    total = 0.0
    for _ in range(samples // batch_size):
        counts = _mask_counts(T, batch_size, generator)
        # a random permutation per row; its first `count` target positions are masked
        order = torch.rand(batch_size, T, generator=generator).argsort(dim=1)
        masked = order < counts[:, None]
        x = seq.repeat(batch_size, 1)
        x[:, P:] = torch.where(masked, spec.mask_id, x[:, P:])
        logits = model.predict(x.to(device), positions).logits.float()  # [b, T, V]
        logp = F.log_softmax(logits, dim=-1).gather(2, goal.expand(batch_size, T)[..., None])[..., 0]
        masked = masked.to(device)
        weight = T / counts.to(device).float()  # 1 / (share of the target that is masked)
        total += float(((logp * masked).sum(1) * weight).sum())
    return total / samples


@torch.no_grad()
def greedy_matches(model, prefix: list, target: list) -> bool:
    """Whether decoding ``len(target)`` positions after ``prefix``, one token per step by confidence over the
    whole region (LLaDA's greedy check), reproduces ``target``."""
    from tracelock.generate import fused_generate

    tokens, _ = fused_generate(model, [prefix], policy="confidence", gen_length=len(target))
    return tokens[0, len(prefix):].tolist() == list(target)
