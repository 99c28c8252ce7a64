"""Supervised training of the TraceLock controller on a feature cache (paper §3.2 and appendix).

Each cache item is one recorded (trace, step): codes [L, C], states, labels (1 stable / 0 not / -1 none), eot
flags, confidences and the prompt length. A batch is a set of items, right-padded to its longest row, each
with a random prefix crop ``K = round(r N)``, ``r ~ U(0.25, 1)`` of its generation region (at least one
position): attention sees positions ``< P + K`` only and only those count in the loss.

Determinism: the items and crops of step s are a pure function of (seed, s), and dropout is reseeded from
(seed, s, rank) at every step, so a resumed run repeats the uninterrupted one exactly. Under ``torchrun``
(DDP, gloo on CPU) rank r takes its slice of the same global batch, and the loss is normalised by the global
counts, so the gradient equals a single-process step on the whole batch.

Selection: every ``eval_every`` steps the validation split is scored on a *fixed* crop (drawn once from the
seed) and ``best.safetensors`` follows the best rollout-proxy F0.5 (`tracelock.train.metrics.f_beta` of the
commit decision ``sigmoid(m) > 0.5``, positive = stable: a wrong commit is never revised, so precision counts
four times as much as recall). At the end the best checkpoint's held-out metrics go to ``metrics.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tracelock import states
from tracelock.atomic import atomic_write_json, atomic_write_text, folder_lock, remove_stale_temps
from tracelock.controller import COMMIT_RULES, Controller, ControllerConfig, active_confidence, commit_rule_named
from tracelock.integrity import load_tensors, read_json, save_tensors
from tracelock.train import metrics
from tracelock.train.state import load_training_tensors, training_tensors

__all__ = ["TrainConfig", "batch_items", "collate", "controller_loss", "crop_lengths", "loss_terms", "train"]

# the fields of TrainConfig a resumed run must share with the run it continues (steps may grow)
_FIXED = ("batch_size", "lr", "weight_decay", "clip", "seed", "val_fraction", "features", "confidence_input",
          "state_embedding", "width", "layers", "heads", "ffn", "dropout", "k", "lambda_tau", "eot_weight", "init",
          "mix_cache", "alpha")
# the architecture: TrainConfig's fields that ControllerConfig takes (a warm start takes them from its checkpoint)
_ARCHITECTURE = ("features", "confidence_input", "state_embedding", "width", "layers", "heads", "ffn", "dropout")
_ARCH_DEFAULTS = {f.name: f.default for f in fields(ControllerConfig) if f.name in _ARCHITECTURE}


@dataclass
class TrainConfig:
    """Hyperparameters (paper appendix; ``lambda_tau`` as in the reference release, the paper does not state it).

    ``encoder`` is the folder of the `TapEncoder` that wrote the cache (checked against the cache's digest and
    copied into ``out``, so the run folder alone deploys with `TraceLockPolicy`).
    """

    cache: str
    out: str
    steps: int = 10000
    batch_size: int = 64
    lr: float = 1e-4
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 42
    eval_every: int = 500
    val_fraction: float = 0.1
    # the architecture, ControllerConfig's defaults (the paper's)
    features: str = _ARCH_DEFAULTS["features"]
    confidence_input: bool = _ARCH_DEFAULTS["confidence_input"]
    state_embedding: bool = _ARCH_DEFAULTS["state_embedding"]
    width: int = _ARCH_DEFAULTS["width"]
    layers: int = _ARCH_DEFAULTS["layers"]
    heads: int = _ARCH_DEFAULTS["heads"]
    ffn: int = _ARCH_DEFAULTS["ffn"]
    dropout: float = _ARCH_DEFAULTS["dropout"]
    k: float = 4.0
    lambda_tau: float = 1e-3
    eot_weight: float = 1.0
    encoder: str | None = None
    device: str | None = None
    # warm start: a controller (run folder or .safetensors) whose architecture and weights the run starts from (its
    # architecture replaces the fields above, in the run's records too)
    init: str | None = None
    # self-training: a second cache mixed in at share alpha (`tracelock.train.mix.MixedCache`)
    mix_cache: str | None = None
    alpha: float | None = None
    # the commit rule the controller deploys with (`tracelock.controller.commit_rule_named`: "paper" or "hold-end");
    # None: the paper's for a fresh controller, the checkpoint's for a warm start
    commit_rule: str | None = None

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "width", "layers", "heads", "ffn"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive int")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction={self.val_fraction} must lie in (0, 1)")
        if (self.mix_cache is None) != (self.alpha is None):
            raise ValueError("mix_cache and alpha go together: pass both (a self-training mix) or neither")
        if self.commit_rule not in (None, *COMMIT_RULES):
            raise ValueError(f"commit_rule={self.commit_rule!r} must be one of {', '.join(COMMIT_RULES)}")


def crop_lengths(gen_lengths: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Visible generation prefix ``K = round(r N)`` per item (round half to even), at least 1, at most N."""
    gen_lengths = np.asarray(gen_lengths)
    return np.clip(np.rint(np.asarray(r) * gen_lengths), 1, np.maximum(gen_lengths, 1)).astype(np.int64)


