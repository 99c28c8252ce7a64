"""`tracelock demo`: the bundled testbed model, held-out items, every heuristic baseline, one table each."""

import sys
import time

from tracelock.models import load_model, load_tokenizer
from tracelock.testbed.evaluate import evaluate_policies, format_table
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
                                 batch_size=args.batch_size,
                                 progress=lambda label, task=task: print(f"  {task}: {label}", file=sys.stderr))
        print(format_table(task, setting, rows) + "\n")
        best = rows[0]
        print(f"sample ({best.label}):\n{items[0].prompt}\n---\n{best.completions[0]}\n")
    print(f"total {time.perf_counter() - t0:.0f} s on this machine")
    return 0
