"""``tracelock fit-encoder`` and ``tracelock featurize``: encoders from traces, then the feature cache."""

from __future__ import annotations

import json


def _load(args):
    import torch

    from tracelock.models import load_model

    return load_model(args.model, dtype=getattr(torch, args.model_dtype), device=args.device)


def _fit_encoder(args):
    from tracelock.features import fit_encoder
    from tracelock.traces.store import iter_traces

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
    from tracelock.cli_common import add_model_dtype, positive_int

    p.add_argument("--traces", required=True, help="trace store folder (`tracelock collect --out`)")
    p.add_argument("--model", required=True, help="checkpoint folder of the backbone the traces were decoded with")
    p.add_argument("--batch-size", type=positive_int, default=8, help="replayed steps per backbone forward")
    add_model_dtype(p, old=())
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")


def add_parsers(sub):
    from tracelock.cli_common import add_alias, positive_int

    p = sub.add_parser("fit-encoder", help="fit the hidden/delta feature encoders on replayed trace steps")
    _add_common(p)
    p.add_argument("--out", required=True, help="encoder folder (encoder.json + encoder.safetensors)")
    p.add_argument("--hidden-dim", type=positive_int, default=None,
                   help="E_h width (default 256, clamped to the hidden size)")
    p.add_argument("--delta-dim", type=positive_int, default=None,
                   help="E_d width (default 32, clamped to the hidden size)")
    p.add_argument("--kind", choices=["linear", "ae"], default="linear",
                   help="linear: standardise + PCA (foldable); ae: nonlinear autoencoder (comparison)")
    p.add_argument("--max-positions", type=positive_int, default=8192, help="sampled (trace, step, position) triples")
    p.add_argument("--ae-steps", type=positive_int, default=500,
                   help="optimiser steps of each autoencoder (--kind ae)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled positions (and the autoencoders)")
    p.set_defaults(func=_fit_encoder)

    p = sub.add_parser("featurize", help="replay traces and write their codes to a memory-mappable feature cache")
    _add_common(p)
    p.add_argument("--encoder", required=True, help="encoder folder (`tracelock fit-encoder --out`)")
    p.add_argument("--out", required=True, help="cache folder; traces already in it are skipped (resume)")
    p.add_argument("--cache-dtype", choices=["fp16", "int8"], default="fp16",
                   help="storage precision of the codes (int8: per-row scale)")
    add_alias(p, "--dtype", "--cache-dtype", dest="cache_dtype", choices=["fp16", "int8"])
    p.add_argument("--steps", choices=["recorded", "all"], default="recorded",
                   help="replay the trace's recorded steps or every forward")
    p.add_argument("--shard-mb", type=float, default=256, help="shard size in MiB (a fraction makes small shards)")
    p.set_defaults(func=_featurize)