def collate(items: list, crop_r: np.ndarray, device=None) -> dict:
    """Right-pad items to the longest and apply their crops.

    Returns:
        dict of tensors [B, L]: codes [B, L, C] fp32, state (long), label (long, -1 = none), eot (bool),
        confidence (fp32, 0 off active positions), key_mask (bool: inside the crop).
    """
    B, L = len(items), max(len(it["state"]) for it in items)
    C = items[0]["codes"].shape[1]
    codes = np.zeros((B, L, C), np.float32)
    state = np.full((B, L), states.PROMPT, np.int64)
    label = np.full((B, L), -1, np.int64)
    eot = np.zeros((B, L), bool)
    conf = np.zeros((B, L), np.float32)
    lengths = np.array([len(it["state"]) for it in items])
    prompt = np.array([int(it["prompt_len"]) for it in items])
    for b, it in enumerate(items):
        n = lengths[b]
        codes[b, :n], state[b, :n], label[b, :n] = it["codes"], it["state"], it["label"]
        eot[b, :n], conf[b, :n] = it["eot"], it["confidence"]
    end = prompt + crop_lengths(lengths - prompt, crop_r)
    batch = dict(codes=codes, state=state, label=label, eot=eot, confidence=conf,
                 key_mask=np.arange(L)[None] < end[:, None])
    batch = {k: torch.from_numpy(v).to(device) for k, v in batch.items()}
    batch["confidence"] = active_confidence(batch["confidence"], batch["state"])
    return batch


def loss_terms(a, tau, label, state, key_mask, eot=None, *, k: float = 4.0, eot_weight: float = 1.0):
    """Sums behind the loss: (weighted BCE summed over Omega, |Omega|, sum of tau^2).

    Omega = active positions with a label inside the crop. The weight is ``k`` where the decision ``m > 0``
    disagrees with the label, else 1, times ``eot_weight`` at positions whose final token is an end token.
    """
    m = a - tau[:, None]
    omega = (state == states.ACTIVE) & (label >= 0) & key_mask
    y = (label > 0).float()
    w = torch.where((m.detach() > 0) != (label > 0), k, 1.0)
    if eot is not None:
        w = w * torch.where(eot, eot_weight, 1.0)
    bce = F.binary_cross_entropy_with_logits(m, y, reduction="none")
    return (w * bce)[omega].sum(), omega.sum(), (tau ** 2).sum()


def controller_loss(a, tau, label, state, key_mask, eot=None, *, k: float = 4.0, lambda_tau: float = 1e-3,
                    eot_weight: float = 1.0) -> torch.Tensor:
    """The paper's L_dyn: ``mean_Omega W * BCE(a - tau, y) + lambda_tau * mean(tau^2)`` (0 from an empty Omega).

    Args:
        a (torch.Tensor): [B, L] scores. tau (torch.Tensor): [B] threshold logits.
        label (torch.Tensor): [B, L] 1 / 0 / -1 (no label). state (torch.Tensor): [B, L] position states.
        key_mask (torch.BoolTensor): [B, L] inside the crop. eot (torch.BoolTensor, optional): [B, L].
    """
    wbce, n, tau_sq = loss_terms(a, tau, label, state, key_mask, eot, k=k, eot_weight=eot_weight)
    return wbce / n.clamp_min(1) + lambda_tau * tau_sq / tau.numel()


