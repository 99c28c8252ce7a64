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


def _kv_cache(model, settings, schedule, policy, tap_project, rows: int, length: int):
    """The run's `DecodeKVCache`, or None without ``settings.cache``."""
    if settings.cache is None:
        return None
    return DecodeKVCache(settings, schedule, rows=rows, length=length, spec=model.spec, dtype=model.dtype,
                         tap_layout=verbs.tap_layout(policy, model, tap_project), device=model.device)


def _forward_region(forward, kv, policy, rows, region) -> tuple:
    """The live rows' forward for their commit region, through the KV cache where there is one: (head, taps)."""
    # the controller sees the sequence cropped at the region's right end: taps of [0, T)
    T = int(region.hi.max()) if policy.needs_taps else None
    if kv is not None:
        return kv.step(forward, rows, region.query(), region.lo, region.hi, T)
    tap_pos = torch.arange(T, device=rows.device).expand(len(rows), -1) if policy.needs_taps else None
    head, taps, _ = forward(rows, region.query(), tap_pos)
    return head, taps


def _vocab_pass(policy, vocab_ops, head, memory: dict, rows, region, state, region_step):
    """A rule's vocabulary pass (`Policy.vocab_pass`) on the live rows' slice of its memory, written back after; None
    for a rule that reads no vocabulary."""
    if not policy.reads_vocab:
        return None
    row_memory = {k: v[rows] for k, v in memory.items()}
    vocab = verbs.vocab_pass(policy, vocab_ops, head, row_memory, region, state, region_step)
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
    verbs.check_model(model)
    schedule, policy = verbs.setup_run(settings, ops.skip_finished_blocks)
    temperature, cfg_scale, cache = settings.temperature, settings.cfg_scale, settings.cache
    spec, device = model.spec, model.device
    canvas = prepare_canvas(spec, input_ids, attention_mask, settings.gen_length, device)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    end_ids = torch.tensor(spec.end_ids, dtype=torch.long, device=device)
    B, L, S = canvas.x.shape[0], canvas.length, policy.steps_per_region()
    lookahead = verbs.lookahead_width(policy, schedule, cache)
    # end-of-text prediction may truncate rows, which masks their tails' keys
    if policy.eot_lookahead and canvas.attention_mask is None:
        canvas.attention_mask = torch.ones((B, L), dtype=torch.bool, device=device)
    counters = schedule.start(canvas.state, canvas.prompt_len, S)
    first_active = torch.full((B,), canvas.prompt_len, dtype=torch.long, device=device)
    window_logits_stats, tap_project = verbs.forward_ops(
        policy, model, window_logits_stats=ops.window_logits_stats if ops.fused else None,
        tap_project=ops.tap_project if ops.fused else None, temperature=temperature, cfg_scale=cfg_scale,
        filtered=settings.filtered)
    forward = partial(verbs.forward_rows, model, canvas, cfg_scale=cfg_scale, window_logits_stats=window_logits_stats,
                      tap_project=tap_project, kernels=ops)
    kv = _kv_cache(model, settings, schedule, policy, tap_project, B, L)
    commit_step = ops.commit_step if ops.fused and observer is None else None
    # a rule's memory across steps (`Policy.memory_spec`), one entry per row; {} for a rule without
    memory = verbs.allocate_memory(policy, B, verbs.memory_width(policy, schedule, cache), spec, device)
    budget = verbs.step_budget(schedule, S)
    commits, forwards = [], 0

    clock = verbs.Stopwatch(device)
    while True:
        live = first_active < L
        rows = live.nonzero().flatten()
        if rows.numel() == 0:
            break
        if forwards == budget:
            raise verbs.budget_error(policy, forwards)
        region = verbs.commit_region(schedule, counters.block_idx[rows], first_active[rows], L, lookahead)
        head, taps = _forward_region(forward, kv, policy, rows, region)
        signals = verbs.step_signals(head, spec=spec, from_stats=window_logits_stats is not None,
                                     temperature=temperature, generator=generator, top_p=settings.top_p,
                                     top_k=settings.top_k)
        x, state = canvas.x[rows], canvas.state[rows]
        mask = None if canvas.attention_mask is None else canvas.attention_mask[rows]
        row_counters = counters.take(rows)
        vocab = _vocab_pass(policy, ops, head, memory, rows, region, state, row_counters.region_step)
        inp = verbs.step_input(signals, region, state, row_counters, schedule, steps_per_region=S, rows=rows,
                               taps=taps, folded=tap_project is not None, attention_mask=mask, vocab=vocab)
        observe = None if observer is None else _recorder(observer, rows, counters.steps[rows], x, state, inp)
        first_active[rows], committed = verbs.close_step(
            policy, inp, region, x, state, mask, end_ids=end_ids, pad_id=spec.pad_id, stop_at_eot=settings.stop_at_eot,
            apply_commits=ops.apply_commits, commit_step=commit_step, generator=generator, observe=observe)
        canvas.x[rows], canvas.state[rows] = x, state
        if policy.eot_lookahead:  # its cut may have masked the rows' tails
            canvas.attention_mask[rows] = mask
        schedule.advance(canvas.state, counters, live)
        commits.append((rows, committed))
        forwards += 1
    seconds = clock.seconds()
    if kv is not None:
        forwards += kv.split_steps

    return canvas.x, verbs.run_stats(
        canvas.x[:, canvas.prompt_len:], spec.end_ids, steps=counters.steps.tolist(), forwards=forwards,
        commits_per_step=_per_row(commits, B), seconds=seconds, refreshes=None if kv is None else kv.refreshes,
        settings=settings.record(policy))
