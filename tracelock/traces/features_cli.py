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
    from tracelock.traces.cache import cache_bytes_per_trace, featurize
    from tracelock.traces.store import iter_traces

    model = _load(args)
    encoder = load_encoder(args.encoder, model)
    summary = featurize(model, encoder, iter_traces(args.traces), args.out, dtype=args.dtype, steps=args.steps,
                        batch_size=args.batch_size, shard_bytes=max(1, round(args.shard_mb * (1 << 20))))
    summary["bytes_per_trace"] = cache_bytes_per_trace(args.out) if summary["added"] + summary["skipped"] else 0
    print(json.dumps(dict(out=args.out, **summary)))


def _add_common(p):
    p.add_argument("--traces", required=True, help="trace store folder (`tracelock collect --out`)")
    p.add_argument("--model", required=True, help="checkpoint folder of the backbone the traces were decoded with")
    p.add_argument("--batch-size", type=int, default=8, help="replayed steps per backbone forward")
    p.add_argument("--model-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


def add_parsers(sub):
    p = sub.add_parser("fit-encoder", help="fit the hidden/delta feature encoders on replayed trace steps")
    _add_common(p)
    p.add_argument("--out", required=True, help="encoder folder (encoder.json + encoder.safetensors)")
    p.add_argument("--hidden-dim", type=int, default=None, help="E_h width (default 256, clamped to the hidden size)")
    p.add_argument("--delta-dim", type=int, default=None, help="E_d width (default 32, clamped to the hidden size)")
    p.add_argument("--kind", choices=["linear", "ae"], default="linear",
                   help="linear: standardise + PCA (foldable); ae: nonlinear autoencoder (comparison)")
    p.add_argument("--max-positions", type=int, default=8192, help="sampled (trace, step, position) triples")
    p.add_argument("--ae-steps", type=int, default=500, help="optimiser steps of each autoencoder (--kind ae)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_fit_encoder)

    p = sub.add_parser("featurize", help="replay traces and write their codes to a memory-mappable feature cache")
    _add_common(p)
    p.add_argument("--encoder", required=True, help="encoder folder (`tracelock fit-encoder --out`)")
    p.add_argument("--out", required=True, help="cache folder; traces already in it are skipped (resume)")
    p.add_argument("--dtype", choices=["fp16", "int8"], default="fp16", help="code precision (int8: per-row scale)")
    p.add_argument("--steps", choices=["recorded", "all"], default="recorded",
                   help="replay the trace's recorded steps or every forward")
    p.add_argument("--shard-mb", type=float, default=256,
                   help="shard size in MiB (default 256; a fraction makes small shards)")
    p.set_defaults(func=_featurize)
