"""TraceLock's gate: the learned controller as a correction on top of a training-free rule.

The base rule (held Fréchet, CreditDecoding, the threshold, ...) proposes the step's commits; the controller's
``p = sigmoid(a - tau)`` then vetoes a proposed commit it doubts (``p < veto``) and accepts an extra slot it trusts
(``p > accept``). With ``accept=1`` and ``veto=0`` (no correction) the gate is the base rule exactly, stateful rules
included (their memory and vocabulary pass are the base's). A step whose every proposed commit was vetoed commits
the proposed slot the controller trusts most, so every step still makes progress.

The step closes through `tracelock.ops.commit_step` like every mask rule: the gate's decision is the score
(``+1`` commit, ``-1`` not) at ``theta=0.5``, its fallback the controller's ``p`` with the base's slots first.

Examples::

    policy = GatePolicy("testbed", base=FrechetPolicy(delta=0.3, hold_end=True), veto=0.2)
    make_policy("gate", controller="testbed", base="frechet", base_delta=0.3, base_hold_end=True, veto=0.2)
    # on the command line: gate:controller=testbed:base=frechet:base_delta=0.3:base_hold_end=true:veto=0.2
"""

from __future__ import annotations

import torch

from tracelock.kernels.ref import commit_margin_threshold, commit_select_ref

from .base import CommitRule, Policy, StepInput, held_ends

__all__ = ["GATE_FILE", "GatePolicy", "chosen_gate"]

GATE_FILE = "gate.json"


def _base_policy(base, base_args: dict) -> Policy:
    """The base rule from an instance, or from its registry name and the ``base_<argument>`` values."""
    from . import POLICIES, make_policy

    args = {}
    for key, value in base_args.items():
        if not key.startswith("base_"):
            raise TypeError(f"policy 'gate' takes no argument {key}; its arguments are controller, base, accept, "
                            "veto, encoder, model and the base rule's arguments as base_<name> (base_delta=0.3)")
        args[key[len("base_"):]] = value
    if isinstance(base, Policy):
        if args:
            raise TypeError(f"base is a {type(base).__name__} instance: configure it, not base_{next(iter(args))}")
        policy = base
    elif isinstance(base, str) and base in POLICIES:
        try:
            policy = make_policy(base, **args)
        except (TypeError, ValueError) as err:  # the base's own message, in the gate's argument names
            raise type(err)(f"gate's base: {err}".replace(f"policy {base!r} takes no argument ",
                                                        f"base {base!r} takes no argument base_")) from None
    else:
        raise ValueError(f"base={base!r} must be a training-free rule's name (frechet, credit, threshold, ...) or a "
                         "Policy instance")
    if policy.learned or policy.needs_taps or policy.eot_lookahead or not policy.deterministic:
        raise ValueError(f"base={policy.name!r} must be a deterministic training-free rule (frechet, credit, "
                         "threshold, klass, less, eb, ...), not a learned, sampling or truncating one")
    return policy


def chosen_gate(controller) -> dict:
    """The gate a `tracelock fit` run chose for this controller (its folder's ``gate.json``: base, base_args, accept,
    veto), {} for any other controller."""
    from pathlib import Path

    from tracelock.integrity import read_json
    from tracelock.models.loading import resolve_controller

    if not isinstance(controller, str | Path):
        return {}
    folder = Path(resolve_controller(controller))
    path = (folder if folder.is_dir() else folder.parent) / GATE_FILE
    if not path.is_file():
        return {}
    return read_json(path, fix="rerun `tracelock fit`, or delete it to use the controller without its gate")


def _unit(name: str, value, *, closed_low: bool, closed_high: bool, off) -> float:
    low_ok = value >= 0 if closed_low else value > 0
    high_ok = value <= 1 if closed_high else value < 1
    if isinstance(value, bool) or not isinstance(value, int | float) or not (low_ok and high_ok):
        raise ValueError(f"{name}={value!r} must lie in {'[' if closed_low else '('}0, 1{']' if closed_high else ')'}"
                         f"; {name}={off} turns it off")
    return float(value)


