"""The interface every decoding policy implements, rule-based or learned, plus the selection helpers they share.

A step hands a policy the signals of R candidate slots per row (the commit region: a semi-AR block or
the soft-crop window, padded across rows) and the counters of the *schedule region* (the block, or the
whole generation for window/full schedules). The policy returns a [B, R] commit mask, a subset of the
active slots. Everything stays on the device: no host sync.

Ties between equal scores always go to the lowest slot index (as ``torch.argmax``); the upstream
``torch.topk`` calls leave that order unspecified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..signals import Signals, gumbel_noise

__all__ = ["CommitRule", "Lookahead", "Policy", "StepInput", "active_first_order", "check_flags", "first_token_form",
           "gumbel_topk_mask", "held_ends", "topk_mask"]


@dataclass
class Lookahead:
    """The signals of the generation positions right of the commit region, for a policy with ``eot_lookahead``
    (Learn2PD's end-of-text prediction reads every masked position's proposal). Slots hold the canvas positions
    ``[hi, hi + W)`` of each row's region end ``hi``; slots past the canvas repeat its last position and are inactive.

    Args:
        signals (Signals): [B, W] each.
        active (torch.BoolTensor): [B, W] the slot is an active (masked) position.
        positions (torch.LongTensor): [B, W] canvas position of each slot.
    """

    signals: Signals
    active: torch.Tensor
    positions: torch.Tensor


@dataclass
class StepInput:
    """What the loop hands a policy at one step, for the B rows being decoded.

    Args:
        signals (Signals): [B, R] each; R = candidate slots (commit region, padded across rows).
        active (torch.BoolTensor): [B, R] the slot is an active position inside the commit region.
        region_step (torch.LongTensor): [B] forwards already spent in the current schedule region
            (0 on its first step).
        region_initial (torch.LongTensor): [B] active positions in the schedule region when it began
            (LLaDA's M).
        region_active (torch.LongTensor): [B] active positions in the schedule region now (Dream's n).
        steps_per_region (int): the policy's step budget per schedule region.
        positions (torch.LongTensor): [B, R] canvas position of each slot (slots past the region repeat
            the last position and are inactive).
        state (torch.Tensor): [B, L] uint8 position states before this step's commits.
        rows (torch.LongTensor): [B] index of each row in the caller's batch (finished rows drop out).
        taps (tuple, optional): only for policies with ``needs_taps``: h_{n-2}, h_{n-1}, norm_f(h_n), each
            [B, T, D], for canvas positions [0, T) with T the furthest region end (the family's shift applied).
            None when ``tap_inputs`` replaces them.
        tap_inputs (torch.Tensor, optional): [B, T, width] the taps of the same positions already folded into
            the policy's inputs with its :meth:`Policy.tap_fold` (the fused loop has the backbone forward run
            `tracelock.ops.tap_project`); None on the reference path.
        attention_mask (torch.BoolTensor, optional): [B, L] False at left padding; None when no row is padded.
        lookahead (Lookahead, optional): only for policies with ``eot_lookahead`` or ``memory_lookahead``: the
            positions right of the region (None under a dual KV cache, which recomputes the region only).
        vocab (dict, optional): only for policies that read the vocabulary (``reads_vocab``): what their
            :meth:`Policy.vocab_pass` returned for this step, [B, R] each (the region's slots).
    """

    signals: Signals
    active: torch.Tensor
    region_step: torch.Tensor
    region_initial: torch.Tensor
    region_active: torch.Tensor
    steps_per_region: int
    positions: torch.Tensor | None = None
    state: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    taps: tuple | None = None
    attention_mask: torch.Tensor | None = None
    tap_inputs: torch.Tensor | None = None
    lookahead: Lookahead | None = None
    vocab: dict | None = None


@dataclass
class CommitRule:
    """A step's commits as the inputs of `tracelock.ops.commit_step` (spec: ``kernels.ref.commit_step_ref``): slots
    with ``sigmoid(score - tau) > theta`` (``>=`` when ``inclusive``) commit, at most ``cap`` (0: no cap), else the
    best by ``fallback_score`` (None: the margin), never a ``held`` slot.

    Args:
        score (torch.Tensor): [B, R] per-slot score.
        tau (torch.Tensor): [B] per-row threshold logit.
        theta (float): commit probability threshold.
        cap (int): most commits per row and step; 0 = no cap.
        fallback_score (torch.Tensor, optional): [B, R] what the fallback maximises; None: the margin.
        held (torch.Tensor, optional): [B, R] bool slots kept masked this step; None: none.
        inclusive (bool): ``>=`` instead of ``>``.
    """

    score: torch.Tensor
    tau: torch.Tensor
    theta: float
    cap: int = 0
    fallback_score: torch.Tensor | None = None
    held: torch.Tensor | None = None
    inclusive: bool = False


class Policy:
    """Base class of the decoding policies.

    Subclasses set ``name`` and ``deterministic`` and implement :meth:`select`. ``setup`` runs once per
    generation, before the first step; schedule-based policies derive their per-region budget there.
    """

    name: ClassVar[str] = ""
    deterministic: ClassVar[bool] = True
    # learned policies (TraceLock, L2P-Hidden) set this to receive the hidden-state taps in StepInput
    needs_taps: ClassVar[bool] = False
    # built from a trained checkpoint (TraceLock's controller, Learn2PD's filters): `make_policy(name)` alone fails
    learned: ClassVar[bool] = False
    # end-of-text prediction (Learn2PD's EoTP): the policy reads the signals right of the commit region
    # (StepInput.lookahead) and its `decide` may truncate the canvas
    eot_lookahead: ClassVar[bool] = False
    # rules that remember across steps (CreditDecoding, KLASS, LESS): they read each slot's whole distribution in
    # `vocab_pass`, which also updates their per-slot memory (`memory_spec`); a rule without it pays nothing
    reads_vocab: ClassVar[bool] = False
    # KLASS: the memory also covers the next region's slots (one region width right of it), so a region starts with
    # the history its positions gathered while the region before it was decoded
    memory_lookahead: ClassVar[bool] = False

    def __init__(self) -> None:
        self._steps_per_region: int | None = None

    @classmethod
    def deterministic_with(cls, **kwargs) -> bool:
        """Whether the policy built with these arguments is deterministic, read without building it (which for a
        learned policy loads a checkpoint)."""
        return cls.deterministic

    def setup(self, *, gen_length: int, num_regions: int) -> None:
        """Validate against the schedule and precompute.

        Args:
            gen_length (int): generated positions.
            num_regions (int): semi-AR blocks (``gen_length // block_length``); 1 for window/full.
        """
        if gen_length <= 0 or num_regions <= 0 or gen_length % num_regions:
            raise ValueError(
                f"gen_length={gen_length} must split into num_regions={num_regions} equal regions; "
                "pass a block length that divides gen_length"
            )
        # schedule-free policies commit at least one active slot per step: the region size bounds them
        self._steps_per_region = gen_length // num_regions

    def steps_per_region(self) -> int:
        """Step budget per schedule region (valid after :meth:`setup`)."""
        if self._steps_per_region is None:
            raise RuntimeError(f"policy {self.name!r}: call setup(gen_length=..., num_regions=...) first")
        return self._steps_per_region

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        """Commit mask of one step.

        Args:
            inp (StepInput): signals and counters of the B rows.
            generator (torch.Generator, optional): RNG of the stochastic policies. Default: None.

        Returns:
            torch.BoolTensor: [B, R], a subset of ``inp.active``.
        """
        raise NotImplementedError

    def decide(self, inp: StepInput, generator: torch.Generator | None = None):
        """``(chosen [B, R], cut)``: the commit mask (:meth:`select`) and, for a policy that truncates the canvas
        (Learn2PD's end-of-text prediction), ``cut`` [B] the last canvas position each row keeps (the canvas length
        L for none); None (the default) when the policy never truncates."""
        return self.select(inp, generator), None

    def commit_rule(self, inp: StepInput) -> CommitRule | None:
        """The step's `CommitRule` when this policy's commits are `tracelock.ops.commit_step`'s rule (the fused loop
        and the engine then close the step with that op, on the device, and :meth:`select` must be
        ``kernels.ref.commit_select_ref`` of the same rule); None (the default) when :meth:`select` decides."""
        return None

    def memory_spec(self, *, width: int, spec) -> dict:
        """{name: (shape, dtype)} of the per-row buffers this rule keeps across steps, each [rows, *shape], zero at a
        row's start; ``width`` is the slots they cover (the region's, plus the next region's with
        ``memory_lookahead``), ``spec`` the backbone's `tracelock.models.spec.ModelSpec`. {} (the default): none."""
        return {}

    def vocab_fields(self) -> dict:
        """{name: dtype} of the per-slot outputs of :meth:`vocab_pass` (an engine keeps a buffer for each)."""
        return {}

    def vocab_pass(self, ops, logits: torch.Tensor, memory: dict, active: torch.Tensor, fresh: torch.Tensor,
                   width: int) -> dict:
        """The rule's pass over the vocabulary, once per step, before :meth:`select`: update ``memory`` in place and
        return the per-slot values :meth:`select` reads (``StepInput.vocab``). An output named ``proposal`` (and
        ``confidence``) replaces the step's proposal (its confidence): CreditDecoding proposes from its fused logits.

        Args:
            ops: the decode's op set (`tracelock.ops.OpSet`; the spec set on the reference path): ``credit_fuse``,
                ``step_kl``, ``topk_js``.
            logits (torch.Tensor): [b, W, V] the logits of the memory's slots (W = ``width`` of `memory_spec`).
            memory (dict): the rows' buffers, [b, W, ...] each.
            active (torch.BoolTensor): [b, W] the slot is a masked position of its region.
            fresh (torch.BoolTensor): [b] this is the region's first step (its memory starts over).
            width (int): the commit region's slots, the first of the W (the rest are the next region's).
        """
        raise NotImplementedError

    def tap_fold(self, model) -> tuple | None:
        """``(A [3, D, N], c [N])`` when this policy reads its taps only as ``h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c``:
        the fused loop then has ``model``'s forward fold them with `tracelock.ops.tap_project` and hands the
        step ``StepInput.tap_inputs`` instead of the taps. None (the default): the policy reads
        ``StepInput.taps``."""
        return None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def check_steps(steps: int | None) -> None:
    """Reject a non-positive or non-integer step count early, naming the argument."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
        raise ValueError(f"steps={steps!r} must be a positive int (or None for steps = gen_length)")


def split_steps(steps: int | None, gen_length: int, num_regions: int) -> int:
    """Per-region budget S = steps // num_regions, with LLaDA's exact-division assert as an error."""
    steps = gen_length if steps is None else steps
    if steps % num_regions:
        fix = num_regions * max(1, round(steps / num_regions))
        raise ValueError(
            f"steps={steps} is not a multiple of num_regions={num_regions}: LLaDA asserts "
            f"steps % num_blocks == 0; pass steps={fix} (a multiple of {num_regions}) or a "
            f"block length such that gen_length // block_length divides {steps}"
        )
    return steps // num_regions


def held_ends(inp: StepInput) -> torch.Tensor:
    """[B, R] active slots that propose the end token (its probability is the largest) while an active slot left
    of them proposes text: what a policy's ``hold_end`` keeps masked. Slots are in position order, so the leftmost
    active slot is never held."""
    ends = inp.active & (inp.signals.eos_prob >= inp.signals.confidence) & (inp.signals.eos_prob > 0)
    text = inp.active & ~ends
    return ends & (text.cumsum(dim=1) > 0)


def first_token_form(inp: StepInput, chosen: torch.Tensor) -> torch.Tensor:
    """``chosen`` [B, R], except at a region's first step, which commits only the region's first masked position:
    the Dream form of a rule (Fast-dLLM's Dream sampler runs that step as its cache refresh). Slots run left to
    right, so the first active slot is that position."""
    leftmost = inp.active & (inp.active.cumsum(dim=-1) == 1)
    return torch.where((inp.region_step == 0).unsqueeze(-1), leftmost, chosen)


def check_flags(**flags) -> None:
    """``first_token`` and ``hold_end`` (and any other flag) must be bools; the error says what each does."""
    what = {"first_token": "True: the Dream form, a region's first step commits its first masked position",
            "hold_end": "True: hold end-of-text behind the text"}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be a bool ({what.get(name, 'true or false')})")


def active_first_order(scores: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """[B, R] slot indices: active slots first, by descending score, ties to the lowest index."""
    # two stable sorts: by score, then by activeness, so an active -inf score still beats padding
    by_score = scores.argsort(dim=-1, descending=True, stable=True)
    by_active = active.gather(-1, by_score).to(torch.uint8).argsort(dim=-1, descending=True, stable=True)
    return by_score.gather(-1, by_active)


def topk_mask(scores: torch.Tensor, active: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Commit the ``k[b]`` best active slots of each row.

    Args:
        scores (torch.Tensor): [B, R] higher = better.
        active (torch.BoolTensor): [B, R].
        k (torch.LongTensor): [B] per-row count, clamped to the row's active count.

    Returns:
        torch.BoolTensor: [B, R].
    """
    order = active_first_order(scores, active)
    # the inverse permutation: rank of each slot in that order
    ranks = order.argsort(dim=-1)
    return active & (ranks < k.unsqueeze(-1))


def gumbel_topk_mask(
    scores: torch.Tensor, active: torch.Tensor, k: torch.Tensor, temp: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Sample ``k[b]`` active slots without replacement from softmax(scores / temp).

    Gumbel-top-k has the law of sequential ``torch.multinomial(..., replacement=False)`` (Dream's
    ``alg_temp`` path) and stays in log space, so tiny probabilities cannot underflow into an error.
    """
    noisy = scores.float() / temp + gumbel_noise(scores.shape, device=scores.device, generator=generator)
    return topk_mask(noisy, active, k)


def active_count(active: torch.Tensor) -> torch.Tensor:
    """[B] active candidates per row."""
    return active.sum(dim=-1)
