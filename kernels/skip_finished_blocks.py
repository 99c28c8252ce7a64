# Copyright (c) 2025 the tracelock authors.
# The torch implementation of skip_finished_blocks: its spec (skip_finished_blocks_ref) without the data-dependent
# loop and its host sync, so a CUDA graph or a compiled step can hold it. One pass: count each block's ACTIVE
# positions ([B, num_regions]), then every selected row jumps to the first block, at or after its own, that it may
# not skip, which is where the spec's one-block-at-a-time loop stops. Reads B·num_regions·block bytes of state,
# writes 3·B int64 counters.

import torch

from tracelock.states import ACTIVE


def skip_finished_blocks_torch(state, block_idx, region_step, region_initial, steps, rows, prompt_len: int,
                               block: int, num_regions: int, steps_per_block: int, idle_steps: bool) -> None:
    """Same contract as ``skip_finished_blocks_ref`` (in place; inputs validated by ``tracelock.ops``)."""
    P, b = prompt_len, state.shape[0]
    counts = (state[:, P:P + num_regions * block] == ACTIVE).reshape(b, num_regions, block).sum(-1)
    j = torch.arange(num_regions, device=state.device)
    # a skippable block is empty, not the last, and with idle_steps has seen its step budget spent
    skippable = (counts == 0) & (j < num_regions - 1)
    if idle_steps:
        skippable &= steps[:, None] >= (j + 1) * steps_per_block
    stop = (j >= block_idx[:, None]) & ~skippable  # true at the last block at the latest
    new = stop.to(torch.uint8).argmax(1)
    moved = rows & (new != block_idx)
    region_step.copy_(torch.where(moved, 0, region_step))
    region_initial.copy_(torch.where(moved, counts.gather(1, new[:, None]).squeeze(1), region_initial))
    block_idx.copy_(torch.where(moved, new, block_idx))