class GatePolicy(Policy):
    """Commit the base rule's slots the controller does not veto, plus the slots it accepts.

    Args:
        controller (Controller | str | Path): as `TraceLockPolicy`'s: a `tracelock train` run folder, or
            "testbed" / "testbed-dream" for the shipped controller.
        base (str | Policy): the training-free rule corrected: a registry name, its arguments given as
            ``base_<name>=value``, or an instance. Default: the rule `tracelock fit` chose with this controller
            (its ``gate.json``), else "frechet" (Fast-dLLM++'s rule).
        accept (float): a slot the base leaves masked commits when ``sigmoid(a - tau) > accept``; 1 never. Never a
            slot the base holds back by its ``hold_end``. Default: the fit's choice, else 1.0.
        veto (float): a slot the base commits stays masked when ``sigmoid(a - tau) < veto``; 0 never. Default: the
            fit's choice, else 0.0.
        encoder (TapEncoder | str | Path, optional): as `TraceLockPolicy`'s.
        model (DiffusionBackbone, optional): as `TraceLockPolicy`'s.
        **base_args: the base rule's arguments, each prefixed ``base_``.
    """

    name = "gate"
    deterministic = True
    needs_taps = True
    learned = True

    def __init__(self, controller, base=None, accept: float | None = None, veto: float | None = None, encoder=None,
                 model=None, **base_args) -> None:
        from .tracelock import TraceLockPolicy

        super().__init__()
        chosen = chosen_gate(controller)
        if base is None:
            chosen_args = {f"base_{k}": v for k, v in chosen.get("base_args", {}).items()}
            base, base_args = chosen.get("base", "frechet"), {**chosen_args, **base_args}
        self.base = _base_policy(base, base_args)
        accept = chosen.get("accept", 1.0) if accept is None else accept
        veto = chosen.get("veto", 0.0) if veto is None else veto
        self.accept = _unit("accept", accept, closed_low=False, closed_high=True, off=1)
        self.veto = _unit("veto", veto, closed_low=True, closed_high=False, off=0)
        # the controller's scores, by the TraceLock policy's own path (fold, crop, confidence input)
        self._scorer = TraceLockPolicy(controller, encoder=encoder, model=model)
        # the base's memory travels with the gate: the loop and the engine read these from the instance
        self.reads_vocab, self.memory_lookahead = self.base.reads_vocab, self.base.memory_lookahead

    def setup(self, *, gen_length: int, num_regions: int) -> None:
        super().setup(gen_length=gen_length, num_regions=num_regions)
        self.base.setup(gen_length=gen_length, num_regions=num_regions)

    def steps_per_region(self) -> int:
        return self.base.steps_per_region()

    def memory_spec(self, *, width: int, spec) -> dict:
        return self.base.memory_spec(width=width, spec=spec)

    def vocab_fields(self) -> dict:
        return self.base.vocab_fields()

    def vocab_pass(self, ops, logits, memory, active, fresh, width) -> dict:
        return self.base.vocab_pass(ops, logits, memory, active, fresh, width)

    def tap_fold(self, model):
        return self._scorer.tap_fold(model)

    def commit_rule(self, inp: StepInput) -> CommitRule:
        return self._rule(inp)

    def _rule(self, inp: StepInput) -> CommitRule:
        proposed = self.base.select(inp)
        a, tau = self._scorer.slot_scores(inp)
        p = torch.sigmoid(a.float() - tau.float()[:, None])
        held = held_ends(inp) if getattr(self.base, "hold_end", False) else None
        extra = inp.active & (p > self.accept)
        if held is not None:
            extra &= ~held
        chosen = (proposed & ~(p < self.veto)) | extra
        # none left: the proposed slot the controller trusts most (p + 2 ranks every proposed slot first)
        return CommitRule(score=chosen.float() * 2 - 1, tau=torch.zeros_like(tau, dtype=torch.float32), theta=0.5,
                          fallback_score=torch.where(proposed, p + 2, p), held=held)

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        rule = self._rule(inp)
        return commit_select_ref(rule.score - rule.tau[:, None], inp.active, commit_margin_threshold(0.5, False), 0,
                                 rule.fallback_score, rule.held)
