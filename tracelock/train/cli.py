"""`tracelock train`: fit the controller on a feature cache (runs under torchrun for DDP)."""

import dataclasses
import os


def _train(args):
    from tracelock.train.fit import TrainConfig, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    cfg = TrainConfig(**{**PRESETS[args.preset], **given})  # an option given explicitly beats the preset
    out = train(cfg, resume=args.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"controller written to {out / 'best.safetensors'}; held-out metrics in {out / 'metrics.json'}")


# help texts only: TrainConfig holds the defaults (tests check the two agree)
DEFAULTS = (("steps", int, 10000), ("batch-size", int, 64), ("lr", float, 1e-4), ("weight-decay", float, 0.01),
            ("clip", float, 1.0), ("seed", int, 42), ("eval-every", int, 500), ("val-fraction", float, 0.1),
            ("width", int, 384), ("layers", int, 3), ("heads", int, 8), ("ffn", int, 768), ("dropout", float, 0.1),
            ("k", float, 4.0), ("lambda-tau", float, 1e-3), ("eot-weight", float, 1.0))


# named recipes: "paper" is TrainConfig's defaults (the paper's controller for 7-8B backbones); "testbed" is the
# recipe chosen on the bundled models' validation split (docs/frontier.md, "The recipe" and "The shipped commit
# rule"): a controller scaled to the 1.3 M-parameter backbone, with the confidence input, deployed with hold-end
PRESETS = {
    "paper": {},
    "testbed": dict(width=64, layers=2, heads=4, ffn=128, confidence_input=True, steps=2000, eval_every=250,
                    batch_size=32, commit_rule="hold-end"),
}


def add_parsers(sub):
    from tracelock.cli_values import bounded_int, input_folder

    p = sub.add_parser("train", help="train the TraceLock controller on a feature cache (DDP under torchrun)")
    p.add_argument("--cache", required=True, type=input_folder("a feature cache folder (`tracelock featurize --out`)"),
                   help="feature cache folder (`tracelock featurize`)")
    p.add_argument("--out", required=True, help="run folder: best.safetensors/.json, metrics.json, state")
    p.add_argument("--encoder", help="the encoder folder that wrote the cache: copied into --out so it deploys alone "
                                     "(default: none; then pass the encoder beside the controller when deploying)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last saved state (starts it when there is none yet)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="paper",
                   help="paper (default): the paper's controller and schedule; testbed: the recipe chosen for the "
                        "bundled models (width 64, 2 layers, confidence input, 2000 steps, batch 32, commit rule "
                        "hold-end); options given explicitly override it")
    from tracelock.cli_options import add_device
    from tracelock.cli_values import batch_int, positive_int, seed_int, width_int

    sized = {"batch-size": batch_int, "width": width_int, "ffn": width_int, "layers": bounded_int(256, "layers"),
             "heads": bounded_int(1024, "heads"), "steps": positive_int, "eval-every": positive_int, "seed": seed_int}
    for name, kind, default in DEFAULTS:
        p.add_argument("--" + name, type=sized.get(name, kind), default=None, help=f"default {default}")
    p.add_argument("--features", choices=["last", "deltas", "hidden", "all"], default=None,
                   help="code groups the controller reads: h3 / two deltas / three hidden / all five (default)")
    p.add_argument("--confidence-input", action="store_true", default=None,
                   help="add the proposals' max-prob as an input (the reference release does)")
    p.add_argument("--state-embedding", action="store_true", default=None, help="add a position-state embedding")
    p.add_argument("--init", help="warm start: a controller run folder, its architecture and weights (default: a "
                                  "fresh controller)")
    p.add_argument("--mix-cache", help="a second feature cache mixed in at share --alpha (self-training; default: "
                                       "none)")
    p.add_argument("--alpha", type=float, help="share of --mix-cache items in the training mix, in (0, 1) (default: "
                                               "none; required with --mix-cache)")
    p.add_argument("--commit-rule", choices=["paper", "hold-end"], default=None,
                   help="the commit rule the controller deploys with: paper (the paper's), hold-end (an end-of-text "
                        "proposal waits for the text left of it; when no slot clears theta the backbone's most "
                        "certain slot commits); default: paper, a warm start keeps its checkpoint's")
    add_device(p, default=None, extra="default: cuda when available, else cpu")
    p.set_defaults(func=_train)
