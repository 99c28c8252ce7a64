"""Feature encoders of the three hidden-state taps, and their fold into one linear map.

Per position the controller reads five codes ``[E_h h1; E_h h2; E_h h3; E_d (h2 - h1); E_d (h3 - h2)]``
(paper, "Detailed feature construction"): E_h is shared by the three taps and E_d by the two deltas. Each
encoder standardises its input per dimension with a fixed mean and std and then projects it. The linear
encoders are fit by PCA on sampled hidden states; being linear, the whole feature path (standardisation and
deltas included) folds into ``h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c`` (`fold`), which is what deployment runs.
`AutoEncoder` is the nonlinear comparison point: same inputs, same code layout, no fold.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tracelock.atomic import atomic_write_text
from tracelock.integrity import CorruptFileError, load_tensors, read_json, save_tensors
from tracelock.models.sample import weights_sample

# the paper's widths; anything up to the backbone's hidden size may be asked for
REFERENCE_HIDDEN_DIM = 256
REFERENCE_DELTA_DIM = 32
GROUP_NAMES = ("h1", "h2", "h3", "d21", "d32")
# the feature ablations of the paper's appendix, as code groups
FEATURE_SETS = {
    "last_hidden": ("h3",),
    "deltas": ("d21", "d32"),
    "three_hidden": ("h1", "h2", "h3"),
    "all": GROUP_NAMES,
}
CONFIG_FILE, WEIGHTS_FILE = "encoder.json", "encoder.safetensors"
FORMAT = "tracelock-encoder/1"


# two backbones count as the same when their weight samples (`tracelock.models.sample`) differ by at most
# WEIGHTS_TOLERANCE (relative L2), so the same checkpoint loaded in bf16 or fp16 (rounding moves the sample by < 0.4%)
# still matches, while another checkpoint differs by order 1
WEIGHTS_TOLERANCE = 0.02


def backbone_fingerprint(model_or_spec) -> dict:
    """What an encoder (and a controller or filter) must match in a backbone: family, the sizes that shape the
    hidden states and, given the model itself rather than its spec, a sample of its weights (`weights_sample`)."""
    spec = getattr(model_or_spec, "spec", model_or_spec)
    fp = dict(family=spec.family, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
              vocab_size=spec.vocab_size)
    if hasattr(model_or_spec, "named_parameters"):
        fp["weights"] = weights_sample(model_or_spec)
    return fp


def describe_backbone(fp: dict) -> dict:
    """A fingerprint for messages: the shape keys, without the weight sample."""
    return {k: v for k, v in fp.items() if k != "weights"}


def backbone_mismatch(trained: dict, got: dict) -> str | None:
    """None when fingerprint ``got`` matches ``trained`` on the keys both record (older artifacts record no weight
    sample); else the reason, worded to follow "it was made for"."""
    if any(trained[k] != got[k] for k in trained.keys() & got.keys() if k != "weights"):
        return f"backbone {describe_backbone(trained)} but is used with {describe_backbone(got)}"
    a, b = trained.get("weights"), got.get("weights")
    if a and b and len(a) == len(b):
        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        rel = float((a - b).norm() / a.norm().clamp_min(1e-12))
        if rel > WEIGHTS_TOLERANCE:
            return (f"another backbone of the same shape ({describe_backbone(got)}): a sample of its weights differs "
                    f"from this model's by {rel:.2f} (relative; the same checkpoint in another dtype differs by "
                    f"< {WEIGHTS_TOLERANCE})")
    return None


class _Standardised(nn.Module):
    """Holds the fixed per-dimension ``mean`` and ``std`` [D] of an encoder's input."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    @property
    def in_dim(self) -> int:
        return self.mean.shape[0]

    def set_stats(self, samples: torch.Tensor):
        x = samples.double()
        std = x.std(0)
        # a constant dimension carries nothing; dividing it by ~0 would only amplify rounding
        self.mean.copy_(x.mean(0))
        self.std.copy_(torch.where(std > 1e-8, std, torch.ones_like(std)))

    def standardise(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.mean.dtype) - self.mean) / self.std


