"""One decoding loop for every policy and schedule: prepare -> (denoise_step -> commit -> advance)*.

`reference_generate` runs it with the plain-PyTorch ``*_ref`` ops: the forward returns the full [b, R, V]
logits and the raw taps, and the signals and the policy's inputs are computed from them afterwards.
`fused_generate` runs it with the op dispatcher, and for greedy decoding without CFG the backbone forward
itself calls the ops: `ops.window_logits_stats` in place of the LM head, so the logits are never written, and,
for a policy with a linear tap fold (`Policy.tap_fold`: TraceLock with a linear encoder), `ops.tap_project`
on the three taps, so the policy gets its controller inputs (``StepInput.tap_inputs``) instead of the taps.
Everything else (the policy, the step accounting) is shared, and the two must give identical tokens and step
counts. With ``cache="prefix"|"dual"`` both run the same approximate KV cache (`tracelock.decode.kv_cache`).
"""

import math
import numbers
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from tracelock import states
from tracelock.decode.canvas import Canvas, prepare_canvas, truncate_after
from tracelock.decode.kv_cache import DecodeKVCache, default_refresh_shift, validate_cache
from tracelock.decode.schedule import Schedule
from tracelock.models.backbone import DiffusionBackbone
from tracelock.policies import make_policy
from tracelock.policies.base import Lookahead, StepInput
from tracelock.signals import Signals, apply_cfg, compute_signals


@dataclass
class StepRecord:
    """One decoding step as an observer sees it: the rows decoded at this step, before their commits.

    Tensors are the loop's own (an observer copies what it keeps; it must not modify them).
    """

    rows: torch.Tensor  # [b] batch rows decoded at this step (finished rows drop out)
    step: torch.Tensor  # [b] per-row step index, 0 at the row's first forward
    x: torch.Tensor  # [b, L] canvas tokens before this step's commits (x_t)
    state: torch.Tensor  # [b, L] position states before this step's commits
    positions: torch.Tensor  # [b, R] canvas position of each candidate slot
    active: torch.Tensor  # [b, R] the slot is an active position inside the commit region
    signals: object  # tracelock.signals.Signals, [b, R] each: proposal, confidence, ...
    chosen: torch.Tensor  # [b, R] the slots the policy commits at this step


@dataclass
class DecodeStats:
    """What a decoding run cost. A step is one backbone forward (NFE) of a row."""

    steps: list  # [B] forwards spent on each row
    forwards: int  # batched forward calls
    commits_per_step: list  # [B] lists: tokens committed at each of the row's steps
    seconds: float  # wall-clock of the whole run
    gen_lengths: list  # [B] generated tokens before the first end token
    refreshes: list = field(default_factory=list)  # [B] KV-cache refresh forwards among each row's steps
    settings: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return sum(self.gen_lengths) / self.seconds if self.seconds > 0 else float("nan")


def _check_options(model, temperature, cfg_scale):
    if not isinstance(model, DiffusionBackbone):
        raise TypeError(f"model must be a tracelock DiffusionBackbone (from tracelock.load_model), got {type(model)}")
    for name, value, zero in (("temperature", temperature, "greedy"), ("cfg_scale", cfg_scale,
                                                                       "no classifier-free guidance")):
        # a real number (None, a string or inf would fail deep in the loop, or decode garbage)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
            raise ValueError(f"{name}={value!r} must be a finite number >= 0 (0 = {zero})")


