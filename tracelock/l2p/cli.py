"""``tracelock train-l2p``: a Learn2PD filter for one block size from the trace store (added to a filters folder)."""

from __future__ import annotations

import json


def _train_l2p(args):
    from tracelock.atomic import folder_lock, remove_stale_temps
    from tracelock.l2p.filter import filter_stem

    if args.input == "hidden" and not args.encoder:
        raise ValueError("--input hidden (L2P-Hidden) needs --encoder FOLDER (`tracelock fit-encoder --out`)")
    if args.input == "confidence" and args.encoder:
        raise ValueError("--encoder is only read with --input hidden (the L2P-Hidden diagnostic)")
    # filters of other block sizes may be trained into the same folder at the same time; one writer per filter
    stem = filter_stem(args.block, args.input)
    with folder_lock(args.out, f"lock-{stem}"):
        _fit_and_save(args)
        remove_stale_temps(args.out, prefix=f"{stem}.")


def _fit_and_save(args):
    import torch

    from tracelock.features import backbone_fingerprint, load_encoder
    from tracelock.l2p.data import block_examples
    from tracelock.l2p.train import fit_filter
    from tracelock.models import load_model
    from tracelock.progress import progress_bar
    from tracelock.traces.store import iter_traces, load_index

    model = load_model(args.model, dtype=getattr(torch, args.model_dtype), device=args.device)
    encoder = load_encoder(args.encoder, model, device=args.device) if args.encoder else None
    traces = progress_bar(iter_traces(args.traces), total=load_index(args.traces)["num_traces"], desc="replay",
                          unit="trace")
    inputs, labels, groups = block_examples(model, traces, args.block, encoder=encoder, batch_size=args.batch_size)
    traces.close()
    bar = progress_bar(total=args.epochs, desc="train-l2p", unit="epoch")

    def log(line: str) -> None:
        bar.update(max(1, args.epochs // 100))
        bar.set_postfix_str(line.partition(": ")[2])

    filt = fit_filter(inputs, labels, groups, family=model.spec.family, eos_id=model.spec.eos_id,
                      backbone=backbone_fingerprint(model), hidden=args.hidden, epochs=args.epochs, lr=args.lr,
                      val_fraction=args.val_fraction, seed=args.seed, log=log)
    bar.close()
    filt.config.train.update(traces=str(args.traces), positive_rate=float(labels.mean()))
    if encoder is not None:
        _save_encoder(encoder, args.out)
    path = filt.save(args.out)
    print(json.dumps(dict(out=str(path), block=args.block, input=args.input, **filt.config.train)))


def _save_encoder(encoder, folder) -> None:
    """L2P-Hidden filters read their encoder from their own folder: one encoder per folder."""
    from pathlib import Path

    from tracelock.features import load_encoder

    if (Path(folder) / "encoder.json").is_file() and load_encoder(folder).digest() != encoder.digest():
        raise ValueError(f"{folder} already holds another encoder; L2P-Hidden filters of one folder share one "
                         "encoder, so pass that encoder or another --out")
    encoder.save(folder)


def add_parsers(sub):
    from tracelock.cli_options import add_batch_size, add_device, add_model, add_model_dtype, option_help
    from tracelock.cli_values import gen_length_int, input_folder, positive_int, seed_int, width_int

    p = sub.add_parser("train-l2p", help="train a Learn2PD filter (one block size) from a trace store")
    p.add_argument("--traces", required=True, type=input_folder("a trace store folder (`tracelock collect --out`)"),
                   help="trace store (`tracelock collect --block N --out`)")
    add_model(p, extra="the backbone the traces were decoded with")
    p.add_argument("--block", type=gen_length_int, required=True, metavar="W",
                   help=option_help("--block", "the filter's block size: the traces' --block"))
    p.add_argument("--out", required=True, help="filters folder: writes block-N.json/.safetensors into it")
    p.add_argument("--input", choices=["confidence", "hidden"], default="confidence",
                   help="confidence: Learn2PD; hidden: the paper's L2P-Hidden diagnostic (needs --encoder)")
    p.add_argument("--encoder", help="encoder folder of the hidden-state codes (`tracelock fit-encoder --out`; "
                                     "default: none, required with --input hidden)")
    p.add_argument("--hidden", type=width_int,
                   help="hidden width (default: the block size, upstream's ~2K parameters)")
    p.add_argument("--epochs", type=positive_int, default=40_000, help="full-batch AdamW steps (upstream: 40000)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (upstream: 3e-3)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of traces held out for the metrics")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the initialisation and the split")
    add_batch_size(p, default=8, extra="replayed steps per backbone forward")
    add_model_dtype(p, old=())
    add_device(p)
    p.set_defaults(func=_train_l2p)
