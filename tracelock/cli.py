"""The tracelock command line: one subcommand per job, in one grammar (docs/cli.md).

--model a folder, a Hub id or a bundled model (testbed, testbed-dream); one setting --gen-length N with --block W or
--window W (--settings GEN/WIDTH,... where a command compares several); one policy --policy SPEC, several --policies
SPEC,SPEC (SPEC: name[:key=value...], e.g. threshold:tau=0.9); --tasks a,b; --limit N items; --model-dtype;
--device cpu|cuda[:i]; --threads N; --quiet. A singular option takes one value, a plural one a comma-separated
list. Progress goes to stderr, results (tables, JSON) to stdout.
"""

import contextlib
import importlib
import os
import sys

from tracelock import __version__
from tracelock.cli_options import (
    add_allow_uncontained,
    add_batch_size,
    add_device,
    add_limit,
    add_model,
    add_model_dtype,
    add_policy,
    add_quantize,
    add_runtime_options,
    add_schedule,
    add_settings,
    add_testbed_tasks,
    option_help,
)
from tracelock.cli_parser import Parser, safe_echo
from tracelock.cli_threads import apply_runtime_options
from tracelock.cli_values import (
    MAX_WORKERS,
    bounded_int,
    existing_file,
    nonneg_float,
    output_file,
    positive_int,
    seed_int,
    thread_count,
    workers_int,
)

# subcommands defined beside their code: each module has `add_parsers(sub)` (keep its heavy imports inside
# the command functions, so `tracelock --help` stays fast)
SUBCOMMAND_MODULES = (
    "tracelock.recording.collect",
    "tracelock.features_cli",
    "tracelock.train.cli",
    "tracelock.l2p.cli",
    "tracelock.train.self_train",
    "tracelock.recipe",
    "tracelock.rl.train",
    "tracelock.testbed.ar_calibration",
    "tracelock.testbed.probe",
    "tracelock.testbed.ship",
    "tracelock.eval.report",
    "tracelock.eval.cli",
    "tracelock.eval.paper_tables",
    "tracelock.eval.frontier",
    "tracelock.eval.lm_eval_cli",
    "tracelock.serve.cli",
)
# the order `tracelock --help` lists the commands in: the README's table, "The command line at a glance"
COMMAND_ORDER = ("demo", "generate", "collect", "fit-encoder", "featurize", "train", "train-l2p", "self-train", "fit",
                 "rl", "eval", "report", "paper-tables", "frontier", "serve", "lm-eval", "testbed-train",
                 "testbed-eval", "testbed-ship", "testbed-ship-controller", "testbed-probe", "testbed-ar-calibration",
                 "tiny-checkpoint", "env")


def _env(args):
    from tracelock.env import main as env_main

    return env_main([])


def _tiny_checkpoint(args):
    from tracelock.models import write_tiny_checkpoint

    path = write_tiny_checkpoint(args.out, family=args.family, profile=args.profile, seed=args.seed,
                                 shards=args.shards)
    print(f"wrote a tiny random {args.family} checkpoint ({args.profile}) to {path}")


def _imported_when_run(module: str, function: str):
    """The command function ``module.function``, imported only when its command runs (so `tracelock --help` imports
    no torch)."""

    def run(args):
        return getattr(importlib.import_module(module), function)(args)

    return run


def _add_demo(sub):
    p = sub.add_parser("demo", help="decode held-out testbed items with every heuristic baseline; print the table")
    add_model(p, default="testbed")
    add_testbed_tasks(p)
    add_limit(p, default=16, help="held-out items per task", old=("--n",))
    add_schedule(p, gen_length=64, block_default="16 when no --window is given", window_default="blocks, no window",
                 block_fallback=16)
    add_batch_size(p, default=16)
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the held-out sample")
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--policy", dest="policies", metavar="SPEC",
                      help=option_help("--policy", "the same as --policies SPEC: one row of its own after the demo's "
                                                   "(default: the demo's rows)"))
    rows.add_argument("--policies", help=option_help("--policies", "the rows: a spec of a default row keeps that row, "
                                                                   "any other (credit:tau=0.9, klass, "
                                                                   "pc:background=testbed) is a row of its own after "
                                                                   "them") +
                   " (default: the demo's rows: the family's reference rule at 1 and 4 tokens per step, threshold "
                   "0.9 and 0.5, random, and on a Dream model Dream's entropy rule and Fast-dLLM's Dream variant; the "
                   "reference at 1/step always runs, as the oracle replays it)")
    p.add_argument("--tracelock", action="store_true",
                   help="add a TraceLock row with the controller shipped with the bundled --model (or --controller)")
    p.add_argument("--train-controller", action="store_true",
                   help="add a TraceLock row with a controller trained here by the whole method (collect, "
                        "fit-encoder, featurize, train) in --work")
    p.add_argument("--work", default="tracelock-demo",
                   help="folder of --train-controller's traces, encoder, cache and controller (a rerun reuses them)")
    p.add_argument("--controller", help="a `tracelock train --out` folder for the TraceLock row "
                                        "(default: the bundled model's shipped controller)")
    add_allow_uncontained(p)
    p.set_defaults(func=_imported_when_run("tracelock.testbed.demo", "run_demo"))