def batch_items(train_idx: np.ndarray, step: int, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(item indices [batch_size], crop fractions r [batch_size]) of global step ``step``: epochs of seeded
    permutations of ``train_idx`` read in order, so every item is seen once per epoch."""
    n = len(train_idx)
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    idx = np.empty(batch_size, np.int64)
    for epoch in np.unique(flat // n):
        sel = flat // n == epoch
        idx[sel] = np.random.default_rng([seed, 0, int(epoch)]).permutation(train_idx)[flat[sel] % n]
    return idx, np.random.default_rng([seed, 1, step]).uniform(0.25, 1.0, batch_size)


def validation_crop(val_idx: np.ndarray, seed: int) -> np.ndarray:
    """The fixed crop fractions of the validation items: drawn once from the seed, the same at every evaluation."""
    return np.random.default_rng([seed, 2]).uniform(0.25, 1.0, len(val_idx))


@torch.no_grad()
def controller_scores(model, cache, idx, crop_r, batch_size: int, device) -> tuple[np.ndarray, np.ndarray]:
    """Margins and labels of every loss position (Omega under the given crops) of the items ``idx``."""
    model.eval()
    scores, labels = [], []
    for lo in range(0, len(idx), batch_size):
        batch = collate([cache[int(i)] for i in idx[lo:lo + batch_size]], crop_r[lo:lo + batch_size], device)
        a, tau = model(batch["codes"], batch["state"], batch["key_mask"], batch["confidence"])
        omega = (batch["state"] == states.ACTIVE) & (batch["label"] >= 0) & batch["key_mask"]
        scores.append((a - tau[:, None])[omega].cpu().numpy())
        labels.append(batch["label"][omega].cpu().numpy())
    model.train()
    return np.concatenate(scores), np.concatenate(labels)


def _dist():
    """(rank, world size, whether this call started the process group), starting it under torchrun (gloo on CPU,
    nccl on CUDA) unless the caller (`tracelock fit`) already has."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    started = world > 1 and not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return ((torch.distributed.get_rank(), world) if world > 1 else (0, 1)) + (started,)


def _save_state(out: Path, step: int, model, opt, info: dict) -> None:
    """Resumable state: weights + optimiser moments in ``state-<step>.safetensors``, then ``state.json`` naming
    it (the JSON is replaced last, so a crash leaves the previous consistent pair)."""
    name = f"state-{step:08d}.safetensors"
    save_tensors(out / name, training_tensors(model, opt))
    text = json.dumps(dict(info, step=step, file=name), indent=1)
    atomic_write_text(out / "state.json", text)
    for old in out.glob("state-*.safetensors"):
        if old.name != name:
            old.unlink()


def _load_state(out: Path, model, opt) -> dict:
    fix = (f"restore {out} from a copy, or delete its state.json to train again from the start (same command "
           "without --resume)")
    info = read_json(out / "state.json", fix=fix)
    load_training_tensors(load_tensors(out / str(info.get("file")), fix=fix), model, opt)
    return info


def _progress(total: int, initial: int, enabled: bool):
    from tracelock.progress import progress_bar

    return progress_bar(total=total, initial=initial, disable=not enabled, desc="train", unit="step")


def train(config: TrainConfig, *, cache=None, resume: bool = False) -> Path:
    """Train a controller; returns the output folder.

    Args:
        config (TrainConfig): settings; ``config.cache`` is opened with `tracelock.traces.cache.FeatureCache`
            unless ``cache`` is given.
        cache (optional): any object with the feature cache's item API (``len``, ``[i]``, ``groups``,
            ``code_dim``, ``split``); tests pass an in-memory one.
        resume (bool): continue from ``config.out/state.json``.

    Writes into ``config.out``: ``best.safetensors`` + ``best.json`` (the controller), ``encoder.*`` (with
    ``config.encoder``), ``metrics.json``, ``history.json`` and the resumable state. ``resume`` on a folder with no
    saved state yet (a run killed before its first evaluation) starts the run.
    """
    rank, world, started = _dist()
    # rank 0 is the only writer; a second run into the same folder is refused while this one holds it
    with folder_lock(config.out) if rank == 0 else contextlib.nullcontext():
        out = _train(config, cache, resume, rank, world)
        if rank == 0:
            remove_stale_temps(out)  # checkpoints a killed run left half-written
    if started:  # a group the caller started is the caller's to leave
        torch.distributed.destroy_process_group()
    return out


@dataclass
class _Run:
    """One training run as `_setup` builds it: what a step, an evaluation and the final save read."""

    config: TrainConfig
    cache: object
    out: Path
    rank: int
    world: int
    device: torch.device
    train_idx: np.ndarray
    val_idx: np.ndarray
    val_r: np.ndarray  # the fixed validation crop
    model: Controller
    net: torch.nn.Module  # the model, wrapped in DDP under torchrun
    opt: torch.optim.Optimizer
    info: dict  # config, best_f0_5, best_step, history (and step, when resumed): what state.json saves


@torch.enable_grad()  # trains whatever the caller's grad mode (inside torch.no_grad() too)
def _train(config: TrainConfig, cache, resume: bool, rank: int, world: int) -> Path:
    run = _setup(config, cache, resume, rank, world)
    config, start = run.config, int(run.info.get("step", 0))
    bar = _progress(config.steps, start, rank == 0)
    run.model.train()
    for step in range(start, config.steps):
        loss = _step(run, step)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item() / world:.4f}", best_f05=f"{run.info['best_f0_5']:.3f}", refresh=False)
        done = step + 1
        if done % config.eval_every == 0 or done == config.steps:
            _evaluate(run, done, loss)
    bar.close()
    if rank == 0:
        _finish(run.out, run.cache, run.val_idx, run.val_r, config, run.device, run.info)
    if world > 1:
        torch.distributed.barrier()
    return run.out


