"""Where a step may commit (the commit region) and what a step schedule counts (the schedule region).

Three schedules (docs/design.md, "Data flow"), each usable with every policy:
- ``block=N``: semi-AR blocks of N positions. A block ends as soon as it has no active position; with
  ``idle_steps=True`` it ends only when the step counter also reaches the block's budget (the reference
  release's ``block = step // steps_per_block`` artifact: floor (num_blocks - 1) * steps_per_block + 1).
- ``window=W``: the soft-crop window ``[p_t, p_t + W)`` with ``p_t`` the row's first active position.
- neither: the full generation region.
For the window and full schedules the schedule region (what LLaDA's and Dream's step schedules count)
is the whole generation; for blocks it is the block.
"""

from dataclasses import dataclass

import torch

from tracelock import states


def validate_schedule(gen_length, block, window, idle_steps: bool = False) -> None:
    if isinstance(gen_length, bool) or not isinstance(gen_length, int) or gen_length <= 0:
        raise ValueError(f"gen_length={gen_length!r} must be a positive int (the number of positions to generate)")
    if block is not None and window is not None:
        raise ValueError(f"pass block={block} or window={window}, not both: blocks are semi-AR, the window slides")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or not 0 < window <= gen_length):
        raise ValueError(f"window={window!r} must be an int in [1, gen_length={gen_length}]; "
                         f"window=gen_length decodes the full region")
    if block is not None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 < block <= gen_length:
            raise ValueError(f"block={block!r} must be an int in [1, gen_length={gen_length}]")
        if gen_length % block:
            # the fixes nearest to what was asked: a block near it, a generation length that it tiles, or a window
            divisors = sorted((d for d in range(2, gen_length + 1) if gen_length % d == 0),
                              key=lambda d: (abs(d - block), d))[:3] or [gen_length]
            longer = -(-gen_length // block) * block
            raise ValueError(f"block={block} does not divide gen_length={gen_length}: semi-AR blocks must tile the "
                             f"generation (LLaDA asserts gen_length % block_length == 0); use block="
                             f"{' or '.join(map(str, sorted(divisors)))} (divisors of {gen_length}), gen_length="
                             f"{longer} (a multiple of {block}), or window={block} for a sliding window")
    if idle_steps and block is None:
        raise ValueError("idle_steps=True reproduces the reference release's semi-AR block artifact; it needs block=N")


@dataclass
class RowCounters:
    """Per-row schedule state, [B] each."""

    block_idx: torch.Tensor
    region_step: torch.Tensor
    region_initial: torch.Tensor
    steps: torch.Tensor  # forwards spent on the row so far

    def take(self, rows: torch.Tensor) -> "RowCounters":
        """The counters of ``rows`` (copies)."""
        return RowCounters(self.block_idx[rows], self.region_step[rows], self.region_initial[rows], self.steps[rows])


class Schedule:
    def __init__(self, gen_length: int, block: int | None, window: int | None, idle_steps: bool,
                 skip_finished_blocks):
        validate_schedule(gen_length, block, window, idle_steps)
        self.gen_length, self.block, self.window, self.idle_steps = gen_length, block, window, idle_steps
        # `ops.skip_finished_blocks`, its spec, or the engine's loop-free form of it
        self.skip_finished_blocks = skip_finished_blocks
        self.kind = "block" if block else "window" if window else "full"
        self.num_regions = gen_length // block if block else 1
        self.width = block or window or gen_length  # R: candidate slots per row

    def bind(self, prompt_len: int, steps_per_region: int) -> None:
        """Fix the canvas layout (the generation starts at ``prompt_len``) and the policy's step budget."""
        self.prompt_len, self.steps_per_region = prompt_len, steps_per_region

    def start(self, state: torch.Tensor, prompt_len: int, steps_per_region: int) -> RowCounters:
        self.bind(prompt_len, steps_per_region)
        B = state.shape[0]
        zeros = torch.zeros(B, dtype=torch.long, device=state.device)
        c = RowCounters(block_idx=zeros.clone(), region_step=zeros.clone(), region_initial=zeros.clone(),
                        steps=zeros.clone())
        c.region_initial = self.region_active(state, c.block_idx)
        self._leave_finished_blocks(state, c, torch.ones(B, dtype=torch.bool, device=state.device))
        return c

    def admit(self, c: RowCounters, row: int) -> None:
        """Restart ``row``'s counters for a new prompt (an engine's slot): the first block, or the whole generation,
        every position of it active (LLaDA's M)."""
        c.block_idx[row] = c.region_step[row] = c.steps[row] = 0
        c.region_initial[row] = self.block if self.kind == "block" else self.gen_length

    def schedule_bounds(self, block_idx: torch.Tensor):
        if self.kind == "block":
            lo = self.prompt_len + block_idx * self.block
            return lo, lo + self.block
        lo = torch.full_like(block_idx, self.prompt_len)
        return lo, lo + self.gen_length

    def commit_bounds(self, block_idx: torch.Tensor, first_active: torch.Tensor):
        """[lo, hi) per row: the block, the window from the first active position, or the full region."""
        if self.kind == "window":
            end = self.prompt_len + self.gen_length
            lo = first_active.clamp(max=end)
            return lo, (lo + self.window).clamp(max=end)
        return self.schedule_bounds(block_idx)

    def _count_active(self, state, lo, hi):
        pos = torch.arange(state.shape[1], device=state.device)
        inside = (pos >= lo[:, None]) & (pos < hi[:, None])
        return ((state == states.ACTIVE) & inside).sum(dim=1)

    def region_active(self, state, block_idx):
        """[B] active positions in each row's schedule region now (Dream's n)."""
        return self._count_active(state, *self.schedule_bounds(block_idx))

    def _leave_finished_blocks(self, state, c: RowCounters, rows):
        """Move the given rows past blocks that have no active position left (several if stop-at-EOT filled them)."""
        if self.kind == "block":
            self.skip_finished_blocks(state, c.block_idx, c.region_step, c.region_initial, c.steps, rows,
                                      self.prompt_len, self.block, self.num_regions, self.steps_per_region,
                                      self.idle_steps)

    def advance(self, state: torch.Tensor, c: RowCounters, rows: torch.Tensor) -> None:
        """After a step on ``rows`` [B] bool: count it, and end the blocks that are finished."""
        c.steps += rows.long()
        c.region_step += rows.long()
        self._leave_finished_blocks(state, c, rows)