def _add_testbed_eval(sub):
    p = sub.add_parser("testbed-eval", help="quality-vs-steps tables on held-out testbed items, JSON out")
    add_model(p, default="testbed")
    add_testbed_tasks(p)
    add_limit(p, default=300, help="held-out items per task, drawn at random from the test split's pool of 2000",
              old=("--n",))
    add_settings(p, default="64/16,64/32,128/16,128/32", schedules=("block", "window"),
                 schedule_help="every WIDTH of --settings a semi-AR block or a soft-crop window")
    add_batch_size(p, default=100)
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random draw of held-out items")
    p.add_argument("--policies", help=option_help("--policies", "the rows' labels ('threshold 0.9') are accepted "
                                                                "too, deprecated") +
                   " (default: every row: the family's reference rule with 1, 2 and 4 tokens per step, threshold "
                   "0.9/0.7/0.5, random, and Dream's rules on a Dream model; the reference at 1/step always runs, "
                   "as the oracle replays it)")
    add_device(p)
    p.add_argument("--workers", type=workers_int, default=2, help="sandbox processes that run the code answers' "
                                                                  "tests")
    add_allow_uncontained(p)
    p.add_argument("--out", required=True, type=output_file,
                   help="JSON results file (settings already in it are skipped)")
    p.set_defaults(func=_imported_when_run("tracelock.testbed.demo", "run_testbed_eval"))


def _testbed_train(args):
    from tracelock.testbed.train import train_backbone

    out = train_backbone(testbed_train_config(args), resume=args.resume)
    print(f"trained testbed model written to {out}")


def testbed_train_config(args):
    """`testbed-train`'s `BackboneTrainConfig`: the options given, else the family's shipped recipe, else the field
    defaults."""
    import dataclasses

    from tracelock.testbed.train_config import recipe_config

    fields = {f.name for f in dataclasses.fields(recipe_config("", "llada"))}
    return recipe_config(args.out, args.family, **{k: v for k, v in vars(args).items()
                                                   if k in fields and k not in ("out", "family") and v is not None})


def _add_testbed_train(sub):
    import dataclasses

    from tracelock.testbed.train_config import SHIPPED_RECIPES, BackboneTrainConfig

    p = sub.add_parser("testbed-train",
                       help="train the bundled testbed model (LLaDA SFT objective, resumable); the defaults are the "
                            "shipped model's recipe (9,000 steps of batch 128: about 6 min on one H200, hours on a "
                            "CPU)")
    p.add_argument("--out", required=True, help="run folder: checkpoint files, train_state.*, final weights")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last saved step")
    p.add_argument("--family", choices=["llada", "dream"], default="llada",
                   help="llada: LLaDA's config and unshifted logits; dream: a Dream-format checkpoint (Qwen2 keys, "
                        "Dream's ids), the row before a masked position predicts it. The recipe defaults below are "
                        "the family's shipped model's")
    machine = {f.name: f.default for f in dataclasses.fields(BackboneTrainConfig) if f.name != "out"}

    def default(name):
        """The help's default: the field's, or each family's shipped recipe value where they differ."""
        values = {fam: recipe.get(name, machine[name]) for fam, recipe in SHIPPED_RECIPES.items()}
        if len(set(map(str, values.values()))) == 1:
            return f"default: {values['llada']}"
        return "default: " + ", ".join(f"{v} ({fam})" for fam, v in values.items())

    types = dict(seed=seed_int, workers=bounded_int(MAX_WORKERS, "processes", minimum=0))
    for name in ("seed", "steps", "batch_size", "d_model", "n_layers", "n_heads", "mlp", "save_every",
                 "vocab_size", "tokenizer_corpus", "warmup", "probe_every", "probe_items", "workers", "ar_steps"):
        p.add_argument("--" + name.replace("_", "-"), type=types.get(name, int), default=None,
                       help=f"{_TRAIN_HELP[name]} ({default(name)})")
    for name in ("lr", "masked_lr", "long_fraction", "block_fraction"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                       help=f"{_TRAIN_HELP[name]} ({default(name)})")
    p.add_argument("--init", default=None,
                   help="start from this finished run's (or checkpoint folder's) tokenizer and weights, of the same "
                        "family and sizes: a second stage of training (default: none, a fresh tokenizer and "
                        "random weights)")
    p.add_argument("--threads", type=thread_count, default=machine["threads"] or None, metavar="N",
                   help=option_help("--threads", "a run reproduces its weights on the device and thread count it "
                                                 "ran on"))
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the loss, forward and backward (1.4-1.9x faster steps on a 2-core CPU "
                        "after about a minute of compiling)")
    add_device(p, default=machine["device"], extra="a run reproduces its weights on the device and --threads it "
                                                    "ran on")
    p.set_defaults(func=_testbed_train)


