"""LLaDA's ``generate(model, prompt, steps, gen_length, block_length, temperature, cfg_scale, remasking)`` for scripts
ported from LLaDA: the same arguments and return value (the canvas ``x``, prompt included), decoded by
`tracelock.fused_generate` with the policy the arguments name. ``from tracelock.llada import generate``.
"""

import torch

__all__ = ["generate"]

REMASKING = {"low_confidence": "confidence", "random": "random"}


def generate(model, prompt, attention_mask=None, steps: int = 128, gen_length: int = 128, block_length: int = 128,
             temperature: float = 0.0, cfg_scale: float = 0.0, remasking: str = "low_confidence", mask_id=None,
             seed: int = 0) -> torch.Tensor:
    """LLaDA's generate: ``steps`` steps in all, split evenly over the blocks of ``block_length``; each step commits
    LLaDA's scheduled count of the masked positions of the current block, the most confident (``low_confidence``) or
    random ones (``random``). The same tokens as LLaDA's reference code greedy (sampling draws from the same
    distribution with other random numbers).

    Args:
        model: a `tracelock.load_model` backbone (or a module `tracelock.load_model` accepts).
        prompt (torch.LongTensor): [B, P] token ids (left-padded with ``attention_mask`` when rows differ), or a list
            of token-id lists.
        attention_mask: [B, P], 0 on left padding. Default: None.
        steps, gen_length, block_length, temperature, cfg_scale: LLaDA's (``gen_length`` divisible by
            ``block_length``, ``steps`` by the number of blocks).
        remasking (str): "low_confidence" or "random".
        mask_id (int, optional): the checkpoint's mask id is read from its config; a different one is refused.
        seed (int): seed of sampling and of ``random``. Default: 0.

    Returns:
        torch.LongTensor: [B, P + gen_length], LLaDA's ``x``.
    """
    from tracelock.generate import fused_generate

    if remasking not in REMASKING:
        raise ValueError(f"remasking={remasking!r} must be 'low_confidence' or 'random' (LLaDA's two)")
    spec = getattr(model, "spec", None)
    if mask_id is not None and spec is not None and mask_id != spec.mask_id:
        raise ValueError(f"mask_id={mask_id} but the checkpoint's mask id is {spec.mask_id}; leave mask_id out (it "
                         "is read from the checkpoint's config)")
    if isinstance(block_length, int) and isinstance(gen_length, int) and block_length > 0 \
            and gen_length % block_length:
        raise ValueError(f"gen_length={gen_length} must be a multiple of block_length={block_length} (LLaDA asserts "
                         "gen_length % block_length == 0)")
    tokens, _ = fused_generate(model, prompt, attention_mask=attention_mask, policy=REMASKING[remasking],
                               policy_args={"steps": steps}, gen_length=gen_length,
                               block=None if block_length == gen_length else block_length, temperature=temperature,
                               cfg_scale=cfg_scale, seed=seed)
    return tokens
