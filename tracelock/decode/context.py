"""A decode's fixed parts, built once by `start_run` and read by every verb of its steps (`tracelock.decode.step`):
the model, the settings, the op set, the schedule and the set-up policy, the ops the forward runs in place of its
outputs, and the step's constants. Both drivers build one: the eager loop per call, the engine per engine."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from tracelock.decode.schedule import Schedule
from tracelock.decode.settings import DecodeSettings
from tracelock.models.backbone import DiffusionBackbone
from tracelock.ops import OpSet
from tracelock.policies import resolve_policy
from tracelock.policies.base import Policy


@dataclass
class RunContext:
    """What every step of a decode reads (`start_run`): a run context."""

    model: DiffusionBackbone
    settings: DecodeSettings
    ops: OpSet
    schedule: Schedule
    policy: Policy  # built and set up for this run
    # the forward's ops in place of its outputs (`forward_ops`): None for the logits / the raw taps
    window_logits_stats: Callable | None
    tap_project: Callable | None
    commit_step: Callable | None  # closes a commit rule's steps on the device; None: the policy's select
    generator: torch.Generator | None  # sampling and stochastic policies; None for a deterministic run
    end_ids: torch.Tensor  # [E] the model's end tokens
    steps_per_region: int
    lookahead: int  # positions right of the commit region whose signals a step reads (`lookahead_width`)
    tap_layout: tuple | None  # (count, X, dtype) of the taps a forward returns (`tap_layout`); None: no taps

    @property
    def spec(self):
        return self.model.spec

    @property
    def record(self) -> dict:
        """`DecodeStats.settings`."""
        return self.settings.record(self.policy)


def check_model(model) -> None:
    if not isinstance(model, DiffusionBackbone):
        raise TypeError(f"model must be a tracelock DiffusionBackbone (from tracelock.load_model), got {type(model)}")


def start_run(model, settings: DecodeSettings, ops: OpSet, *, observed: bool = False) -> RunContext:
    """The `RunContext` of ``model`` decoding with ``settings`` and ``ops`` (`tracelock.ops.op_set`, or the spec set).
    ``observed``: an observer sees every step's chosen slots, so no step closes in ``commit_step``."""
    check_model(model)
    schedule = Schedule(settings.gen_length, settings.block, settings.window, settings.idle_steps,
                        ops.skip_finished_blocks)
    # built, checked and set up for this run in one call: every error names the policy
    policy = resolve_policy(settings.policy, settings.policy_args, gen_length=settings.gen_length,
                            num_regions=schedule.num_regions, model=model)
    check_memory_rule(policy, settings)
    head_op, tap_op = forward_ops(policy, model, ops, settings)
    stochastic = settings.temperature > 0 or not policy.deterministic
    generator = torch.Generator(device=model.device).manual_seed(settings.seed) if stochastic else None
    return RunContext(model, settings, ops, schedule, policy, head_op, tap_op,
                      commit_step=ops.commit_step if ops.fused and not observed else None, generator=generator,
                      end_ids=torch.tensor(model.spec.end_ids, dtype=torch.long, device=model.device),
                      steps_per_region=policy.steps_per_region(),
                      lookahead=lookahead_width(policy, schedule, settings.cache),
                      tap_layout=tap_layout(policy, model, tap_op))


def check_memory_rule(policy: Policy, settings: DecodeSettings) -> None:
    """A rule that remembers per slot (``reads_vocab``) runs greedy, in blocks or on the whole answer: its memory
    follows a region's slots, which a sliding window moves, and its authors' code has no sampled form checked here."""
    if not policy.reads_vocab:
        return
    if settings.window is not None:
        raise ValueError(f"policy {policy.name!r} keeps a memory per slot of a block, which a sliding window moves: "
                         f"use block=N (semi-AR blocks) or neither (the whole answer), not window={settings.window}")
    if settings.temperature > 0:
        raise ValueError(f"policy {policy.name!r} decodes greedily, as its authors' code is checked here: pass "
                         f"temperature=0, not {settings.temperature}")
    if settings.filtered:
        raise ValueError(f"policy {policy.name!r} reads each slot's whole distribution, as its authors' code does: "
                         f"drop top_p={settings.top_p} / top_k={settings.top_k}")


def _project_folded(tap_project, A, c, h1, h2, h3):
    """The three taps [b*T, D] -> the policy's inputs [b*T, N] by its linear fold (A, c)."""
    return tap_project(h1, h2, h3, A, c)


def forward_ops(policy: Policy, model, ops: OpSet, settings: DecodeSettings) -> tuple:
    """(window_logits_stats, tap_project) for the forward to run in place of its outputs, each None to get the
    logits / the raw taps. Greedy steps without CFG of a fused op set score from the LM head's input (no logits
    written); a policy with a linear tap fold (`Policy.tap_fold`) then gets its controller inputs, ``tap_project``
    bound to the fold. Top-p / top-k need the logits too, as does a rule that reads the whole vocabulary."""
    if not ops.fused or settings.temperature > 0 or settings.cfg_scale or policy.reads_vocab or settings.filtered:
        return None, None
    fold = policy.tap_fold(model) if policy.needs_taps else None
    return ops.window_logits_stats, None if fold is None else partial(_project_folded, ops.tap_project, *fold)


def tap_layout(policy: Policy, model, tap_project) -> tuple | None:
    """(count, X, dtype) of the taps a forward returns for ``policy``: the three raw taps, or with ``tap_project``
    (`forward_ops`) the one tensor of controller inputs folded from them; None for a policy without taps."""
    if not policy.needs_taps:
        return None
    if tap_project is None:
        return 3, model.spec.hidden_size, model.dtype
    return 1, tap_project.args[-1].shape[0], torch.float32  # the fold's (A, c): c [N]


def lookahead_width(policy: Policy, schedule: Schedule, cache) -> int:
    """Positions right of the commit region whose signals the step also reads, 0 for none: the rest of the answer
    for end-of-text prediction, the next block for a memory that covers it (KLASS). A dual cache recomputes only the
    region, so it reads none."""
    if cache == "dual":
        return 0
    if policy.eot_lookahead:
        return schedule.gen_length - schedule.width
    if policy.memory_lookahead and schedule.kind == "block":
        return min(schedule.block, schedule.gen_length - schedule.width)
    return 0


def memory_width(ctx: RunContext) -> int:
    """The slots a rule's memory covers: the commit region's, plus the next region's for ``memory_lookahead``."""
    return ctx.schedule.width + ctx.lookahead


def allocate_memory(ctx: RunContext, rows: int) -> dict:
    """The rule's per-row buffers (`Policy.memory_spec`), zeros of [rows, *shape]; {} for a rule without memory."""
    return {name: torch.zeros((rows, *shape), dtype=dtype, device=ctx.model.device)
            for name, (shape, dtype) in ctx.policy.memory_spec(width=memory_width(ctx), spec=ctx.spec).items()}
