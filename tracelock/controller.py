"""The TraceLock controller: one module for training and deployment (paper §3.2; docs/design.md).

Per position the input is the selected code groups of the feature cache / tap encoder
(``[E_h h1; E_h h2; E_h h3; E_d d1; E_d d2]``), projected to the controller width, plus optional
max-prob confidence and state embeddings, plus a sinusoidal position encoding. A learned threshold token
is prepended; a pre-norm Transformer encoder runs over ``[tau token, positions 0..T)`` with a key-padding
mask (positions beyond the crop and left padding are invisible); a score head gives ``a [B, T]`` and a
threshold head on the tau token gives ``tau [B]``. The decision logit is the margin ``m = a - tau``.

Position encoding: sinusoidal, counted from each row's first visible position (so a left-padded row sees
the positions it would see alone). Sinusoidal rather than learned because one checkpoint must serve any
prompt + generation length (paper §3.3); no ``max_len`` to outgrow.

The input projection is the only part that touches codes, so at deployment it folds with a linear encoder
into ``h1 @ A1 + h2 @ A2 + h3 @ A3 + c`` (`tracelock.features.fold`) and the rest runs as
:meth:`Controller.forward_projected`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from tracelock import states
from tracelock.atomic import atomic_write_text
from tracelock.integrity import CorruptFileError, load_tensors, read_tagged_json, require_pair, save_tensors

__all__ = ["COMMIT_RULES", "FALLBACKS", "FEATURE_SETS", "Controller", "ControllerConfig", "active_confidence",
           "check_commit_rule", "check_fingerprint", "commit_rule_named", "controller_fingerprint"]

# code groups each feature set reads (paper Table "Feature ablations"); group names as in `tracelock.features`
FEATURE_SETS = {
    "last": ("h3",),
    "deltas": ("d21", "d32"),
    "hidden": ("h1", "h2", "h3"),
    "all": ("h1", "h2", "h3", "d21", "d32"),
}


def controller_fingerprint(model=None, encoder=None) -> dict:
    """What a controller is tied to: the backbone (`tracelock.features.backbone_fingerprint`: family and the
    sizes that shape its taps) and the encoder that wrote its codes (`TapEncoder.digest`)."""
    from tracelock.features import backbone_fingerprint

    fp = {}
    if model is not None:
        fp["backbone"] = backbone_fingerprint(model)
    if encoder is not None:
        fp["encoder"] = encoder.digest()
    return fp


def check_fingerprint(trained: dict, given: dict) -> None:
    """Raise when ``given`` disagrees with the fingerprint a controller was trained with (on the keys both have;
    the backbone by `tracelock.features.backbone_mismatch`, which also compares a sample of the weights)."""
    from tracelock.features import backbone_mismatch

    for key in sorted(trained.keys() & given.keys()):
        if key == "backbone":
            why = backbone_mismatch(trained[key], given[key])
            if why is not None:
                raise ValueError(f"this controller was trained for {why}; train a controller on traces (and codes) "
                                 "of this backbone")
        elif trained[key] != given[key]:
            raise ValueError(f"this controller was trained for {key} {trained[key]} but is used with {given[key]}; "
                             f"train a controller on traces (and codes) of this {key}")


# what a step commits when no slot clears theta: the controller's best slot (the paper's rule) or the backbone's most
# certain slot by that score (`TraceLockPolicy`'s ``fallback``)
FALLBACKS = ("score", "confidence", "neg_entropy")
# each backbone family's own one-per-step score (LLaDA: max-prob, Dream: neg-entropy)
FAMILY_SCORE = {"llada": "confidence", "dream": "neg_entropy"}
COMMIT_RULES = ("paper", "hold-end")


def check_commit_rule(rule) -> None:
    """Raise ValueError unless ``rule`` is a controller's commit rule: a dict of ``hold_end`` (bool) and
    ``fallback`` (one of FALLBACKS), both optional."""
    if not isinstance(rule, dict) or set(rule) - {"hold_end", "fallback"}:
        raise ValueError(f"commit_rule={rule!r} must be a dict of hold_end (true/false) and fallback "
                         f"({', '.join(FALLBACKS)}), e.g. {{}} for the paper's rule")
    if not isinstance(rule.get("hold_end", False), bool):
        raise ValueError(f"commit_rule hold_end={rule['hold_end']!r} must be true or false")
    if rule.get("fallback", "score") not in FALLBACKS:
        raise ValueError(f"commit_rule fallback={rule['fallback']!r} must be one of {', '.join(FALLBACKS)}")


def commit_rule_named(name: str, fingerprint: dict) -> dict:
    """The `ControllerConfig.commit_rule` a name stands for: "paper", the paper's rule (``{}``); "hold-end", an
    end-of-text proposal waits for the text left of it and, when no slot clears theta, the backbone's most certain
    slot by its family's own score commits (chosen on the bundled models' validation split: docs/frontier.md)."""
    if name == "paper":
        return {}
    if name != "hold-end":
        raise ValueError(f"commit_rule={name!r} must be one of {', '.join(COMMIT_RULES)}")
    family = fingerprint.get("backbone", {}).get("family")
    if family not in FAMILY_SCORE:
        raise ValueError(f"commit_rule='hold-end' falls back to the backbone family's own score, but the codes' "
                         f"backbone family is {family!r} (one of {', '.join(FAMILY_SCORE)} is needed): featurize "
                         "the traces with this version's `tracelock featurize`, or use commit_rule='paper'")
    return {"hold_end": True, "fallback": FAMILY_SCORE[family]}


@dataclass
class ControllerConfig:
    """Architecture of a controller (paper appendix: 3 layers, 8 heads, width 384, FFN 768, dropout 0.1).

    ``groups`` maps code-group names to ``[start, stop)`` columns of the code vector (``code_dim`` wide);
    ``fingerprint`` is the backbone + encoder the codes come from (`controller_fingerprint`, checked on use).
    ``commit_rule`` is the rule the controller deploys with unless the policy is told otherwise (`TraceLockPolicy`'s
    ``hold_end`` and ``fallback``): ``{}`` the paper's, or e.g. ``{"hold_end": True, "fallback": "confidence"}``
    (`commit_rule_named`).
    """

    code_dim: int
    groups: dict
    features: str = "all"
    width: int = 384
    layers: int = 3
    heads: int = 8
    ffn: int = 768
    dropout: float = 0.1
    confidence_input: bool = False
    state_embedding: bool = False
    fingerprint: dict = field(default_factory=dict)
    commit_rule: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("code_dim", "width", "layers", "heads", "ffn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout!r} must be a number in [0, 1)")
        if not isinstance(self.groups, dict) or not isinstance(self.fingerprint, dict):
            raise ValueError(f"groups and fingerprint must be dicts, got {type(self.groups).__name__} and "
                             f"{type(self.fingerprint).__name__}")
        # JSON has no tuples: keep the in-memory form equal to a loaded one
        self.groups = {str(k): [int(v[0]), int(v[1])] for k, v in self.groups.items()}
        if self.features not in FEATURE_SETS:
            raise ValueError(f"features={self.features!r} must be one of {sorted(FEATURE_SETS)}")
        missing = [g for g in FEATURE_SETS[self.features] if g not in self.groups]
        if missing:
            raise ValueError(f"features={self.features!r} needs code groups {missing}, but the codes have "
                             f"{sorted(self.groups)}; pick a feature set the encoder provides")
        if self.width % self.heads:
            raise ValueError(f"width={self.width} must be a multiple of heads={self.heads}")
        check_commit_rule(self.commit_rule)

    def columns(self) -> list[int]:
        """Code columns the input projection reads, in group order."""
        return [c for g in FEATURE_SETS[self.features] for c in range(*self.groups[g])]


def sinusoidal(pos: torch.Tensor, width: int) -> torch.Tensor:
    """[..., width] Vaswani et al. encoding of integer positions."""
    freq = torch.exp(torch.arange(0, width, 2, device=pos.device, dtype=torch.float32) * (-math.log(1e4) / width))
    angle = pos.float()[..., None] * freq
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)[..., :width]


class Controller(nn.Module):
    """Scores every position and predicts the step's threshold.

    Args:
        config (ControllerConfig): architecture and the code layout it reads.
    """

    def __init__(self, config: ControllerConfig):
        super().__init__()
        self.config = config
        w = config.width
        self.register_buffer("columns", torch.tensor(config.columns(), dtype=torch.long), persistent=False)
        self.input_proj = nn.Linear(len(config.columns()), w)
        self.conf_proj = nn.Linear(1, w) if config.confidence_input else None
        self.state_emb = nn.Embedding(4, w) if config.state_embedding else None
        self.tau_token = nn.Parameter(torch.randn(w) * 0.02)
        layer = nn.TransformerEncoderLayer(w, config.heads, config.ffn, config.dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        # nested tensors would zero the outputs at masked positions in eval mode only: keep train == eval
        self.encoder = nn.TransformerEncoder(layer, config.layers, norm=nn.LayerNorm(w), enable_nested_tensor=False)
        self.score_head = nn.Linear(w, 1)
        self.tau_head = nn.Sequential(nn.Linear(w, w), nn.GELU(), nn.Linear(w, 1))

    def project(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, T, C] full code vectors -> [B, T, width] (the part that folds into the encoder)."""
        return self.input_proj(codes.index_select(-1, self.columns))

    def full_input_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The input projection over *all* ``code_dim`` columns (zeros for unused groups): weight [width, C], bias
        [width], the form `tracelock.features.fold` takes."""
        weight = self.input_proj.weight.new_zeros(self.config.width, self.config.code_dim)
        weight[:, self.columns] = self.input_proj.weight
        return weight, self.input_proj.bias

    def forward(self, codes, state, key_mask, confidence=None):
        """Args:
            codes (torch.Tensor): [B, T, C] code vectors.
            state (torch.Tensor): [B, T] `tracelock.states` of each position.
            key_mask (torch.BoolTensor): [B, T] True = visible (inside the crop, not padding).
            confidence (torch.Tensor, optional): [B, T] max-prob of the proposal at active positions, 0 elsewhere;
                required when the config has ``confidence_input``.

        Returns:
            (a [B, T], tau [B]) fp32: scores and the threshold logit; the margin is ``a - tau[:, None]``.
        """
        return self.forward_projected(self.project(codes), state, key_mask, confidence)

    def forward_projected(self, inputs, state, key_mask, confidence=None):
        """:meth:`forward` after the input projection: ``inputs`` [B, T, width] = ``project(codes)``."""
        B, T, w = inputs.shape
        if key_mask.shape != (B, T) or state.shape != (B, T):
            raise ValueError(f"state {list(state.shape)} and key_mask {list(key_mask.shape)} must be [B, T] = "
                             f"{[B, T]} like the inputs")
        x = inputs.float()
        if self.conf_proj is not None:
            if confidence is None:
                raise ValueError("this controller was trained with confidence_input: pass confidence [B, T]")
            x = x + self.conf_proj(confidence.float()[..., None])
        if self.state_emb is not None:
            x = x + self.state_emb(state.long())
        key_mask = key_mask.bool()
        # positions count from each row's first visible position (left padding gets 0; it is masked)
        pos = (key_mask.long().cumsum(-1) - 1).clamp_min(0)
        x = x + sinusoidal(pos, w)
        x = torch.cat([self.tau_token.expand(B, 1, w), x], dim=1)
        visible = torch.cat([key_mask.new_ones(B, 1), key_mask], dim=1)
        h = self.encoder(x, src_key_padding_mask=~visible)
        return self.score_head(h[:, 1:]).squeeze(-1), self.tau_head(h[:, 0]).squeeze(-1)

    def save(self, path) -> Path:
        """Write ``path`` (.safetensors, with its digest) and its config beside it (same name, .json), each
        atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tensors(path, self.state_dict())
        config = json.dumps({"kind": "tracelock-controller", **asdict(self.config)}, indent=2)
        atomic_write_text(path.with_suffix(".json"), config + "\n")
        return path

    @classmethod
    def load(cls, path, *, model=None, encoder=None, device=None) -> Controller:
        """Load a controller saved by :meth:`save` (a .safetensors path, or a folder holding best.safetensors).

        Args:
            model, encoder (optional): the backbone and `TapEncoder` it will run with; a fingerprint mismatch with
                the ones it was trained on raises ValueError naming both.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "best.safetensors"
        cfg_path = path.with_suffix(".json")
        require_pair(path, cfg_path, what="controller",
                     hint="pass the .safetensors written by `tracelock train` or its --out folder")
        fix = "restore the run folder from a copy or train the controller again with `tracelock train`"
        raw = read_tagged_json(cfg_path, key="kind", tag="tracelock-controller", what="tracelock controller config",
                               fix=fix)
        try:
            config = ControllerConfig(**raw)
        except (TypeError, ValueError) as err:
            raise CorruptFileError(f"{cfg_path} does not hold a valid controller config ({err}); {fix}") from None
        check_fingerprint(config.fingerprint, controller_fingerprint(model, encoder))
        model = cls(config)
        tensors = load_tensors(path, fix=fix)
        try:
            model.load_state_dict(tensors)
        except RuntimeError as err:  # weights of another architecture than the config describes
            raise CorruptFileError(f"{path} does not match {cfg_path.name} ({str(err).splitlines()[0]}); {fix}") \
                from None
        return model.to(device).eval() if device is not None else model.eval()




def active_confidence(confidence: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Confidence input: max-prob at active positions, 0 elsewhere (and where unknown: NaN in traces).

    At deployment the loop computes logits only for the commit region's slots, so the controller must not
    depend on confidences of prompt or committed positions; training uses the same convention.
    """
    ok = (state == states.ACTIVE) & torch.isfinite(confidence)
    return torch.where(ok, confidence.float(), torch.zeros((), device=confidence.device))