class LinearEncoder(_Standardised):
    """``x -> ((x - mean) / std) @ proj``, with ``proj`` [D, k] the top-k principal axes of standardised x."""

    def __init__(self, dim: int, width: int):
        super().__init__(dim)
        self.register_buffer("proj", torch.zeros(dim, width))

    @property
    def width(self) -> int:
        return self.proj.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.standardise(x) @ self.proj

    def reconstruction_error(self, x: torch.Tensor) -> float:
        """Mean squared error of the reconstruction, in standardised units."""
        z = self.standardise(x)
        return F.mse_loss(z @ self.proj @ self.proj.T, z).item()

    def affine(self) -> tuple:
        """(M [D, k], b [k]) float64 with ``self(x) == x @ M + b``."""
        proj = self.proj.double()
        scale = 1.0 / self.std.double()
        return proj * scale[:, None], -(self.mean.double() * scale) @ proj

    @classmethod
    def fit_pca(cls, samples: torch.Tensor, width: int) -> LinearEncoder:
        """Standardise ``samples`` [n, D] and keep the ``width`` directions of largest variance, in
        decreasing order; each axis is signed so that its largest-magnitude entry is positive (deterministic)."""
        enc = cls(samples.shape[1], width)
        enc.set_stats(samples)
        z = (samples.double() - enc.mean.double()) / enc.std.double()
        cov = z.T @ z / max(len(z) - 1, 1)
        _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
        top = vecs.flip(1)[:, :width]
        sign = torch.sign(top.gather(0, top.abs().argmax(0, keepdim=True)))
        enc.proj.copy_(top * sign)
        return enc


class AutoEncoder(_Standardised):
    """Nonlinear comparison encoder: standardise, then ``Linear -> GELU -> Linear`` to k codes; the decoder
    mirrors it. Trained by reconstruction MSE of the standardised input (`train_autoencoder`)."""

    def __init__(self, dim: int, width: int, hidden: int):
        super().__init__(dim)
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, width))
        self.decoder = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, dim))

    @property
    def width(self) -> int:
        return self.encoder[-1].out_features

    @property
    def hidden(self) -> int:
        return self.encoder[0].out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.standardise(x))

    @torch.no_grad()
    def reconstruction_error(self, x: torch.Tensor) -> float:
        z = self.standardise(x)
        return F.mse_loss(self.decoder(self.encoder(z)), z).item()


@torch.enable_grad()  # trains whatever the caller's grad mode (inside torch.no_grad() too)
def train_autoencoder(samples: torch.Tensor, width: int, *, hidden: int | None = None, steps: int = 500,
                      batch_size: int = 256, lr: float = 1e-3, seed: int = 0) -> AutoEncoder:
    """Fit an `AutoEncoder` on ``samples`` [n, D] (fp32, CPU or GPU) by Adam on the reconstruction MSE.

    Args:
        hidden (int, optional): width of the hidden layer. Default: ``2 * width``, at least 64.
        steps (int): optimiser steps (0 leaves the random initialisation). Default: 500.
        batch_size (int): rows per step, drawn with replacement. Default: 256.
    """
    gen = torch.Generator().manual_seed(seed)
    # the initialisation follows ``seed`` too, without disturbing the caller's global RNG
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ae = AutoEncoder(samples.shape[1], width, hidden or max(2 * width, 64)).to(samples.device)
    ae.set_stats(samples)
    opt = torch.optim.Adam(ae.parameters(), lr=lr)
    z_all = ae.standardise(samples.float())
    for _ in range(steps):
        z = z_all[torch.randint(len(z_all), (batch_size,), generator=gen).to(z_all.device)]
        loss = F.mse_loss(ae.decoder(ae.encoder(z)), z)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ae.eval().requires_grad_(False)


