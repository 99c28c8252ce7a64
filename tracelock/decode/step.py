"""The verbs of one decoding step, written once for both drivers (docs/design.md, "A step").

A step of a set of rows is: `commit_region` (where it may commit) -> `forward_rows` (the backbone at the region's
slots) -> `step_signals` -> `step_input` (what the policy reads) -> `close_step` (the policy's rule or decision,
the commits, the end-of-text cut) -> the schedule's advance. `tracelock.decode.loop.run_decode` (the eager loop)
calls these on the live rows with host-side control flow; `tracelock.decode.engine.DecodeEngine` calls the same
ones on every slot inside its static-shape graphs. `DecodeStats` is what both report.
"""

import time
from dataclasses import dataclass, field

import torch

from tracelock import states
from tracelock.decode.canvas import Canvas, truncate_after
from tracelock.decode.context import RunContext
from tracelock.decode.schedule import RowCounters, Schedule
from tracelock.models.query import CacheQuery, Outputs
from tracelock.policies.base import Lookahead, Policy, StepInput
from tracelock.signals import Signals, apply_cfg, compute_signals, filter_top_p_top_k


@dataclass
class DecodeStats:
    """What a decoding run cost. A step is one backbone forward (NFE) of a row."""

    steps: list  # [B] forwards spent on each row
    # batched forward calls of the run (an engine slot's `result` reports the row's steps: what the row decoded
    # alone would run)
    forwards: int
    commits_per_step: list  # [B] lists: tokens committed at each of the row's steps
    seconds: float  # wall-clock of the whole run
    gen_lengths: list  # [B] generated tokens before the first end token
    refreshes: list = field(default_factory=list)  # [B] KV-cache refresh forwards among each row's steps
    settings: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return sum(self.gen_lengths) / self.seconds if self.seconds > 0 else float("nan")


def vocab_pass(ctx: RunContext, head, memory: dict, region: "Region", state, region_step) -> dict:
    """The rule's `Policy.vocab_pass` on a forward's logits ``head`` [b, W, V] of the rows whose canvas states are
    ``state`` [b, L]: their ``memory`` ([b, W, ...] each) is updated in place; returns its per-slot outputs [b, W]."""
    query = region.query()
    active = state.gather(1, query) == states.ACTIVE
    active[:, :region.valid.shape[1]] &= region.valid
    if region.tail_inside is not None:
        active[:, region.valid.shape[1]:] &= region.tail_inside
    return ctx.policy.vocab_pass(ctx.ops, head, memory, active, region_step == 0, region.valid.shape[1])


def with_vocab(signals: Signals, vocab: dict | None) -> Signals:
    """The step's signals with a rule's own ``proposal`` / ``confidence`` / ``eos_prob`` from its vocabulary pass
    (CreditDecoding's fused logits) in place of the logits' own."""
    if not vocab or "proposal" not in vocab:
        return signals
    return Signals(vocab["proposal"], vocab.get("confidence", signals.confidence), signals.margin,
                   signals.neg_entropy, vocab.get("eos_prob", signals.eos_prob))


def step_budget(schedule: Schedule, steps_per_region: int) -> int:
    """The steps a row may take: a policy that never commits would loop forever, and every shipped policy
    finishes within this."""
    return 2 * (schedule.gen_length + schedule.num_regions * steps_per_region) + 8


def budget_error(policy: Policy, steps: int) -> RuntimeError:
    return RuntimeError(f"policy {policy!r} left positions uncommitted after {steps} steps; "
                        "a policy must commit at least one active position within its step budget")


@dataclass
class Region:
    """The commit region of b rows, [lo, hi), as R candidate slots; with end-of-text lookahead also the positions
    right of it."""

    lo: torch.Tensor  # [b]
    hi: torch.Tensor  # [b]
    positions: torch.Tensor  # [b, R] lo + slot (may pass hi)
    valid: torch.Tensor  # [b, R] the slot lies inside [lo, hi)
    gather: torch.Tensor  # [b, R] positions clamped into the canvas: where the slot reads
    tail: torch.Tensor | None = None  # [b, lookahead] positions from hi on, clamped into the canvas
    tail_inside: torch.Tensor | None = None  # [b, lookahead] the tail position lies inside the canvas

    def query(self) -> torch.Tensor:
        """[b, R + lookahead] canvas positions whose predictions the step reads."""
        return self.gather if self.tail is None else torch.cat([self.gather, self.tail], dim=1)

    def scatter_positions(self, length: int) -> torch.Tensor:
        """[b, R] the slots' canvas positions, ``length`` (dropped by `scatter_slots`) outside the region."""
        return torch.where(self.valid, self.positions, length)


def commit_region(schedule: Schedule, block_idx, first_active, length: int, lookahead: int = 0) -> Region:
    """The `Region` of rows at block ``block_idx`` [b] whose first active position is ``first_active`` [b]."""
    lo, hi = schedule.commit_bounds(block_idx, first_active)
    positions = lo[:, None] + torch.arange(schedule.width, device=lo.device)
    region = Region(lo, hi, positions, positions < hi[:, None], positions.clamp(max=length - 1))
    if lookahead:
        tail = hi[:, None] + torch.arange(lookahead, device=hi.device)
        region.tail, region.tail_inside = tail.clamp(max=length - 1), tail < length
    return region


