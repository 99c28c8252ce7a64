"""The ``tracelock`` command line: one subcommand per job."""

import argparse
import importlib
import sys

# subcommands defined beside their code: each module has `add_parsers(sub)` (keep its heavy imports inside
# the command functions, so `tracelock --help` stays fast)
SUBCOMMAND_MODULES = (
    "tracelock.traces.collect",
    "tracelock.traces.features_cli",
    "tracelock.train.cli",
    "tracelock.l2p.cli",
    "tracelock.train.self_train",
    "tracelock.rl.train",
    "tracelock.testbed.ar_calibration",
    "tracelock.testbed.probe",
    "tracelock.testbed.ship",
    "tracelock.eval.report",
    "tracelock.eval.cli",
    "tracelock.eval.paper_tables",
)


def _env(args):
    from tracelock.env import main as env_main

    return env_main([])


def _tiny_checkpoint(args):
    from tracelock.models import write_tiny_checkpoint

    path = write_tiny_checkpoint(args.out, family=args.family, profile=args.profile, seed=args.seed,
                                 shards=args.shards)
    print(f"wrote a tiny random {args.family} checkpoint ({args.profile}) to {path}")


def _generate(args):
    from tracelock.generate_cli import run_generate

    return run_generate(args)


def _demo(args):
    from tracelock.testbed.demo import run_demo

    return run_demo(args)


def _add_demo(sub):
    p = sub.add_parser("demo", help="decode held-out testbed items with every heuristic baseline; print the table")
    p.add_argument("--model", default="testbed", help="checkpoint folder (default: the bundled testbed model)")
    p.add_argument("--tasks", default="math,code", help="comma-separated testbed tasks")
    p.add_argument("--n", type=int, default=16, help="held-out items per task")
    p.add_argument("--gen-length", type=int, default=64)
    sched = p.add_mutually_exclusive_group()
    sched.add_argument("--block", type=int, help="semi-AR block length (default 16 when no window is given)")
    sched.add_argument("--window", type=int, help="soft-crop window width")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out sample")
    p.add_argument("--tracelock", action="store_true",
                   help="add TraceLock: train a controller with the whole method (collect, fit-encoder, featurize, "
                        "train) in --work, or use --controller")
    p.add_argument("--work", default="tracelock-demo",
                   help="folder of the method's traces, encoder, cache and controller (a rerun reuses them)")
    p.add_argument("--controller", help="a `tracelock train --out` folder to use instead of training one")
    p.set_defaults(func=_demo)


def _testbed_eval(args):
    from tracelock.testbed.demo import run_eval

    return run_eval(args)


def _add_testbed_eval(sub):
    p = sub.add_parser("testbed-eval", help="quality-vs-steps tables on held-out testbed items, JSON out")
    p.add_argument("--model", default="testbed")
    p.add_argument("--tasks", default="math,code")
    p.add_argument("--n", type=int, default=300, help="held-out items per task")
    p.add_argument("--settings", default="64/16,64/32,128/16,128/32", help="gen_length/width pairs")
    p.add_argument("--schedule", choices=["block", "window"], default="block")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", help='comma-separated row labels, e.g. "threshold 0.9,random 1/step" (default: all); '
                                      '"confidence 1/step" always runs, as the oracle replays it')
    p.add_argument("--device", default="cpu", help="where the model decodes (cpu, cuda)")
    p.add_argument("--workers", type=int, default=2, help="sandbox processes that run the code answers' tests")
    p.add_argument("--out", required=True, help="JSON results file (settings already in it are skipped)")
    p.set_defaults(func=_testbed_eval)


def _testbed_train(args):
    import dataclasses

    from tracelock.testbed.train import TrainConfig, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    out = train(cfg, resume=args.resume)
    print(f"trained testbed model written to {out}")


