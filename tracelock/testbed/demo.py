"""`tracelock demo`: the bundled testbed model, held-out items, every heuristic baseline, one table each."""

import json
import sys
import time
from pathlib import Path

from tracelock.atomic import atomic_write_json
from tracelock.models import load_model, load_tokenizer
from tracelock.testbed.evaluate import demo_policies, evaluate_policies, format_table
from tracelock.testbed.tasks import held_out


def run_demo(args) -> int:
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    block = args.block if args.block or args.window else 16
    setting = f"gen {args.gen_length}, " + (f"window {args.window}" if args.window else f"block {block}")
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        items = held_out(task, "test", args.n, seed=args.seed)
        rows = evaluate_policies(model, tokenizer, items, gen_length=args.gen_length,
                                 block=None if args.window else block, window=args.window,
                                 policies=demo_policies(args.gen_length),
                                 batch_size=args.batch_size,
                                 progress=lambda label, task=task: print(f"  {task}: {label}", file=sys.stderr))
        print(format_table(task, setting, rows) + "\n")
        best = rows[0]
        print(f"sample ({best.label}):\n{items[0].prompt}\n---\n{best.completions[0]}\n")
    print(f"total {time.perf_counter() - t0:.0f} s on this machine")
    return 0


def run_eval(args) -> int:
    """`tracelock testbed-eval`: the quality-vs-steps tables for several settings, saved as JSON and printed."""
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        items = held_out(task, "test", args.n, seed=args.seed)
        for setting in args.settings.split(","):
            gen_length, width = (int(v) for v in setting.split("/"))
            key = f"{task} gen{gen_length} {args.schedule}{width}"
            if key in results:  # resumable: settings already measured are kept
                continue
            kwargs = {args.schedule: width}
            rows = evaluate_policies(model, tokenizer, items, gen_length=gen_length, batch_size=args.batch_size,
                                     progress=lambda label, key=key: print(f"  {key}: {label}", file=sys.stderr),
                                     **kwargs)
            print(format_table(task, f"gen {gen_length}, {args.schedule} {width}", rows) + "\n", flush=True)
            results[key] = [dict(policy=r.label, accuracy=r.accuracy, avg_steps=r.avg_steps,
                                 seconds_per_item=r.seconds_per_item, n=len(items)) for r in rows]
            atomic_write_json(out, results)
    return 0