def forward_rows(ctx: RunContext, canvas: Canvas, rows, positions, tap_positions, cache: CacheQuery | None = None):
    """One forward of the given rows: (head, taps, kv_cache).

    ``head`` is the logits [b, R, V] that predict canvas ``positions`` [b, R] (CFG applied), or with the run's
    ``window_logits_stats`` (the LM head and its softmax statistics in one op; greedy without CFG only) its [b, R]
    statistics, so no logits are written. ``taps`` are the three taps at ``tap_positions`` [b, T] (None: no taps), or
    with the run's ``tap_project`` (bound to the policy's fold) a 1-tuple of the controller inputs folded from them.
    ``cache`` goes to the backbone; ``kv_cache`` is its stored cache (a refresh) or None.
    """
    model, x, cfg_scale = ctx.model, canvas.x[rows], ctx.settings.cfg_scale
    mask = None if canvas.attention_mask is None else canvas.attention_mask[rows]
    taps = tap_positions is not None
    if cfg_scale == 0:
        outputs = Outputs(taps=taps, tap_positions=tap_positions, head_op=ctx.window_logits_stats,
                          tap_op=ctx.tap_project)
        out = model.predict(x, positions, mask, outputs=outputs, cache=cache, kernels=ctx.ops)
        folded = None if out.tap_inputs is None else (out.tap_inputs,)
        head = out.logits if ctx.window_logits_stats is None else out.stats
        return head, out.taps if ctx.tap_project is None else folded, out.kv_cache
    # LLaDA's CFG: the unconditional input masks the whole prompt; both halves in one forward
    uncond = x.masked_fill(canvas.state[rows] == states.PROMPT, model.spec.mask_id)
    outputs = Outputs(taps=taps, tap_positions=None if not taps else torch.cat([tap_positions, tap_positions]))
    out = model.predict(torch.cat([x, uncond]), torch.cat([positions, positions]),
                        None if mask is None else torch.cat([mask, mask]), outputs=outputs, kernels=ctx.ops)
    cond, un = out.logits.chunk(2)
    # the controller reads the conditional pass's hidden states
    return apply_cfg(cond, un, cfg_scale), None if not taps else tuple(t.chunk(2)[0] for t in out.taps), None


def step_signals(ctx: RunContext, head) -> Signals:
    """The `Signals` of a forward's ``head``: `window_logits_stats`'s statistics (the run's forward scores) or
    logits, these cut by top-p / top-k first (Dream's ``sample_tokens``: its filters on logits / T, then every signal
    from the kept tokens)."""
    settings, spec, temperature = ctx.settings, ctx.spec, ctx.settings.temperature
    top_p, top_k = settings.top_p, settings.top_k
    if ctx.window_logits_stats is not None:
        proposal, max_prob, second_prob, neg_entropy, eos_prob = head
        return Signals(proposal, max_prob, max_prob - second_prob, neg_entropy, eos_prob)
    if (top_p is not None and top_p < 1) or top_k is not None:
        head = filter_top_p_top_k(head, top_p=top_p, top_k=top_k, temperature=temperature)
    return compute_signals(head, eos_id=spec.eos_id, temperature=temperature, generator=ctx.generator,
                           tempered=spec.family == "dream")


def _split_signals(signals: Signals, width: int) -> tuple[Signals, Signals]:
    """The signals of the first ``width`` slots and of the rest."""
    fields = [getattr(signals, f) for f in ("proposal", "confidence", "margin", "neg_entropy", "eos_prob")]
    return Signals(*(f[:, :width] for f in fields)), Signals(*(f[:, width:] for f in fields))


@dataclass
class StepRows:
    """The rows a step decodes: their batch indices ``rows`` [b], their canvas (``x``, ``state`` [b, L] and
    ``attention_mask`` [b, L] or None; the loop's copies, the engine's buffers themselves) and schedule
    ``counters`` ([b] each)."""

    rows: torch.Tensor
    x: torch.Tensor
    state: torch.Tensor
    attention_mask: torch.Tensor | None
    counters: RowCounters