class TapEncoder(nn.Module):
    """The two encoders of the controller's input: ``hidden`` (E_h, for h1, h2, h3) and ``delta``
    (E_d, for h2 - h1 and h3 - h2), both `LinearEncoder` or both `AutoEncoder`.

    Args:
        hidden, delta: the two encoders, with the backbone's hidden size as input width.
        backbone (dict): `backbone_fingerprint` of the backbone the encoders were fit on.
        fit (dict, optional): JSON-able provenance of the fit (traces, positions, seed...).
    """

    def __init__(self, hidden, delta, backbone: dict, fit: dict | None = None):
        super().__init__()
        if type(hidden) is not type(delta) or not isinstance(hidden, (LinearEncoder, AutoEncoder)):
            raise TypeError("hidden and delta must both be LinearEncoder or both AutoEncoder, got "
                            f"{type(hidden).__name__} and {type(delta).__name__}")
        self.hidden, self.delta = hidden, delta
        self.backbone, self.fit = dict(backbone), dict(fit or {})

    @property
    def kind(self) -> str:
        return "linear" if isinstance(self.hidden, LinearEncoder) else "ae"

    @property
    def code_dim(self) -> int:
        return 3 * self.hidden.width + 2 * self.delta.width

    @property
    def groups(self) -> dict:
        """Code columns of each part: name -> (start, stop), names as in `GROUP_NAMES`."""
        widths = [self.hidden.width] * 3 + [self.delta.width] * 2
        starts = [sum(widths[:i]) for i in range(5)]
        return {n: (s, s + w) for n, s, w in zip(GROUP_NAMES, starts, widths)}

    def codes(self, h1: torch.Tensor, h2: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
        """[..., D] taps -> [..., 3 * hidden_dim + 2 * delta_dim] fp32 codes, laid out as `groups`."""
        h1, h2, h3 = (h.float() for h in (h1, h2, h3))
        parts = [self.hidden(h1), self.hidden(h2), self.hidden(h3), self.delta(h2 - h1), self.delta(h3 - h2)]
        return torch.cat([p.float() for p in parts], dim=-1)

    def config(self) -> dict:
        cfg = dict(format=FORMAT, kind=self.kind, in_dim=self.hidden.in_dim, hidden_dim=self.hidden.width,
                   delta_dim=self.delta.width, backbone=self.backbone, fit=self.fit)
        if self.kind == "ae":
            cfg["ae_hidden"] = [self.hidden.hidden, self.delta.hidden]
        return cfg

    def digest(self) -> str:
        """sha256 of the configuration and every tensor: what a feature cache records as its encoder."""
        h = hashlib.sha256(json.dumps(self.config(), sort_keys=True).encode())
        for name, t in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().float().contiguous().numpy().tobytes())
        return h.hexdigest()

    def check_backbone(self, model_or_spec, where="this encoder"):
        why = backbone_mismatch(self.backbone, backbone_fingerprint(model_or_spec))
        if why is not None:
            raise ValueError(f"{where} was fit on {why}; fit an encoder for this backbone with "
                             "`tracelock fit-encoder`")

    def save(self, folder) -> Path:
        """Write ``encoder.safetensors`` and ``encoder.json`` into ``folder`` (each atomically; the JSON last)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_tensors(folder / WEIGHTS_FILE, self.state_dict())
        text = json.dumps(self.config(), indent=1, sort_keys=True)
        atomic_write_text(folder / CONFIG_FILE, text)
        return folder




def load_encoder(folder, model=None, device=None) -> TapEncoder:
    """Read a `TapEncoder` written by `TapEncoder.save`; with ``model`` (a backbone or its spec), check that
    the encoder was fit on the same kind of backbone (a mismatch raises ValueError)."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{folder} holds no encoder ({CONFIG_FILE} and {WEIGHTS_FILE}); "
                                "write one with `tracelock fit-encoder --out FOLDER`")
    fix = "restore the folder from a copy or refit the encoder with `tracelock fit-encoder`"
    cfg = read_json(folder / CONFIG_FILE, fix=fix)
    if cfg.get("format") != FORMAT:
        raise ValueError(f"{folder / CONFIG_FILE}: format {cfg.get('format')!r}, expected {FORMAT!r}; refit it")
    tensors = load_tensors(folder / WEIGHTS_FILE, fix=fix)
    try:
        D = cfg["in_dim"]
        if cfg["kind"] == "linear":
            hidden, delta = LinearEncoder(D, cfg["hidden_dim"]), LinearEncoder(D, cfg["delta_dim"])
        else:
            hidden = AutoEncoder(D, cfg["hidden_dim"], cfg["ae_hidden"][0])
            delta = AutoEncoder(D, cfg["delta_dim"], cfg["ae_hidden"][1])
        enc = TapEncoder(hidden, delta, cfg["backbone"], cfg.get("fit"))
        enc.load_state_dict(tensors, strict=True)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:  # a config or weights of another encoder
        reason = (str(err).splitlines() or [""])[0]
        raise CorruptFileError(f"{folder / CONFIG_FILE} and {WEIGHTS_FILE} do not make an encoder "
                               f"({type(err).__name__}: {reason}); {fix}") from None
    if model is not None:
        enc.check_backbone(model, where=f"the encoder in {folder}")
    return enc.eval().requires_grad_(False).to(device or "cpu")


