"""The Learn2PD filter: a two-layer MLP from one block's per-position inputs to one logit per position.

Upstream (`LogisticRegression(input_dim=32)`, about 2K parameters) reads the block's float32 confidences, the
already-committed positions included, and is trained once per backbone and block size. ``features > 1`` is the
TraceLock paper's L2P-Hidden diagnostic: the same blockwise interface, but each position brings its hidden-state
codes (the `tracelock.features.TapEncoder` codes of its three taps) instead of one confidence.

A folder holds one filter per block size, ``block-<N>.safetensors`` + ``block-<N>.json`` (``hidden-block-<N>.*``
for L2P-Hidden), written atomically, so `tracelock train-l2p` can add block sizes to the same folder.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from tracelock.atomic import atomic_write_text
from tracelock.integrity import CorruptFileError, load_tensors, read_tagged_json, require_pair, save_tensors

__all__ = ["FilterConfig", "L2PFilter", "filter_stem", "load_filter", "load_filters"]

FORMAT = "tracelock-l2p-filter-1"
# Learn2PD's released decision thresholds: LLaDA family 0.96, Dream family 0.9
DEFAULT_THRESHOLD = {"llada": 0.96, "dream": 0.9}


@dataclass
class FilterConfig:
    """Args:
        block (int): positions per filter input (the block size it was trained for).
        hidden (int): width of the hidden layer. Upstream's 2-layer filter at block 32 has about 2K parameters,
            i.e. ``hidden = block``.
        features (int): inputs per position: 1 (confidence, Learn2PD) or the encoder's code width (L2P-Hidden).
        family (str): backbone family ("llada" / "dream"): picks the default threshold and the scheduled rule.
        eos_id (int, optional): the backbone's end-of-text token (what end-of-text prediction looks for).
        backbone (dict): `tracelock.features.backbone_fingerprint` of the backbone its traces came from.
        train (dict): JSON-able provenance (traces, epochs, lr, metrics...).
    """

    block: int
    hidden: int
    features: int = 1
    family: str = "llada"
    eos_id: int | None = None
    backbone: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "confidence" if self.features == 1 else "hidden"


def filter_stem(block: int, kind: str = "confidence") -> str:
    """File stem of a filter in its folder: ``block-16`` (confidence) or ``hidden-block-16`` (L2P-Hidden)."""
    return f"block-{block}" if kind == "confidence" else f"hidden-block-{block}"


class L2PFilter(nn.Module):
    """``Linear(block * features, hidden) -> ReLU -> Linear(hidden, block)``.

    Args:
        config (FilterConfig): sizes and provenance.

    Shapes:
        input: [N, block] confidences (``features == 1``) or [N, block, features] codes.
        output: [N, block] logits; `accept` compares ``sigmoid(logit) > threshold``.
    """

    def __init__(self, config: FilterConfig):
        super().__init__()
        for name in ("block", "hidden", "features"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FilterConfig.{name}={value!r} must be a positive int")
        self.config = config
        self.net = nn.Sequential(nn.Linear(config.block * config.features, config.hidden), nn.ReLU(),
                                 nn.Linear(config.hidden, config.block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        want = (c.block,) if c.features == 1 else (c.block, c.features)
        if tuple(x.shape[1:]) != want:
            raise ValueError(f"the filter reads [N, {', '.join(map(str, want))}] inputs (block {c.block}, "
                             f"{c.features} per position); got {list(x.shape)}")
        return self.net(x.float().reshape(len(x), -1))

    def save(self, folder) -> Path:
        """Write ``<stem>.safetensors`` then ``<stem>.json`` into ``folder`` (each atomically). Returns the JSON."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stem = filter_stem(self.config.block, self.config.kind)
        save_tensors(folder / f"{stem}.safetensors", self.state_dict())
        atomic_write_text(folder / f"{stem}.json", json.dumps(dict(format=FORMAT, **asdict(self.config)), indent=1,
                                                               sort_keys=True))
        return folder / f"{stem}.json"


def load_filter(path) -> L2PFilter:
    """Read one filter from its ``.json`` (its ``.safetensors`` beside it)."""
    path = Path(path)
    weights = path.with_suffix(".safetensors")
    require_pair(path, weights, what="Learn2PD filter", hint="train one with `tracelock train-l2p --out FOLDER`")
    fix = "restore it from a copy or train the filter again with `tracelock train-l2p`"
    cfg = read_tagged_json(path, key="format", tag=FORMAT, what=f"{FORMAT} file", fix=fix)
    tensors = load_tensors(weights, fix=fix)
    try:
        filt = L2PFilter(FilterConfig(**cfg))
        filt.load_state_dict(tensors, strict=True)
    except (TypeError, ValueError, RuntimeError) as err:  # a config or weights of another filter
        reason = (str(err).splitlines() or [""])[0]
        raise CorruptFileError(f"{path} and {weights.name} do not make a filter ({type(err).__name__}: {reason}); "
                               f"{fix}") from None
    return filt.eval().requires_grad_(False)


def load_filters(folder, kind: str = "confidence") -> dict[int, L2PFilter]:
    """{block size: filter} of the filters of ``kind`` ("confidence" or "hidden") in a `train-l2p` folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder of Learn2PD filters; write one with "
                                "`tracelock train-l2p --out FOLDER`")
    prefix = "block-" if kind == "confidence" else "hidden-block-"
    found = {}
    for path in sorted(folder.glob(f"{prefix}*.json")):
        m = re.fullmatch(re.escape(prefix) + r"(\d+)", path.stem)
        if m:
            found[int(m[1])] = load_filter(path)
    if not found:
        raise FileNotFoundError(f"{folder} holds no {kind} Learn2PD filter ({prefix}N.json); train one with "
                                f"`tracelock train-l2p --out {folder}`")
    return found
