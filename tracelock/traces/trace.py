"""The canonical trace: one decoded row as tokens only, from which any recorded step can be rebuilt.

A committed position never changes again, so the whole history of the canvas is the final tokens plus the
step at which each generation position was committed: at step t, position p holds ``final[p]`` if
``commit_step[p] < t`` and the mask token otherwise. With the proposals of the recorded steps (and, if asked,
their confidences) that is everything training needs; hidden-state features are recomputed by replaying the
frozen backbone on ``x_at(t)`` (`tracelock featurize`). A trace of 64 generated tokens is a few kilobytes.

Step t is the row's t-th forward (0-based); ``x_at(t)`` and ``state_at(t)`` are the canvas *before* that
step's commits, i.e. what the backbone saw at step t.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracelock import states

NO_PROPOSAL = -1  # proposals outside the step's commit region (or at committed positions)


@dataclass
class Trace:
    """One decoded row.

    Args:
        prompt (np.ndarray): [P] int32 prompt tokens, no padding.
        final (np.ndarray): [G] int32 final tokens of the generation region.
        final_state (np.ndarray): [G] uint8 `tracelock.states` LOCKED or EOT of each position once committed.
        commit_step (np.ndarray): [G] int32 step at which each position was committed.
        steps (np.ndarray): [S] int32 recorded step indices, increasing; the first and last step always included.
        proposals (np.ndarray): [S, G] int32 the backbone's proposal (argmax) at each recorded step, for the
            positions of that step's commit region; `NO_PROPOSAL` elsewhere.
        confidence (np.ndarray, optional): [S, G] float16 max-prob of the proposals (NaN where none), if asked.
        mask_id (int): the model's mask token (to rebuild x_t).
        num_steps (int): forwards the row took.
        meta (dict): JSON-able settings and provenance: policy, schedule, seed, model fingerprint, task, item id...
    """

    prompt: np.ndarray
    final: np.ndarray
    final_state: np.ndarray
    commit_step: np.ndarray
    steps: np.ndarray
    proposals: np.ndarray
    mask_id: int
    num_steps: int
    confidence: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def gen_length(self) -> int:
        return len(self.final)

    def x_at(self, step: int) -> np.ndarray:
        """[P + G] int64 canvas the backbone saw at ``step`` (before that step's commits)."""
        gen = np.where(self.commit_step < step, self.final, self.mask_id)
        return np.concatenate([self.prompt, gen]).astype(np.int64)

    def state_at(self, step: int) -> np.ndarray:
        """[P + G] uint8 position states at ``step`` (before that step's commits)."""
        gen = np.where(self.commit_step < step, self.final_state, states.ACTIVE).astype(np.uint8)
        return np.concatenate([np.full(len(self.prompt), states.PROMPT, np.uint8), gen])

    def labels(self, proposals: np.ndarray | None = None) -> np.ndarray:
        """[S, G] int8 future-stability labels: 1 where the proposal already equals the final token, 0 where it
        differs, -1 where there is no proposal. Pass replayed full-region proposals to label every position."""
        props = self.proposals if proposals is None else proposals
        return np.where(props == NO_PROPOSAL, -1, (props == self.final[None]).astype(np.int8)).astype(np.int8)

    def final_is_eot(self) -> np.ndarray:
        """[G] bool positions whose final token is an end/pad token (the loss's eot category)."""
        return self.final_state == states.EOT