def _scatter(values: torch.Tensor, into: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Write [b, R] slot values into a copy of ``into`` [b, L]; slots at position L (padding) are dropped."""
    wide = torch.cat([into, into[:, :1]], dim=1)
    return wide.scatter(1, positions, values.to(into.dtype))[:, :-1].contiguous()


def _forward(model, canvas: Canvas, rows, positions, tap_positions, cfg_scale, head_op=None, tap_op=None,
             **cache_args):
    """One forward of the given rows: (scores, taps, kv_cache).

    ``scores`` are the logits [b, R, V] that predict canvas ``positions`` [b, R] (CFG applied), or, with ``head_op``
    (`ops.window_logits_stats`: the LM head and its softmax statistics in one pass, greedy without CFG only), its
    [b, R] stats, so no logits are written. ``taps`` are the three taps at ``tap_positions`` [b, T] (None: no taps),
    or with ``tap_op`` a 1-tuple of the controller inputs folded from them. ``cache_args`` (store_kv, kv_cache,
    query_positions) go to the backbone; ``kv_cache`` is its stored cache (a refresh) or None.
    """
    x = canvas.x[rows]
    mask = None if canvas.attention_mask is None else canvas.attention_mask[rows]
    taps = tap_positions is not None
    if cfg_scale == 0:
        out = model.predict(x, positions, mask, return_taps=taps, tap_positions=tap_positions, head_op=head_op,
                            tap_op=tap_op, **cache_args)
        folded = None if out.tap_inputs is None else (out.tap_inputs,)
        return out.logits if head_op is None else out.stats, out.taps if tap_op is None else folded, out.kv_cache
    # LLaDA's CFG: the unconditional input masks the whole prompt; both halves in one forward
    uncond = x.masked_fill(canvas.state[rows] == states.PROMPT, model.spec.mask_id)
    out = model.predict(torch.cat([x, uncond]), torch.cat([positions, positions]),
                        None if mask is None else torch.cat([mask, mask]), return_taps=taps,
                        tap_positions=None if not taps else torch.cat([tap_positions, tap_positions]))
    cond, un = out.logits.chunk(2)
    # the controller reads the conditional pass's hidden states
    return apply_cfg(cond, un, cfg_scale), None if not taps else tuple(t.chunk(2)[0] for t in out.taps), None


def _split_signals(signals: Signals, R: int) -> tuple[Signals, Signals]:
    """The signals of the first R slots and of the rest."""
    fields = [getattr(signals, f) for f in ("proposal", "confidence", "margin", "neg_entropy", "eos_prob")]
    return Signals(*(f[:, :R] for f in fields)), Signals(*(f[:, R:] for f in fields))


def _fold_taps(tap_project, A, c, h1, h2, h3):
    """The forward's ``tap_op``: the three taps [b*T, D] -> the policy's inputs [b*T, N] by its fold."""
    return tap_project(h1, h2, h3, A, c)


def _gen_lengths(canvas: Canvas, end_ids) -> list:
    gen = canvas.x[:, canvas.prompt_len:]
    is_end = torch.isin(gen, torch.tensor(end_ids, device=gen.device))
    first_end = torch.where(is_end.any(1), is_end.float().argmax(1), torch.full_like(gen[:, 0], gen.shape[1]))
    return first_end.tolist()


@torch.no_grad()
def run_decode(model, input_ids, *, policy, gen_length, block=None, window=None, policy_args=None,
               attention_mask=None, temperature=0.0, cfg_scale=0.0, stop_at_eot=False, idle_steps=False, seed=0,
               cache=None, refresh_every=None, refresh_shift=None, apply_commits, skip_blocks, window_stats=None,
               tap_project=None, commit_step=None, observer=None):
    """The loop behind `fused_generate` and `reference_generate` (see there); ``observer``, when given, is
    called with a `StepRecord` at every step (trace recording). ``apply_commits`` and ``skip_blocks`` are the
    per-step bookkeeping ops (`tracelock.ops` or their specs). ``window_stats`` (fused only) scores greedy
    steps without CFG inside the forward, from the LM head's input; other steps, and the reference, go through
    the logits. ``tap_project`` (fused only, with ``window_stats``) folds the taps inside those forwards for a
    policy whose `Policy.tap_fold` is not None. ``commit_step`` (fused only) closes the steps of policies whose
    ``commit_rule`` is that op's rule. ``cache`` / ``refresh_every`` / ``refresh_shift``: the approximate KV cache
    (`tracelock.decode.kv_cache`)."""
    _check_options(model, temperature, cfg_scale)
    schedule = Schedule(gen_length, block, window, idle_steps, skip_blocks)
    validate_cache(cache, refresh_every, refresh_shift, schedule.kind, cfg_scale)
    if cache is not None and refresh_shift is None and schedule.kind == "window":
        refresh_shift = default_refresh_shift(window)
    policy = make_policy(policy, **(policy_args or {}))
    policy.setup(gen_length=gen_length, num_regions=schedule.num_regions)
    spec, device = model.spec, model.device
    canvas = prepare_canvas(spec, input_ids, attention_mask, gen_length, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    end_ids = torch.tensor(spec.end_ids, dtype=torch.long, device=device)
    B, L, R, S = canvas.x.shape[0], canvas.length, schedule.width, policy.steps_per_region()
    # end-of-text prediction reads the positions right of the region too (a dual cache recomputes only the region)
    # and may truncate rows, which masks their tails' keys
    lookahead = gen_length - R if policy.eot_lookahead and cache != "dual" else 0
    if policy.eot_lookahead and canvas.attention_mask is None:
        canvas.attention_mask = torch.ones((B, L), dtype=torch.bool, device=device)
    counters = schedule.start(canvas.state, canvas.prompt_len, S)
    first_active = torch.full((B,), canvas.prompt_len, dtype=torch.long, device=device)
    slots = torch.arange(R, device=device)
    tail_slots = torch.arange(lookahead, device=device)
    commits, forwards = [], 0
    fused = window_stats is not None and temperature == 0 and cfg_scale == 0
    head_op = window_stats if fused else None
    # set only for a policy that needs taps, so every fused forward that has a tap_op also has tap rows
    tap_op = None
    if fused and policy.needs_taps and tap_project is not None:
        fold = policy.tap_fold(model)
        if fold is not None:
            A, c = fold
            tap_op = partial(_fold_taps, tap_project, A, c)
    forward = partial(_forward, model, canvas, cfg_scale=cfg_scale, head_op=head_op, tap_op=tap_op)
    kv = None if cache is None else DecodeKVCache(cache, schedule.kind, refresh_every, refresh_shift, B=B, L=L,
                                                   shift=spec.logit_shift, needs_taps=policy.needs_taps, device=device)
    # a policy that never commits would loop forever: every shipped policy finishes within its budget
    max_forwards = 2 * (gen_length + schedule.num_regions * S) + 8

    start = time.perf_counter()
    while True:
        live = first_active < L
        rows = live.nonzero().flatten()
        if rows.numel() == 0:
            break
        if forwards == max_forwards:
            raise RuntimeError(f"policy {policy!r} left positions uncommitted after {forwards} steps; "
                               "a policy must commit at least one active position within its step budget")
        lo, hi = schedule.commit_bounds(counters.block_idx[rows], first_active[rows])
        pos = lo[:, None] + slots
        valid = pos < hi[:, None]
        gather_pos = pos.clamp(max=L - 1)
        row_state = canvas.state[rows]
        active = valid & (row_state.gather(1, gather_pos) == states.ACTIVE)

        # the controller sees the sequence cropped at the region's right end: taps of [0, T)
        T = int(hi.max()) if policy.needs_taps else None
        query = gather_pos
        if lookahead:
            tail_pos = hi[:, None] + tail_slots
            query = torch.cat([gather_pos, tail_pos.clamp(max=L - 1)], dim=1)
        if kv is None:
            tap_pos = torch.arange(T, device=device).expand(len(rows), -1) if policy.needs_taps else None
            scores, taps, _ = forward(rows, query, tap_pos)
        else:
            scores, taps = kv.step(forward, rows, query, lo, hi, T)
        if fused:
            proposal, max_prob, second_prob, neg_entropy, eos_prob = scores
            signals = Signals(proposal, max_prob, max_prob - second_prob, neg_entropy, eos_prob)
        else:
            signals = compute_signals(scores, eos_id=spec.eos_id, temperature=temperature, generator=generator,
                                      tempered=spec.family == "dream")
        ahead = None
        if lookahead:
            signals, tail_signals = _split_signals(signals, R)
            tail_active = (tail_pos < L) & (row_state.gather(1, tail_pos.clamp(max=L - 1)) == states.ACTIVE)
            ahead = Lookahead(tail_signals, tail_active, tail_pos.clamp(max=L - 1))
        tap_inputs = None
        if tap_op is not None:
            (tap_inputs,), taps = taps, None
        step_input = StepInput(signals=signals, active=active, region_step=counters.region_step[rows],
                               region_initial=counters.region_initial[rows],
                               region_active=schedule.region_active(row_state, counters.block_idx[rows]),
                               steps_per_region=S, positions=gather_pos, state=row_state, rows=rows, taps=taps,
                               tap_inputs=tap_inputs,
                               attention_mask=None if canvas.attention_mask is None else canvas.attention_mask[rows],
                               lookahead=ahead)
        scatter_pos = torch.where(valid, pos, L)
        x_rows = canvas.x[rows]
        # the commit_step op closes the step when the policy's rule is its rule (an observer needs the chosen
        # slots, and stop_at_eot the tail fill of apply_commits: both take the select path)
        rule = None if commit_step is None or observer is not None or stop_at_eot else policy.commit_rule(step_input)
        if rule is not None:
            score, tau, theta, cap = rule
            was_active = (row_state == states.ACTIVE).sum(1)
            first_active[rows], _ = commit_step(score, tau, active, signals.proposal, scatter_pos, x_rows, row_state,
                                                end_ids, theta, cap)
            committed = was_active - (row_state == states.ACTIVE).sum(1)
        else:
            chosen, cut = policy.decide(step_input, generator)
            chosen = chosen & active
            if observer is not None:
                observer(StepRecord(rows=rows, step=counters.steps[rows], x=x_rows.clone(), state=row_state.clone(),
                                    positions=gather_pos, active=active, signals=signals, chosen=chosen))
            proposal = _scatter(signals.proposal, x_rows, scatter_pos)
            commit = _scatter(chosen, torch.zeros_like(x_rows, dtype=torch.bool), scatter_pos)
            first_active[rows] = apply_commits(x_rows, row_state, proposal, commit, end_ids, spec.pad_id, stop_at_eot)
            committed = chosen.sum(1)
            if cut is not None:
                mask_rows = canvas.attention_mask[rows]
                first_active[rows] = truncate_after(x_rows, row_state, mask_rows, cut, spec.pad_id)
                canvas.attention_mask[rows] = mask_rows
        canvas.x[rows], canvas.state[rows] = x_rows, row_state
        schedule.advance(canvas.state, counters, live)
        commits.append((rows, committed))
        forwards += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if kv is not None:
        forwards += kv.split_steps

    per_row = [[] for _ in range(B)]
    for rows, counts in commits:
        for r, n in zip(rows.tolist(), counts.tolist()):
            per_row[r].append(n)
    stats = DecodeStats(
        steps=counters.steps.tolist(), forwards=forwards, commits_per_step=per_row, seconds=seconds,
        gen_lengths=_gen_lengths(canvas, spec.end_ids),
        refreshes=[0] * B if kv is None else kv.refreshes.tolist(),
        settings=dict(policy=repr(policy), gen_length=gen_length, block=block, window=window, schedule=schedule.kind,
                      temperature=temperature, cfg_scale=cfg_scale, stop_at_eot=stop_at_eot, idle_steps=idle_steps,
                      seed=seed, cache=cache, refresh_every=refresh_every, refresh_shift=refresh_shift),
    )
    return canvas.x, stats