def fold(encoder: TapEncoder, weight: torch.Tensor, bias: torch.Tensor) -> tuple:
    """Fold the encoders (standardisation and deltas included) into a linear map of the raw taps.

    Args:
        encoder (TapEncoder): a linear one.
        weight (torch.Tensor): [N, C] projection of the codes, C = ``encoder.code_dim``.
        bias (torch.Tensor): [N].

    Returns:
        (A [3, D, N] fp32, c [N] fp32) with
        ``codes(h1, h2, h3) @ weight.T + bias == h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c``.
    """
    if encoder.kind != "linear":
        raise ValueError(f"a {encoder.kind!r} encoder is nonlinear and cannot be folded into a linear map; "
                         "fit a linear encoder (`tracelock fit-encoder --kind linear`) for deployment")
    C = encoder.code_dim
    if weight.ndim != 2 or weight.shape[1] != C or bias.shape != (weight.shape[0],):
        raise ValueError(f"weight must be [N, {C}] and bias [N] for this encoder's {C} codes; got "
                         f"{tuple(weight.shape)} and {tuple(bias.shape)}")
    Mh, bh = (t.to(weight.device) for t in encoder.hidden.affine())
    Md, bd = (t.to(weight.device) for t in encoder.delta.affine())
    g = encoder.groups
    W = {n: weight.double()[:, s:e].T for n, (s, e) in g.items()}  # [width, N] each
    # codes = [h1 Mh + bh, h2 Mh + bh, h3 Mh + bh, (h2 - h1) Md + bd, (h3 - h2) Md + bd]
    A = torch.stack([
        Mh @ W["h1"] - Md @ W["d21"],
        Mh @ W["h2"] + Md @ W["d21"] - Md @ W["d32"],
        Mh @ W["h3"] + Md @ W["d32"],
    ])
    c = bias.double() + bh @ (W["h1"] + W["h2"] + W["h3"]) + bd @ (W["d21"] + W["d32"])
    return A.float(), c.float()


def _width(asked, reference: int, D: int, name: str) -> int:
    if asked is None:
        return min(reference, D)
    if not 1 <= asked <= D:
        raise ValueError(f"{name}={asked} must be between 1 and the backbone's hidden size {D} (codes wider than "
                         f"the hidden state carry nothing more); pass {name} <= {D}")
    return int(asked)


def fit_encoder(model, traces, hidden_dim: int | None = None, delta_dim: int | None = None, *,
                kind: str = "linear", max_positions: int = 8192, seed: int = 0, batch_size: int = 8,
                ae_steps: int = 500) -> TapEncoder:
    """Fit E_h and E_d on positions sampled uniformly from the replayed recorded steps of ``traces``.

    Args:
        model (DiffusionBackbone): the frozen backbone the traces were decoded with.
        traces (iterable of Trace): the traces (read twice: held in a list).
        hidden_dim, delta_dim (int, optional): code widths. Default: 256 and 32 (the paper's), clamped to the
            hidden size; an explicit width above it is an error.
        kind (str): "linear" (PCA, foldable) or "ae" (`AutoEncoder`, the comparison point). Default: "linear".
        max_positions (int): (trace, step, position) samples. Default: 8192.
        ae_steps (int): optimiser steps of each autoencoder. Default: 500.

    Returns:
        TapEncoder on the CPU.
    """
    from tracelock.traces.replay import sample_taps

    if kind not in ("linear", "ae"):
        raise ValueError(f"kind={kind!r}: choose 'linear' (PCA) or 'ae' (nonlinear autoencoder)")
    D = model.spec.hidden_size
    dh = _width(hidden_dim, REFERENCE_HIDDEN_DIM, D, "hidden_dim")
    dd = _width(delta_dim, REFERENCE_DELTA_DIM, D, "delta_dim")
    traces = list(traces)
    taps = sample_taps(model, traces, max_positions, seed=seed, batch_size=batch_size).cpu()  # [n, 3, D]
    if len(taps) < max(dh, dd):
        raise ValueError(f"only {len(taps)} positions to fit {max(dh, dd)} code dimensions; give more traces "
                         "or lower hidden_dim / delta_dim")
    hid_samples = taps.reshape(-1, D)
    delta_samples = torch.cat([taps[:, 1] - taps[:, 0], taps[:, 2] - taps[:, 1]])
    if kind == "linear":
        hidden, delta = LinearEncoder.fit_pca(hid_samples, dh), LinearEncoder.fit_pca(delta_samples, dd)
    else:
        hidden = train_autoencoder(hid_samples, dh, steps=ae_steps, seed=seed)
        delta = train_autoencoder(delta_samples, dd, steps=ae_steps, seed=seed + 1)
    fit = dict(traces=len(traces), positions=len(taps), seed=seed,
               reconstruction_mse=dict(hidden=hidden.reconstruction_error(hid_samples),
                                       delta=delta.reconstruction_error(delta_samples)))
    return TapEncoder(hidden, delta, backbone_fingerprint(model), fit).eval()