_TRAIN_HELP = {
    "seed": "seed of the data, masks and initialisation",
    "steps": "optimiser steps in all (the AR warm-up included)",
    "batch_size": "training answers per step",
    "d_model": "hidden size",
    "n_layers": "transformer layers",
    "n_heads": "attention heads",
    "mlp": "MLP width",
    "save_every": "steps between resumable checkpoints",
    "vocab_size": "BPE vocabulary of the trained tokenizer (the numbers 0-99 are added as single tokens)",
    "tokenizer_corpus": "task texts the tokenizer is trained on",
    "warmup": "learning-rate warm-up steps",
    "probe_every": "decode validation items every N steps and log their accuracy (0: never)",
    "probe_items": "validation items per task of each probe",
    "workers": "processes that build the batches ahead of the step (0: in the training process)",
    "ar_steps": "autoregressive steps first (causal mask, next-token loss), then the masked objective with a fresh "
                "optimiser for the rest of --steps",
    "lr": "peak AdamW learning rate (cosine decay to a tenth)",
    "masked_lr": "the masked phase's peak learning rate after --ar-steps (None: --lr)",
    "long_fraction": "share of batches with a 128-token generation region instead of 64",
    "block_fraction": "share of rows masked the way semi-AR decoding sees them (0: LLaDA's SFT masking alone)",
}


def _add_generate(sub):
    p = sub.add_parser("generate", help="decode prompts with a commitment policy, JSONL out")
    add_model(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (the chat template is applied)")
    src.add_argument("--prompts", type=existing_file("--prompts"), help='JSONL file, one {"prompt": ...} per line')
    add_policy(p, required=True)
    add_schedule(p, gen_required=True, block_default="neither block nor window, one region",
                 window_default="no window")
    p.add_argument("--temperature", type=nonneg_float, default=0.0, help="0: greedy; > 0 samples (Gumbel-max)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus sampling in (0, 1], as Dream's sampler (default: every token)")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="keep the K most likely tokens, as Dream's sampler (default: every token)")
    p.add_argument("--cfg-scale", type=nonneg_float, default=0.0, help="LLaDA's classifier-free guidance (0: off)")
    p.add_argument("--stop-at-eot", action="store_true", help="a committed end token finishes the row")
    p.add_argument("--idle-steps", action="store_true", help="reproduce the reference release's block artifact")
    p.add_argument("--cache", choices=["prefix", "dual"], help="approximate KV cache (default: none)")
    p.add_argument("--refresh-every", type=positive_int,
                   help="with --cache: also refresh a row after this many steps (default: only at block starts or "
                        "window moves)")
    p.add_argument("--refresh-shift", type=positive_int,
                   help="with --cache and --window: refresh when the window moved this far (default: window // 2)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of sampling and random policies")
    add_batch_size(p, default=1, extra="prompts are left-padded; the same results")
    p.add_argument("--no-chat-template", action="store_true", help="encode prompts as they are")
    add_model_dtype(p)
    add_quantize(p)
    add_device(p)
    p.add_argument("--impl", choices=["torch", "cpp", "triton", "cuda"],
                   help="op implementation (default: $TRACELOCK_IMPL, else the fastest available)")
    p.add_argument("--out", type=output_file, help="JSONL output file (default: stdout)")
    p.set_defaults(func=_imported_when_run("tracelock.generate_cli", "run_generate"))