def _add_testbed_train(sub):
    from tracelock.testbed.train import TrainConfig

    p = sub.add_parser("testbed-train", help="train the bundled testbed model (LLaDA SFT objective, resumable)")
    p.add_argument("--out", required=True, help="run folder: checkpoint files, train_state.*, final weights")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last saved step")
    defaults = TrainConfig(out="")
    for name in ("seed", "steps", "batch_size", "d_model", "n_layers", "n_heads", "mlp", "save_every", "threads",
                 "vocab_size", "tokenizer_corpus", "warmup", "probe_every", "probe_items", "workers"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default {getattr(defaults, name)}")
    for name in ("lr", "long_fraction", "block_fraction"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                       help=f"default {getattr(defaults, name)}")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the loss, forward and backward (1.4-1.9x faster steps on a 2-core CPU "
                        "after about a minute of compiling)")
    p.add_argument("--device", default=None,
                   help="cpu (default) or cuda; a run reproduces its weights on the device and --threads it ran on")
    p.add_argument("--ar-steps", type=int, default=None,
                   help="start with this many autoregressive steps (causal mask, next-token loss), then LLaDA's "
                        "objective with a fresh optimiser for the rest of --steps (default 0)")
    p.set_defaults(func=_testbed_train)


def _add_generate(sub):
    p = sub.add_parser("generate", help="decode prompts with a commitment policy, JSONL out")
    p.add_argument("--model", required=True, help="checkpoint folder (LLaDA, Dream or a tiny one)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (the chat template is applied)")
    src.add_argument("--prompts", help='JSONL file, one {"prompt": ...} per line')
    p.add_argument("--policy", required=True, help="policy name, e.g. threshold, confidence, entropy")
    p.add_argument("--policy-arg", action="append", default=[], metavar="K=V",
                   help="policy keyword argument, repeatable (e.g. --policy-arg tau=0.9)")
    p.add_argument("--gen-length", type=int, required=True)
    sched = p.add_mutually_exclusive_group()
    sched.add_argument("--block", type=int, help="semi-AR block length")
    sched.add_argument("--window", type=int, help="soft-crop window width")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--cfg-scale", type=float, default=0.0)
    p.add_argument("--stop-at-eot", action="store_true", help="a committed end token finishes the row")
    p.add_argument("--idle-steps", action="store_true", help="reproduce the reference release's block artifact")
    p.add_argument("--cache", choices=["prefix", "dual"], help="approximate KV cache (default: none)")
    p.add_argument("--refresh-every", type=int, help="with --cache: also refresh a row after this many steps")
    p.add_argument("--refresh-shift", type=int,
                   help="with --cache and --window: refresh when the window moved this far (default: window // 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1, help="prompts per batch (left-padded; same results)")
    p.add_argument("--no-chat-template", action="store_true", help="encode prompts as they are")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--impl", default=None, help="op implementation: torch, cpp or cuda (default: fastest)")
    p.add_argument("--out", help="JSONL output file (default: stdout)")
    p.set_defaults(func=_generate)


def build_parser():
    parser = argparse.ArgumentParser(prog="tracelock", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("env", help="print torch, triton, interpreter mode, tracelock._C and GPU status")
    p.set_defaults(func=_env)
    p = sub.add_parser("tiny-checkpoint", help="write a tiny random LLaDA/Dream checkpoint folder")
    p.add_argument("--family", choices=["llada", "dream"], default="llada")
    p.add_argument("--profile", choices=["micro", "kernel"], default="micro")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--out", required=True, help="folder to write")
    p.set_defaults(func=_tiny_checkpoint)
    _add_generate(sub)
    _add_testbed_train(sub)
    _add_demo(sub)
    _add_testbed_eval(sub)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parsers(sub)
    return parser


def main(argv=None):
    from tracelock.atomic import OutputError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, TypeError, FileNotFoundError, OutputError) as err:
        # bad input, a corrupt file, a full disk or a busy output folder: one clear line, no traceback
        print(f"tracelock {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
