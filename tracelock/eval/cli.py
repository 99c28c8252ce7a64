"""`tracelock eval`: the paper-style comparison of policies on one task (see `tracelock.eval.runner`)."""

import os
import sys


def run_eval_cli(args) -> int:
    from tracelock.distributed import torchrun_group
    from tracelock.eval.judging import check_judge_args, make_judge
    from tracelock.eval.runner import parse_policies, parse_settings, run_eval, summary_table

    policies, settings = parse_policies(args.policies), parse_settings(args.settings)
    wants_judge = args.judge_url is not None or args.judge_local is not None
    if wants_judge:
        check_judge_args(args.judge_url, args.judge_model, args.judge_local)  # fail before decoding, build nothing
    with torchrun_group(args.device) as (rank, world, device):
        judge = (make_judge(args.judge_url, args.judge_model, args.judge_local,
                            os.environ.get("TRACELOCK_JUDGE_API_KEY")) if wants_judge and rank == 0 else None)
        rows = run_eval(args.model, args.task, policies, settings, args.out, n=args.limit, seed=args.seed,
                        batch_size=args.batch_size, schedule=args.schedule, controller=args.controller, l2p=args.l2p,
                        rank=rank, world_size=world, dtype=args.dtype, device=device, workers=args.workers, judge=judge,
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
                                                 "qa:PATH, testbed:math or testbed:code "
                                                 "(testbed:math@validation: that split)")
    p.add_argument("--policies", required=True,
                   help="comma-separated name[:key=value...], e.g. confidence,threshold:tau=0.9,tracelock,oracle "
                        "(oracle replays the first policy's final tokens)")
    p.add_argument("--settings", default="128/32", help="GEN/WIDTH comma-separated, e.g. 128/32,256/64")
    p.add_argument("--controller", help="a `tracelock train --out` folder, for the tracelock policy")
    p.add_argument("--l2p", help="a `tracelock train-l2p --out` folder (one filter per block size), for l2p")
    p.add_argument("--schedule", default="auto", choices=["auto", "block", "window"],
                   help="auto: tracelock in a sliding window, the others in semi-AR blocks (the paper's protocol)")
    p.add_argument("--limit", type=int, help="the task's first N items (required for testbed tasks; not --num, which "
                                             "torchrun's own parser would take for --numa-binding)")
    p.add_argument("--out", required=True, help="run folder (re-running with the same arguments resumes)")
    p.add_argument("--judge-url", help="qa: an OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1 "
                                       "(API key, if any, from $TRACELOCK_JUDGE_API_KEY)")
    p.add_argument("--judge-model", help="qa: the served judge model's name, with --judge-url")
    p.add_argument("--judge-local", help="qa: a transformers chat model folder as the judge, instead of --judge-url")
    add_run_arguments(p)
    p.set_defaults(func=run_eval_cli)