def _open_cache(config: TrainConfig):
    """The feature cache of ``config.cache`` (mixed with ``config.mix_cache`` when one is given)."""
    from tracelock.traces.cache import FeatureCache

    cache = FeatureCache(config.cache)
    if config.mix_cache is not None:
        from tracelock.train.mix import MixedCache

        cache = MixedCache(cache, FeatureCache(config.mix_cache), config.alpha)
    return cache


def _check_out(out: Path, resume: bool, rank: int) -> bool:
    """Whether the run resumes: a folder with a run needs ``resume``; ``resume`` on one without saved state starts."""
    if (out / "state.json").exists() and not resume:
        raise ValueError(f"{out} already holds a training run; pass --resume to continue it or a new --out")
    if resume and not (out / "state.json").exists():
        if rank == 0:
            print(f"tracelock train: {out} holds no saved state yet; starting the run", file=sys.stderr)
        return False
    return resume


def _device(config: TrainConfig, world: int) -> torch.device:
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def _split(cache, config: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    train_idx, val_idx = (np.asarray(i, np.int64) for i in cache.split(config.val_fraction, config.seed))
    if len(train_idx) == 0 or len(val_idx) == 0:
        raise ValueError(f"the cache's split gave {len(train_idx)} train / {len(val_idx)} validation items; "
                         "collect more traces or change --val-fraction")
    return train_idx, val_idx


def _build_model(config: TrainConfig, cache, device) -> tuple[TrainConfig, ControllerConfig, Controller]:
    """The controller to train (seeded, or warm-started from ``config.init``, whose architecture the returned
    config then records)."""
    torch.manual_seed(config.seed)
    ccfg = ControllerConfig(code_dim=int(cache.code_dim), groups={k: list(v) for k, v in cache.groups.items()},
                            fingerprint=_cache_fingerprint(cache), **{k: getattr(config, k) for k in _ARCHITECTURE})
    if config.init is None:
        model = Controller(ccfg).to(device)
    else:
        model = _warm_start(config.init, ccfg, device)
        # it runs the checkpoint's architecture: the run's records say so, not the config's defaults
        config = replace(config, **{k: getattr(model.config, k) for k in _ARCHITECTURE})
    if config.commit_rule is not None:
        model.config.commit_rule = commit_rule_named(config.commit_rule, ccfg.fingerprint)
    return config, ccfg, model


def _resumed_info(out: Path, config: TrainConfig, model, opt) -> dict:
    """The saved state loaded into ``model`` and ``opt``, after checking the run's fixed settings are unchanged."""
    info = _load_state(out, model, opt)
    changed = [k for k in _FIXED if info["config"][k] != getattr(config, k)]
    if changed:
        raise ValueError(f"--resume with changed settings {changed}; resume with the run's settings "
                         f"({ {k: info['config'][k] for k in changed} }) or start a new --out")
    info["config"] = asdict(config)
    return info


def _setup(config: TrainConfig, cache, resume: bool, rank: int, world: int) -> _Run:
    """Everything checked, opened, built and (with ``resume``) restored, before the first step."""
    if config.batch_size % world:
        raise ValueError(f"batch_size={config.batch_size} must be divisible by the {world} ranks")
    if cache is None:
        cache = _open_cache(config)
    out = Path(config.out)
    resume = _check_out(out, resume, rank)
    device = _device(config, world)
    train_idx, val_idx = _split(cache, config)
    val_r = validation_crop(val_idx, config.seed)
    config, ccfg, model = _build_model(config, cache, device)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    info = dict(config=asdict(config), best_f0_5=-1.0, best_step=None, history=[])
    if resume:
        info = _resumed_info(out, config, model, opt)
    elif rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if config.encoder is not None and rank == 0:
        _copy_encoder(config.encoder, ccfg.fingerprint, out)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    return _Run(config=config, cache=cache, out=out, rank=rank, world=world, device=device, train_idx=train_idx,
                val_idx=val_idx, val_r=val_r, model=model, net=net, opt=opt, info=info)


def _step(run: _Run, step: int) -> torch.Tensor:
    """One optimiser step on this rank's slice of step ``step``'s global batch; returns the loss (times world)."""
    config, world = run.config, run.world
    per_rank = config.batch_size // world
    idx, r = batch_items(run.train_idx, step, config.batch_size, config.seed)
    mine = slice(run.rank * per_rank, (run.rank + 1) * per_rank)
    batch = collate([run.cache[int(i)] for i in idx[mine]], r[mine], run.device)
    torch.manual_seed(int(np.random.SeedSequence([config.seed, step, run.rank]).generate_state(1)[0]))
    a, tau = run.net(batch["codes"], batch["state"], batch["key_mask"], batch["confidence"])
    wbce, n, tau_sq = loss_terms(a, tau, batch["label"], batch["state"], batch["key_mask"], batch["eot"],
                                 k=config.k, eot_weight=config.eot_weight)
    n = n.float()
    if world > 1:
        torch.distributed.all_reduce(n)
    # DDP averages gradients over ranks: scale by the world size so the sum over ranks is the global mean
    loss = (wbce / n.clamp_min(1) + config.lambda_tau * tau_sq / config.batch_size) * world
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.clip)
    run.opt.step()
    return loss


