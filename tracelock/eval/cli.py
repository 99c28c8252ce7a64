"""`tracelock eval`: the paper-style comparison of policies on one task (see `tracelock.eval.runner`)."""

import sys


def run_eval_cli(args) -> int:
    from tracelock.distributed import torchrun_group
    from tracelock.eval.runner import parse_policies, parse_settings, run_eval, summary_table

    policies, settings = parse_policies(args.policies), parse_settings(args.settings)
    with torchrun_group(args.device) as (rank, world, device):
        rows = run_eval(args.model, args.task, policies, settings, args.out, n=args.limit, seed=args.seed,
                        batch_size=args.batch_size, schedule=args.schedule, controller=args.controller, rank=rank,
                        world_size=world, dtype=args.dtype, device=device, workers=args.workers,
                        progress=lambda what: print(f"  {what}", file=sys.stderr, flush=True))
    if rows is not None:
        print(f"{rows[0]['metric_name']} / average steps per item:")
        print(summary_table(rows, [s.label for s in settings], [p.label for p in policies]))
        print(f"per-item results, traces and summary.json/.csv in {args.out}")
    return 0


def add_run_arguments(p) -> None:
    """Decoding options shared by `eval` and `paper-tables`."""
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="sandbox processes for code scoring")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK)")


def add_parsers(sub) -> None:
    p = sub.add_parser("eval", help="every policy on the same prompts: metric and steps per setting (resumable, "
                                    "torchrun-ready)")
    p.add_argument("--model", required=True, help='checkpoint folder, or "testbed"')
    p.add_argument("--task", required=True, help="gsm8k:PATH, humaneval[:PATH], humaneval-with-tests[:PATH], "
                                                 "qa:PATH, testbed:math or testbed:code")
    p.add_argument("--policies", required=True,
                   help="comma-separated name[:key=value...], e.g. confidence,threshold:tau=0.9,tracelock,oracle "
                        "(oracle replays the first policy's final tokens)")
    p.add_argument("--settings", default="128/32", help="GEN/WIDTH comma-separated, e.g. 128/32,256/64")
    p.add_argument("--controller", help="a `tracelock train --out` folder, for the tracelock policy")
    p.add_argument("--schedule", default="auto", choices=["auto", "block", "window"],
                   help="auto: tracelock in a sliding window, the others in semi-AR blocks (the paper's protocol)")
    p.add_argument("--limit", type=int, help="the task's first N items (required for testbed tasks; not --num, which "
                                             "torchrun's own parser would take for --numa-binding)")
    p.add_argument("--out", required=True, help="run folder (re-running with the same arguments resumes)")
    add_run_arguments(p)
    p.set_defaults(func=run_eval_cli)
