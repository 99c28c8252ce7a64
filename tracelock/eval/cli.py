"""`tracelock eval`: the paper-style comparison of policies on one task or several (see `tracelock.eval.runner`)."""

import os
from pathlib import Path


def run_eval_cli(args) -> int:
    from tracelock.cli_options import split_tasks
    from tracelock.distributed import torchrun_group
    from tracelock.eval.judging import check_judge_args, make_judge
    from tracelock.eval.runner import parse_policies, parse_settings, run_eval, slug, summary_table
    from tracelock.progress import status

    tasks = split_tasks(args.tasks)
    policies, settings = parse_policies(args.policies), parse_settings(args.settings)
    wants_judge = args.judge_url is not None or args.judge_local is not None
    if wants_judge:
        check_judge_args(args.judge_url, args.judge_model, args.judge_local)  # fail before decoding, build nothing
    # one task: its run folder is --out (what `tracelock report` reads); several: one run folder per task inside it
    folders = {task: Path(args.out) if len(tasks) == 1 else Path(args.out) / slug(task) for task in tasks}
    with torchrun_group(args.device) as (rank, world, device):
        judge = (make_judge(args.judge_url, args.judge_model, args.judge_local,
                            os.environ.get("TRACELOCK_JUDGE_API_KEY")) if wants_judge and rank == 0 else None)
        for task, folder in folders.items():
            rows = run_eval(args.model, task, policies, settings, folder, n=args.limit, seed=args.seed,
                            batch_size=args.batch_size, schedule=args.schedule, controller=args.controller,
                            l2p=args.l2p, rank=rank, world_size=world, dtype=args.model_dtype, device=device,
                            quantize=args.quantize, workers=args.workers, judge=judge, progress=status)
            if rows is not None:
                print(f"{task}: {rows[0]['metric_name']} / average steps per item:")
                print(summary_table(rows, [s.label for s in settings], [p.label for p in policies]))
                print(f"per-item results, traces and summary.json/.csv in {folder}\n")
    return 0


def add_run_arguments(p) -> None:
    """Decoding options shared by `eval` and `paper-tables`."""
    from tracelock.cli_options import add_allow_uncontained, add_batch_size, add_device, add_model_dtype
    from tracelock.cli_values import seed_int, workers_int

    add_batch_size(p, default=32)
    p.add_argument("--seed", type=seed_int, default=0,
                   help="seed of the random draw of items (--limit) and of sampling")
    p.add_argument("--workers", type=workers_int, default=2, help="sandbox processes for code scoring")
    add_allow_uncontained(p)
    add_model_dtype(p)
    add_device(p, torchrun=True)


def add_parsers(sub) -> None:
    from tracelock.cli_options import add_model, add_quantize, add_settings, option_help
    from tracelock.cli_parser import add_alias
    from tracelock.cli_values import positive_int

    p = sub.add_parser("eval", help="every policy on the same prompts: metric and steps per setting (resumable, "
                                    "torchrun-ready)")
    add_model(p)
    tasks = p.add_mutually_exclusive_group(required=True)
    tasks.add_argument("--tasks", help=option_help("--tasks", "several tasks write one run folder each inside --out"))
    add_alias(tasks, "--task", "--tasks", dest="tasks")
    p.add_argument("--policies", required=True,
                   help=option_help("--policies", "e.g. confidence,threshold:tau=0.9,tracelock,oracle (oracle "
                                                  "replays the first policy's final tokens)"))
    add_settings(p, default="128/32", schedule_help="auto: tracelock in a sliding window, the others in semi-AR "
                                                    "blocks (the paper's protocol); block or window: every policy so")
    p.add_argument("--controller", help="a `tracelock train --out` folder, for the tracelock policy (default: none)")
    p.add_argument("--l2p", help="a `tracelock train-l2p --out` folder (one filter per block size), for l2p "
                                 "(default: none)")
    p.add_argument("--limit", type=positive_int, metavar="N",
                   help="N of the task's items drawn at random with --seed (required for testbed tasks; default: every "
                        "item of a file task)")
    p.add_argument("--out", required=True, help="run folder (re-running with the same arguments resumes)")
    p.add_argument("--judge-url", help="qa: an OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1 "
                                       "(API key, if any, from $TRACELOCK_JUDGE_API_KEY; default: no judge)")
    p.add_argument("--judge-model", help="qa: the served judge model's name, with --judge-url (default: none)")
    p.add_argument("--judge-local", help="qa: a transformers chat model folder as the judge, instead of --judge-url "
                                         "(default: none)")
    add_run_arguments(p)
    add_quantize(p)
    p.set_defaults(func=run_eval_cli)