def _evaluate(run: _Run, done: int, loss: torch.Tensor) -> None:
    """After step ``done``: rank 0 scores the validation crop, keeps the best checkpoint and saves the state."""
    if run.rank == 0:
        config, info = run.config, run.info
        scores, labels = controller_scores(run.model, run.cache, run.val_idx, run.val_r, config.batch_size,
                                           run.device)
        f05 = metrics.f_beta(scores, labels)
        info["history"].append(dict(step=done, loss=loss.item() / run.world, val_f0_5=f05))
        if f05 > info["best_f0_5"]:
            info["best_f0_5"], info["best_step"] = f05, done
            run.model.save(run.out / "best.safetensors")
        _save_state(run.out, done, run.model, run.opt, info)
    if run.world > 1:
        torch.distributed.barrier()


def _warm_start(path, ccfg: ControllerConfig, device) -> Controller:
    """The controller at ``path``, in training mode, after checking it reads this cache's codes."""
    model = Controller.load(path, device=device)
    if model.config.code_dim != ccfg.code_dim or model.config.groups != ccfg.groups:
        raise ValueError(f"--init {path} reads {model.config.code_dim} codes but the cache holds {ccfg.code_dim}; "
                         "warm-start from a controller trained on codes of the same encoder")
    from tracelock.controller import check_fingerprint

    check_fingerprint(model.config.fingerprint, ccfg.fingerprint)
    return model.train().requires_grad_(True)


def _finish(out: Path, cache, val_idx, val_r, config: TrainConfig, device, info: dict) -> None:
    """Held-out metrics of the best checkpoint (fixed crop and uncropped), the history, and the encoder copy."""
    best = Controller.load(out / "best.safetensors", device=device)
    fixed = controller_scores(best, cache, val_idx, val_r, config.batch_size, device)
    full = controller_scores(best, cache, val_idx, np.ones(len(val_idx)), config.batch_size, device)
    result = dict(best_step=info["best_step"], validation_items=int(len(val_idx)),
                  fixed_crop=metrics.stability_metrics(*fixed), full=metrics.stability_metrics(*full))
    history = json.dumps(info["history"], indent=1)
    atomic_write_text(out / "history.json", history + "\n")
    atomic_write_json(out / "metrics.json", result)  # last: a run with its metrics.json is complete


def _cache_fingerprint(cache) -> dict:
    """Backbone and encoder digest recorded in a `FeatureCache` index (empty for caches without one)."""
    encoder = (getattr(cache, "index", None) or {}).get("encoder") or {}
    found = dict(backbone=(encoder.get("config") or {}).get("backbone"), encoder=encoder.get("digest"))
    return {k: v for k, v in found.items() if v is not None}


def _copy_encoder(folder, fingerprint: dict, out: Path) -> None:
    """Save the cache's encoder into the run folder, after checking it is the one that wrote the codes."""
    from tracelock.features import load_encoder

    encoder = load_encoder(folder)
    if "encoder" in fingerprint and encoder.digest() != fingerprint["encoder"]:
        raise ValueError(f"--encoder {folder} is not the encoder that wrote the cache (digest "
                         f"{encoder.digest()[:12]} vs {fingerprint['encoder'][:12]}); pass the encoder given to "
                         "`tracelock featurize`")
    encoder.save(out)