def step_input(ctx: RunContext, signals: Signals, region: Region, step: StepRows, taps=None, vocab: dict | None = None
               ) -> StepInput:
    """What the policy reads at this step of the ``step`` rows. ``signals`` cover the region's slots and then its
    tail; ``taps`` are the forward's (a 1-tuple of controller inputs with the run's ``tap_project``); ``vocab`` is a
    rule's `vocab_pass` outputs (region and tail)."""
    state, counters = step.state, step.counters
    signals = with_vocab(signals, vocab)
    if vocab:
        vocab = {k: v[:, :region.gather.shape[1]] for k, v in vocab.items()}
    lookahead = None
    if region.tail is not None:
        signals, tail_signals = _split_signals(signals, region.gather.shape[1])
        tail_active = region.tail_inside & (state.gather(1, region.tail) == states.ACTIVE)
        lookahead = Lookahead(tail_signals, tail_active, region.tail)
    tap_inputs = None
    if ctx.tap_project is not None and taps is not None:
        (tap_inputs,), taps = taps, None
    return StepInput(signals=signals, active=region.valid & (state.gather(1, region.gather) == states.ACTIVE),
                     region_step=counters.region_step, region_initial=counters.region_initial,
                     region_active=ctx.schedule.region_active(state, counters.block_idx),
                     steps_per_region=ctx.steps_per_region, positions=region.gather, state=state, rows=step.rows,
                     taps=taps, tap_inputs=tap_inputs, attention_mask=step.attention_mask, lookahead=lookahead,
                     vocab=vocab)


def scatter_slots(values: torch.Tensor, into: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Write [b, R] slot values into a copy of ``into`` [b, L]; slots at position L (padding) are dropped."""
    wide = torch.cat([into, into[:, :1]], dim=1)
    return wide.scatter(1, positions, values.to(into.dtype))[:, :-1].contiguous()


def close_step(ctx: RunContext, inp: StepInput, region: Region, step: StepRows, *, live=None, observe=None) -> tuple:
    """Close the step of the ``step`` rows (their ``x`` / ``state`` / ``attention_mask`` in place): commit what the
    policy chooses.

    When the run has a ``commit_step`` and the policy a `Policy.commit_rule` (TraceLock, whatever rule it carries),
    the op scores, selects, commits and fills the end-of-text tail on the device in one pass. Otherwise the policy
    decides (chosen slots and an optional end-of-text cut), ``observe(chosen)`` sees the choice before the commits,
    the op set's ``apply_commits`` writes them (and with ``stop_at_eot`` fills a row's tail after a committed end
    token), and the cut truncates the row, masking its tail in ``attention_mask``. ``live`` [b] (the engine's slots;
    None: every row) keeps the other rows whole.

    Returns:
        (first_active [b], committed [b]): each row's first active position (L for none) and its commit count.
    """
    policy, signals, active, x, state = ctx.policy, inp.signals, inp.active, step.x, step.state
    pad_id, stop_at_eot = ctx.spec.pad_id, bool(ctx.settings.stop_at_eot)
    length = x.shape[1]
    scatter_pos = region.scatter_positions(length)
    rule = None if ctx.commit_step is None else policy.commit_rule(inp)
    if rule is not None:
        # a memory rule's proposal is its region's part of a wider pass (KLASS's reaches into the next region)
        return ctx.commit_step(rule.score, rule.tau, active, signals.proposal.contiguous(), scatter_pos, x, state,
                               ctx.end_ids, rule.theta, rule.cap, fallback_score=rule.fallback_score, held=rule.held,
                               inclusive=rule.inclusive, fill_id=pad_id, stop_at_eot=stop_at_eot)
    chosen, cut = policy.decide(inp, ctx.generator)
    chosen = chosen & active
    if observe is not None:
        observe(chosen)
    proposal = scatter_slots(signals.proposal, x, scatter_pos)
    commit = scatter_slots(chosen, torch.zeros_like(x, dtype=torch.bool), scatter_pos)
    first_active = ctx.ops.apply_commits(x, state, proposal, commit, ctx.end_ids, pad_id, stop_at_eot)
    if cut is not None:
        if live is not None:
            cut = torch.where(live, cut, length)
        first_active = truncate_after(x, state, step.attention_mask, cut, pad_id)
    return first_active, chosen.sum(1)


def run_stats(ctx: RunContext, generated: torch.Tensor, commits_per_step: list, forwards: int, seconds: float,
              refreshes=None) -> DecodeStats:
    """The `DecodeStats` every driver reports, of rows whose generations are ``generated`` [B, G] and commits per
    step ``commits_per_step`` ([B] lists: a row's steps are their count); ``refreshes`` is the KV cache's [B] count
    (None without a cache)."""
    steps = [len(c) for c in commits_per_step]
    return DecodeStats(steps=steps, forwards=forwards, commits_per_step=commits_per_step, seconds=seconds,
                       gen_lengths=gen_lengths(generated, ctx.spec.end_ids),
                       refreshes=[0] * len(steps) if refreshes is None else refreshes.tolist(), settings=ctx.record)


def gen_lengths(generated: torch.Tensor, end_ids) -> list:
    """[B] tokens of each row of ``generated`` [B, G] before its first end token (G for none)."""
    is_end = torch.isin(generated, torch.as_tensor(end_ids, device=generated.device))
    first_end = torch.where(is_end.any(1), is_end.to(torch.uint8).argmax(1),
                            torch.full_like(generated[:, 0], generated.shape[1]))
    return first_end.tolist()


class Stopwatch:
    """Wall-clock of a run on ``device``: `seconds` waits for the device's queued work first."""

    def __init__(self, device):
        self.device, self.start = device, time.perf_counter()

    def seconds(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start
