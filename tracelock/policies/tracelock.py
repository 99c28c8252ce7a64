"""The TraceLock policy: a learned controller scores every position and predicts the step's threshold
(paper §3.3; docs/design.md, "Data flow").

At each step the controller reads the taps of canvas positions [0, T) (T = the furthest region end of the
batch), cropped per row at its own region end (attention beyond it masked, as in training) and with left
padding masked. The commit rule on the region's active slots: margin ``m = a - tau``, commit where
``sigmoid(m) > theta``, keep at most ``cap`` of them (largest margins first), and commit the single best
active slot when none passes, so every step makes progress.

Deployment choices are schedule arguments of `fused_generate`, not policy switches:
- soft-crop (the paper's default): ``window=w``, the region ``[p_t, p_t + w)`` from the first active position;
  the reference release uses ``window=128``;
- "w/o soft-crop" (the paper's ablation): no window and no block, i.e. the full generation region.
The "w/o dynamic threshold" ablation is ``static_tau``: a fixed threshold logit replaces the learned tau.

Examples::

    policy = TraceLockPolicy("runs/ctrl", theta=0.95)
    tokens, stats = tracelock.fused_generate(model, ids, policy=policy, gen_length=256, window=32)
"""

from __future__ import annotations

from pathlib import Path

import torch

from tracelock.controller import FALLBACKS
from tracelock.kernels.ref import commit_margin_threshold, commit_select_ref, tap_project_ref

from .base import CommitRule, Policy, StepInput, held_ends

__all__ = ["TraceLockPolicy"]


def _load(controller, encoder, model):
    """(Controller, encoder) from objects or a run folder holding best.safetensors/.json and encoder.*."""
    from tracelock.controller import Controller, check_fingerprint, controller_fingerprint
    from tracelock.features import load_encoder
    from tracelock.models.loading import resolve_controller

    folder = None
    if isinstance(controller, str | Path):
        controller = resolve_controller(controller)
        if not Path(controller).exists():
            raise FileNotFoundError(f"controller={str(controller)!r} does not exist; pass a `tracelock train --out` "
                                    "folder (or its best.safetensors), or a bundled model's name (testbed, "
                                    "testbed-dream) for its shipped controller")
        folder = Path(controller) if Path(controller).is_dir() else Path(controller).parent
        if encoder is None:
            encoder = folder
    if isinstance(encoder, str | Path):
        encoder = load_encoder(encoder, model=model)
    if encoder is None:
        raise ValueError("encoder is required with a Controller object: pass the TapEncoder that wrote its codes "
                         "(or a run folder as controller, which holds both)")
    if folder is not None:
        controller = Controller.load(controller, model=model, encoder=encoder)
    elif not isinstance(controller, Controller):
        raise TypeError(f"controller must be a Controller or a run folder (`tracelock train --out`), "
                        f"got {type(controller).__name__}")
    else:
        check_fingerprint(controller.config.fingerprint, controller_fingerprint(model, encoder))
    if encoder.code_dim != controller.config.code_dim:
        raise ValueError(f"the encoder writes {encoder.code_dim} codes but the controller reads "
                         f"{controller.config.code_dim}; pass the encoder it was trained with")
    return controller.eval(), encoder


