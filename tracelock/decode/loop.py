"""The eager decoding loop: prepare -> (forward -> signals -> close the step -> advance)* over the live rows.

`reference_generate` runs it with the spec set (`tracelock.ops.spec_set`, the plain-PyTorch ``*_ref`` ops): the
forward returns the full [b, R, V] logits and the raw taps, and the signals and the policy's inputs are computed
from them afterwards. `fused_generate` runs it with the checked ops (`tracelock.ops.op_set`), and for greedy
decoding without CFG the backbone forward itself calls the ops: `ops.window_logits_stats` in place of the LM
head, so the logits are never written, and, for a policy with a linear tap fold (`Policy.tap_fold`: TraceLock with
a linear encoder), `ops.tap_project` on the three taps, so the policy gets its controller inputs
(``StepInput.tap_inputs``) instead of the taps.
The two must give identical tokens and step counts. With ``cache="prefix"|"dual"`` both run the same approximate
KV cache (`tracelock.decode.kv_cache`). The step's verbs are `tracelock.decode.step`'s, which the compiled engine
(`tracelock.decode.engine`) calls too.
"""

from dataclasses import dataclass
from functools import partial

import torch

from tracelock.decode import step as verbs
from tracelock.decode.canvas import prepare_canvas
from tracelock.decode.context import RunContext, allocate_memory, start_run
from tracelock.decode.kv_cache import DecodeKVCache
from tracelock.decode.settings import DecodeSettings
from tracelock.ops import OpSet


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


def _recorder(observer, rows, steps, x, state, inp):
    """``observe(chosen)`` for `close_step`: hands the observer this step's `StepRecord`."""
    return lambda chosen: observer(StepRecord(rows=rows, step=steps, x=x.clone(), state=state.clone(),
                                              positions=inp.positions, active=inp.active, signals=inp.signals,
                                              chosen=chosen))


def _per_row(commits: list, B: int) -> list:
    """[B] lists of each row's commits per step, from the steps' (rows [b], counts [b])."""
    per_row = [[] for _ in range(B)]
    for rows, counts in commits:
        for r, n in zip(rows.tolist(), counts.tolist()):
            per_row[r].append(n)
    return per_row


def _forward_region(forward, kv, policy, rows, region) -> tuple:
    """The live rows' forward for their commit region, through the KV cache where there is one: (head, taps)."""
    # the controller sees the sequence cropped at the region's right end: taps of [0, T)
    T = int(region.hi.max()) if policy.needs_taps else None
    if kv is not None:
        return kv.step(forward, rows, region.query(), region.lo, region.hi, T)
    tap_pos = torch.arange(T, device=rows.device).expand(len(rows), -1) if policy.needs_taps else None
    head, taps, _ = forward(rows, region.query(), tap_pos)
    return head, taps


def _vocab_pass(ctx: RunContext, head, memory: dict, region, step: verbs.StepRows):
    """A rule's vocabulary pass (`Policy.vocab_pass`) on the live rows' slice of its memory, written back after; None
    for a rule that reads no vocabulary."""
    if not ctx.policy.reads_vocab:
        return None
    rows = step.rows
    row_memory = {k: v[rows] for k, v in memory.items()}
    vocab = verbs.vocab_pass(ctx, head, row_memory, region, step.state, step.counters.region_step)
    for k, v in row_memory.items():
        memory[k][rows] = v
    return vocab


@torch.no_grad()
def run_decode(model, input_ids, settings: DecodeSettings, ops: OpSet, *, attention_mask=None, observer=None):
    """The loop behind `fused_generate` and `reference_generate` (see there): decode ``input_ids`` with
    ``settings`` and ``ops`` (`tracelock.ops.op_set`, or the spec set). ``observer``, when given, is called with a
    `StepRecord` at every step (trace recording). With a fused op set (``ops.fused``) greedy steps without CFG are
    scored inside the forward from the LM head's input (`ops.window_logits_stats`), with the taps folded there too
    for a policy whose `Policy.tap_fold` is not None (`ops.tap_project`), and the steps of policies with a
    ``commit_rule`` close in `ops.commit_step` (not with an observer, which needs the chosen slots: `select` decides
    those steps by the same rule's spec); other steps, and the spec set, go through the logits."""
    ctx = start_run(model, settings, ops, observed=observer is not None)
    policy, schedule = ctx.policy, ctx.schedule
    canvas = prepare_canvas(model.spec, input_ids, attention_mask, settings.gen_length, model.device)
    B, L, S = canvas.x.shape[0], canvas.length, ctx.steps_per_region
    # end-of-text prediction may truncate rows, which masks their tails' keys
    if policy.eot_lookahead and canvas.attention_mask is None:
        canvas.attention_mask = torch.ones((B, L), dtype=torch.bool, device=model.device)
    counters = schedule.start(canvas.state, canvas.prompt_len, S)
    first_active = torch.full((B,), canvas.prompt_len, dtype=torch.long, device=model.device)
    forward = partial(verbs.forward_rows, ctx, canvas)
    kv = None if settings.cache is None else DecodeKVCache(ctx, B, L)
    # a rule's memory across steps (`Policy.memory_spec`), one entry per row; {} for a rule without
    memory = allocate_memory(ctx, B)
    budget = verbs.step_budget(schedule, S)
    commits, forwards = [], 0

    clock = verbs.Stopwatch(model.device)
    while True:
        live = first_active < L
        rows = live.nonzero().flatten()
        if rows.numel() == 0:
            break
        if forwards == budget:
            raise verbs.budget_error(policy, forwards)
        region = verbs.commit_region(schedule, counters.block_idx[rows], first_active[rows], L, ctx.lookahead)
        head, taps = _forward_region(forward, kv, policy, rows, region)
        signals = verbs.step_signals(ctx, head)
        mask = None if canvas.attention_mask is None else canvas.attention_mask[rows]
        step = verbs.StepRows(rows, canvas.x[rows], canvas.state[rows], mask, counters.take(rows))
        vocab = _vocab_pass(ctx, head, memory, region, step)
        inp = verbs.step_input(ctx, signals, region, step, taps, vocab)
        observe = None if observer is None else _recorder(observer, rows, counters.steps[rows], step.x, step.state,
                                                          inp)
        first_active[rows], committed = verbs.close_step(ctx, inp, region, step, observe=observe)
        canvas.x[rows], canvas.state[rows] = step.x, step.state
        if policy.eot_lookahead:  # its cut may have masked the rows' tails
            canvas.attention_mask[rows] = step.attention_mask
        schedule.advance(canvas.state, counters, live)
        commits.append((rows, committed))
        forwards += 1
    seconds = clock.seconds()
    if kv is not None:
        forwards += kv.split_steps
    return canvas.x, verbs.run_stats(ctx, canvas.x[:, canvas.prompt_len:], _per_row(commits, B), forwards, seconds,
                                     None if kv is None else kv.refreshes)
