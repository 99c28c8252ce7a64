"""``tracelock fit-encoder`` and ``tracelock featurize``: encoders from traces, then the feature cache."""

from __future__ import annotations

import json


def _load(args):
    import torch

    from tracelock.models import load_model

    return load_model(args.model, dtype=getattr(torch, args.model_dtype), device=args.device)


def memory_bytes() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_max_positions(model: str, max_positions: int, memory: int | None = None) -> None:
    """``--max-positions`` N holds N x 3 taps x the hidden size in fp32 at once: refused before the model loads when
    that is more than half this machine's memory (the kernel's out-of-memory handler would end the run)."""
    from tracelock.models.loading import resolve_path
    from tracelock.models.spec import ModelSpec

    hidden = ModelSpec.from_pretrained(resolve_path(model)).hidden_size
    memory = memory_bytes() if memory is None else memory
    need = max_positions * 3 * hidden * 4
    if memory and need > memory // 2:
        most = max(1, memory // 2 // (3 * hidden * 4))
        raise ValueError(f"--max-positions {max_positions} holds {need / 2**30:.1f} GiB of taps ({max_positions} x 3 x "
                         f"hidden size {hidden} in fp32), more than half of this machine's {memory / 2**30:.0f} GiB; "
                         f"pass at most {most}")


def _fit_encoder(args):
    from tracelock.features import fit_encoder
    from tracelock.traces.store import iter_traces

    check_max_positions(args.model, args.max_positions)
    model = _load(args)
    encoder = fit_encoder(model, iter_traces(args.traces), args.hidden_dim, args.delta_dim, kind=args.kind,
                          max_positions=args.max_positions, seed=args.seed, batch_size=args.batch_size,
                          ae_steps=args.ae_steps)
    encoder.save(args.out)
    print(json.dumps(dict(out=args.out, kind=encoder.kind, code_dim=encoder.code_dim, groups=encoder.groups,
                          **encoder.fit)))


def _featurize(args):
    from tracelock.features import load_encoder
    from tracelock.progress import progress_bar
    from tracelock.traces.cache import cache_bytes_per_trace, featurize
    from tracelock.traces.store import iter_traces, load_index

    model = _load(args)
    encoder = load_encoder(args.encoder, model)
    traces = progress_bar(iter_traces(args.traces), total=load_index(args.traces)["num_traces"], desc="featurize",
                          unit="trace")
    summary = featurize(model, encoder, traces, args.out, dtype=args.cache_dtype, steps=args.steps,
                        batch_size=args.batch_size, shard_bytes=max(1, round(args.shard_mb * (1 << 20))))
    summary["bytes_per_trace"] = cache_bytes_per_trace(args.out) if summary["added"] + summary["skipped"] else 0
    print(json.dumps(dict(out=args.out, **summary)))


def _add_common(p):
    from tracelock.cli_options import add_batch_size, add_device, add_model, add_model_dtype
    from tracelock.cli_values import input_folder

    p.add_argument("--traces", required=True, type=input_folder("a trace store folder (`tracelock collect --out`)"),
                   help="trace store folder (`tracelock collect --out`)")
    add_model(p, extra="the backbone the traces were decoded with")
    add_batch_size(p, default=8, extra="replayed steps per backbone forward")
    add_model_dtype(p, old=())
    add_device(p)


def add_parsers(sub):
    from tracelock.cli_parser import add_alias
    from tracelock.cli_values import MAX_COUNT, bounded_int, input_folder, positive_int, seed_int, width_int

    p = sub.add_parser("fit-encoder", help="fit the hidden/delta feature encoders on replayed trace steps")
    _add_common(p)
    p.add_argument("--out", required=True, help="encoder folder (encoder.json + encoder.safetensors)")
    p.add_argument("--hidden-dim", type=width_int, default=None,
                   help="E_h width (default 256, clamped to the hidden size)")
    p.add_argument("--delta-dim", type=width_int, default=None,
                   help="E_d width (default 32, clamped to the hidden size)")
    p.add_argument("--kind", choices=["linear", "ae"], default="linear",
                   help="linear: standardise + PCA (foldable); ae: nonlinear autoencoder (comparison)")
    p.add_argument("--max-positions", type=bounded_int(MAX_COUNT, "sampled positions"), default=8192,
                   help="sampled (trace, step, position) triples, held at once (at most half this machine's memory)")
    p.add_argument("--ae-steps", type=positive_int, default=500,
                   help="optimiser steps of each autoencoder (--kind ae)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the sampled positions (and the autoencoders)")
    p.set_defaults(func=_fit_encoder)

    p = sub.add_parser("featurize", help="replay traces and write their codes to a memory-mappable feature cache")
    _add_common(p)
    p.add_argument("--encoder", required=True, type=input_folder("an encoder folder (`tracelock fit-encoder --out`)"),
                   help="encoder folder (`tracelock fit-encoder --out`)")
    p.add_argument("--out", required=True, help="cache folder; traces already in it are skipped (resume)")
    p.add_argument("--cache-dtype", choices=["fp16", "int8"], default="fp16",
                   help="storage precision of the codes (int8: per-row scale)")
    add_alias(p, "--dtype", "--cache-dtype", dest="cache_dtype", choices=["fp16", "int8"])
    p.add_argument("--steps", choices=["recorded", "all"], default="recorded",
                   help="replay the trace's recorded steps or every forward")
    p.add_argument("--shard-mb", type=shard_mb, default=256,
                   help="shard size in MiB, above 0 and at most 65536 (a fraction makes small shards)")
    p.set_defaults(func=_featurize)


def shard_mb(text: str) -> float:
    """argparse type of ``--shard-mb``: a size in (0, 65536] MiB (a shard is held in memory before it is written)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and 0 < value <= 65536):
        raise argparse.ArgumentTypeError(f"{value} must lie in (0, 65536] MiB")
    return value