def build_parser():
    parser = Parser(prog="tracelock", description=__doc__,
                    epilog="tracelock COMMAND --help shows a command's options with their defaults. Every command "
                           f"takes --threads N ({option_help('--threads')}) and --quiet.")
    parser.add_argument("--version", action="version", version=f"tracelock {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    p = sub.add_parser("env", help="print torch, triton, interpreter mode, tracelock._C and GPU status")
    p.set_defaults(func=_env)
    p = sub.add_parser("tiny-checkpoint", help="write a tiny random LLaDA/Dream checkpoint folder")
    p.add_argument("--family", choices=["llada", "dream"], default="llada", help="model family")
    p.add_argument("--profile", choices=["micro", "kernel"], default="micro", help="sizes: micro (tests) or kernel")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random weights")
    p.add_argument("--shards", type=bounded_int(64, "files"), default=1,
                   help="safetensors files to split the weights into")
    p.add_argument("--out", required=True, help="folder to write")
    p.set_defaults(func=_tiny_checkpoint)
    _add_generate(sub)
    _add_testbed_train(sub)
    _add_demo(sub)
    _add_testbed_eval(sub)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parsers(sub)
    for p in sub.choices.values():
        if p.prefix_chars == "-":  # `lm-eval` passes every argument through to lm-eval's own command line
            add_runtime_options(p)
    order = {name: i for i, name in enumerate(COMMAND_ORDER)}
    sub._choices_actions.sort(key=lambda a: order.get(a.dest, len(order)))
    sub.choices = dict(sorted(sub.choices.items(), key=lambda kv: order.get(kv[0], len(order))))
    return parser


# bad input (and a missing file) ends in one line naming the fix, not a traceback; TRACELOCK_DEBUG=1 shows it
_USER_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                PermissionError)


def _gen_lengths(args) -> list:
    """(generation length, the option that asks for it) of every one the command's options ask for."""
    from tracelock.cli_options import check_settings

    lengths = [(getattr(args, "gen_length", None), "--gen-length")]
    if getattr(args, "settings", None):
        lengths += [(gen, "--settings") for gen, _ in check_settings(args.settings)]
    if isinstance(getattr(args, "gen_lengths", None), str) and getattr(args, "command", "") == "paper-tables":
        lengths += [(int(v), "--gen-lengths") for v in args.gen_lengths.split(",") if v.strip().isdigit()]
    return [(n, option) for n, option in lengths if isinstance(n, int)]


def check_model_options(args) -> None:
    """What the model's own files bound, checked before its weights load (minutes for an 8B checkpoint): float16
    needs CUDA, a --quantize format runs on the device (and torchao is installed), and every generation length leaves
    room for a prompt in the checkpoint's positions (its config)."""
    dtype, device = getattr(args, "model_dtype", None), str(getattr(args, "device", None) or "cpu")
    if dtype == "float16" and not device.startswith("cuda"):
        raise ValueError("--model-dtype float16 runs on CUDA only (--device cuda); on the CPU pass --model-dtype "
                         "float32 or bfloat16")
    if getattr(args, "quantize", None):  # the format on this device and dtype, and torchao (the quant extra)
        import torch

        from tracelock.models.quantize import check_quantize

        check_quantize(args.quantize, device, getattr(torch, dtype or "float32"), option="--quantize",
                       dtype_option="--model-dtype")
    lengths, model = _gen_lengths(args), getattr(args, "model", None)
    if not lengths or not isinstance(model, str) or not model:
        return
    from tracelock.models.loading import resolve_path
    from tracelock.models.spec import ModelSpec

    limit = ModelSpec.from_pretrained(resolve_path(model)).max_positions
    longest, option = max(lengths)
    if longest >= limit:
        raise ValueError(f"{option} {longest if option != '--settings' else args.settings}: a generation length of "
                         f"{longest} leaves no room for a prompt in the {limit} positions of --model {model}; pass at "
                         f"most {limit - 1} less the prompt's tokens")


@contextlib.contextmanager
def _warnings_as_notes(command: str):
    """A warning during a command is one line on stderr, ``tracelock CMD: note: ...``, once, without the source
    path and line Python's format adds; --quiet hides them (errors still print)."""
    import warnings

    from tracelock.progress import quiet

    said, previous = set(), warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = safe_echo(str(message))
        if quiet() or text in said:
            return
        said.add(text)
        print(f"tracelock {command}: note: {text}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def main(argv=None):
    args = build_parser().parse_args(argv)
    apply_runtime_options(args)
    with _warnings_as_notes(args.command):
        return _run(args)


def _run(args) -> int:
    from tracelock.atomic import OutputError
    from tracelock.extras import MissingExtraError

    try:
        if getattr(args, "device", None) is not None:
            from tracelock.checks import check_device

            check_device(args.device)
        check_model_options(args)
        return args.func(args) or 0
    except (*_USER_ERRORS, OutputError, MissingExtraError) as err:
        # bad input, a corrupt file, a full disk or a busy output folder: one clear line, no traceback; a value the
        # user typed is echoed with its control characters escaped
        if os.environ.get("TRACELOCK_DEBUG"):
            raise
        print(f"tracelock {args.command}: error: {safe_echo(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tracelock {args.command}: interrupted (the resumable commands continue where they stopped when run "
              "again with the same arguments)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