class TraceLockPolicy(Policy):
    """Commit the active slots the controller deems stable.

    Args:
        controller (Controller | str | Path): the controller, or a `tracelock train` run folder (controller and
            encoder are loaded from it), or "testbed" / "testbed-dream": the controller shipped with that bundled
            model.
        encoder (TapEncoder | str | Path, optional): the encoder of the controller's codes; required with a
            Controller object. A linear encoder is folded with the input projection into
            ``h1 @ A1 + h2 @ A2 + h3 @ A3 + c`` (one pass over the taps, inside the backbone forward under
            `fused_generate`: :meth:`tap_fold`); a nonlinear one runs as codes.
        theta (float): commit threshold on ``sigmoid(m)``, in (0, 1). Default: 0.95 (paper), 0.99 with
            ``reference_release``.
        cap (int, optional): at most this many commits per step (largest margins). Default: None (no cap),
            4 with ``reference_release``.
        static_tau (float, optional): use this fixed threshold logit instead of the learned tau (the
            "w/o dynamic threshold" ablation). Default: None.
        reference_release (bool): the reference release's rule: ``sigmoid(m) >= 0.99``, cap 4, and a controller
            trained with the confidence input (its window, 128, is `fused_generate`'s ``window``). Default: False.
        hold_end (bool, optional): commit an end-of-text proposal only once no still-masked position left of it
            proposes text: the padding after the answer waits for the answer. In a window wider than the
            controller was trained on it committed the padding early and cut the answers short (docs/frontier.md,
            "The confident errors"). The fallback's one commit per step is kept (the leftmost masked slot is never
            held). Default: the controller's commit rule (`ControllerConfig.commit_rule`; the paper's with
            ``reference_release``), else False.
        fallback (str, optional): what a step commits when no slot clears theta: "score", the slot with the
            controller's largest margin (the paper's rule), "confidence" or "neg_entropy", the backbone's most
            certain slot by that score (the LLaDA and Dream families' one-per-step rules, so a high theta tends to
            them). The controller's best slot was twice as often the first wrong commit as any commit
            (docs/frontier.md). Every combination is one `CommitRule`, which the fused loop and the engine close
            with `ops.commit_step` and `select` decides by the same spec. Default: the controller's commit rule,
            else "score". The shipped controllers
            carry ``hold_end=True`` and their family's score; ``hold_end=False, fallback="score"`` is the paper's
            rule with any controller.
        model (DiffusionBackbone, optional): when given, the controller's and encoder's backbone fingerprints are
            checked now; otherwise the tap width is checked at the first step.
    """

    name = "tracelock"
    deterministic = True
    needs_taps = True
    learned = True

    def __init__(self, controller, encoder=None, theta: float | None = None, cap: int | None = None,
                 static_tau: float | None = None, reference_release: bool = False, hold_end: bool | None = None,
                 fallback: str | None = None, model=None) -> None:
        super().__init__()
        if reference_release and (theta not in (None, 0.99) or cap not in (None, 4)):
            raise ValueError(f"reference_release=True fixes theta=0.99 and cap=4; drop theta={theta!r} / "
                             f"cap={cap!r} or set reference_release=False")
        theta = (0.99 if reference_release else 0.95) if theta is None else theta
        cap = 4 if reference_release else cap
        if not isinstance(theta, int | float) or not 0 < theta < 1:
            raise ValueError(f"theta={theta!r} must lie in (0, 1); the paper uses 0.95")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"cap={cap!r} must be a positive int (commits per step) or None for no cap")
        if hold_end is not None and not isinstance(hold_end, bool):
            raise ValueError(f"hold_end={hold_end!r} must be true or false")
        if fallback is not None and fallback not in FALLBACKS:
            raise ValueError(f"fallback={fallback!r} must be one of {', '.join(FALLBACKS)}")
        if static_tau is not None and not isinstance(static_tau, int | float):
            raise ValueError(f"static_tau={static_tau!r} must be a float threshold logit or None (learned tau)")
        self._controller, self._encoder = _load(controller, encoder, model)
        if reference_release and not self._controller.config.confidence_input:
            raise ValueError("reference_release=True needs a controller trained with the confidence input "
                             "(`tracelock train --confidence-input`)")
        self.theta, self.cap, self.reference_release = float(theta), cap, bool(reference_release)
        self.static_tau = None if static_tau is None else float(static_tau)
        # what the controller deploys with, unless told otherwise; the reference release's rule is the paper's
        rule = {} if reference_release else self._controller.config.commit_rule
        self.hold_end = rule.get("hold_end", False) if hold_end is None else hold_end
        self.fallback = rule.get("fallback", "score") if fallback is None else fallback
        commit_margin_threshold(self.theta, self.reference_release)  # validates theta once, here
        self._device, self._fold = None, None
        # set by a `tracelock.eval.diagnostics.ControllerStepRecorder` while it records: the policy then keeps the
        # last step's slot scores and tau for it; off by default, so decoding holds on to nothing
        self.record_scores, self.last_scores = False, None

    def _prepare(self, device, D: int):
        """Move the controller to the taps' device, check the tap width, fold a linear encoder once."""
        fp = self._controller.config.fingerprint.get("backbone", {})
        want = fp.get("hidden_size", self._encoder.hidden.in_dim)
        if D != want:
            raise ValueError(f"the taps are {D} wide but this controller was trained on a backbone with hidden size "
                             f"{want} ({fp or 'encoder input width'}); use a controller trained for this model")
        if self._device == device:
            return
        self._controller.to(device)
        self._encoder.to(device)
        self._device = device
        if self._encoder.kind == "linear":
            from tracelock.features import fold

            self._fold = fold(self._encoder, *self._controller.full_input_weight())

    def tap_fold(self, model):
        """The linear encoder folded with the controller's input projection, ``(A [3, D, width], c [width])`` on
        ``model``'s device (the fused loop's forward then writes the controller inputs with `ops.tap_project`);
        None for a nonlinear encoder, whose codes need the taps themselves."""
        self._prepare(model.device, model.spec.hidden_size)
        return self._fold

    def _inputs(self, taps) -> torch.Tensor:
        """[B, T, width] controller inputs from the raw taps (the reference path, and sampling / CFG steps): the
        fold by its spec `tap_project_ref`, else the codes through the input projection. Fused greedy steps get
        the same values from the forward (`tap_fold`)."""
        if self._fold is None:
            return self._controller.project(self._encoder.codes(*taps))
        B, T, D = taps[0].shape
        out = tap_project_ref(*(t.reshape(B * T, D) for t in taps), *self._fold)
        return out.reshape(B, T, -1)

    def context(self, inp: StepInput, T: int) -> tuple:
        """(key_mask [B, T], confidence input [B, T] or None) of the controller at one step: the sequence cropped
        after the region's last slot, with left padding masked."""
        positions, B = inp.positions, inp.positions.shape[0]
        # the region ends right after its last slot (slots past it repeat the last position)
        key_mask = torch.arange(T, device=positions.device) < (positions.max(dim=1).values + 1)[:, None]
        if inp.attention_mask is not None:
            key_mask &= inp.attention_mask[:, :T].bool()
        conf = None
        if self._controller.config.confidence_input:
            # max-prob at the active slots, 0 elsewhere (training's convention); inactive slots write a spare column
            where = torch.where(inp.active, positions, T)
            conf = torch.zeros(B, T + 1, device=positions.device).scatter(1, where, inp.signals.confidence.float())
            conf = conf[:, :T]
        return key_mask, conf

    @torch.no_grad()
    def slot_scores(self, inp: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """(a [B, R] controller scores of the slots, tau [B] the threshold logit used) at one step."""
        if (inp.taps is None and inp.tap_inputs is None) or inp.positions is None or inp.state is None:
            raise ValueError("the tracelock policy needs StepInput.positions, state and either taps or tap_inputs "
                             "(needs_taps = True); run it through fused_generate / reference_generate")
        if inp.tap_inputs is not None:
            inputs = inp.tap_inputs
            B, T, width = inputs.shape
            if self._fold is None or self._device != inputs.device or width != self._fold[1].shape[0]:
                raise ValueError(f"StepInput.tap_inputs [{B}, {T}, {width}] on {inputs.device} are not this "
                                 "policy's folded taps: fold them with policy.tap_fold(model) on the model's device "
                                 "(the fused loop does) or pass StepInput.taps instead")
        else:
            B, T, D = inp.taps[0].shape
            self._prepare(inp.taps[0].device, D)
            inputs = self._inputs(inp.taps)
        key_mask, conf = self.context(inp, T)
        a, tau = self._controller.forward_projected(inputs, inp.state[:, :T], key_mask, conf)
        if self.static_tau is not None:
            tau = torch.full_like(tau, self.static_tau)
        a = a.gather(1, inp.positions)
        if self.record_scores:
            self.last_scores = (a, tau)
        return a, tau

    def commit_rule(self, inp: StepInput) -> CommitRule:
        """The step as `ops.commit_step` inputs, for every rule the policy can carry (the paper's, the reference
        release's inclusive one, hold_end, each fallback): the fused loop and the engine close it with that op."""
        return self._rule(inp)

    def _rule(self, inp: StepInput) -> CommitRule:
        a, tau = self.slot_scores(inp)
        fallback = None if self.fallback == "score" else getattr(inp.signals, self.fallback)
        return CommitRule(a, tau, self.theta, self.cap or 0, fallback_score=fallback,
                          held=held_ends(inp) if self.hold_end else None, inclusive=self.reference_release)

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        # the selection half of commit_step's spec on the same rule: the torch path and the kernel agree by
        # construction
        rule = self._rule(inp)
        m = rule.score.float() - rule.tau.float()[:, None]
        return commit_select_ref(m, inp.active, commit_margin_threshold(rule.theta, rule.inclusive), rule.cap,
                                 rule.fallback_score, rule.held)
