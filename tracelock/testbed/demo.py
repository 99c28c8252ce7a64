"""`tracelock demo`: the bundled testbed model, held-out items, every heuristic baseline, one table each."""

import json
import sys
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from tracelock.atomic import atomic_write, atomic_write_json
from tracelock.models import load_model, load_tokenizer
from tracelock.testbed.evaluate import (
    baseline_policies,
    demo_policies,
    evaluate_oracle,
    evaluate_policies,
    evaluate_policy,
    format_table,
)
from tracelock.testbed.tasks import held_out


def _say(what: str) -> None:
    print(f"  {what}", file=sys.stderr, flush=True)


def _demo_controller(args):
    """The controller of the TraceLock row: ``--controller``, or the one the method pipeline trains in ``--work``."""
    if args.controller:
        return args.controller
    from tracelock.testbed.demo_method import train_demo_controller

    t0 = time.perf_counter()
    run = train_demo_controller(args.model, args.work, say=_say)
    print(f"controller ready in {run} ({time.perf_counter() - t0:.0f} s: collect, fit-encoder, featurize, train)\n")
    return run


def run_demo(args) -> int:
    t0 = time.perf_counter()
    controller = _demo_controller(args) if args.tracelock or args.controller else None
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    block = args.block if args.block or args.window else 16
    width = args.window or block
    setting = f"gen {args.gen_length}, " + (f"window {args.window}" if args.window else f"block {block}")
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        items = held_out(task, "test", args.n, seed=args.seed)
        rows = evaluate_policies(model, tokenizer, items, gen_length=args.gen_length,
                                 block=None if args.window else block, window=args.window,
                                 policies=demo_policies(args.gen_length, model.spec.family),
                                 batch_size=args.batch_size,
                                 progress=lambda label, task=task: _say(f"{task}: {label}"))
        if controller is not None:
            # TraceLock in its own soft-crop window of the same width (the paper's protocol)
            _say(f"{task}: tracelock")
            rows.append(evaluate_policy(model, tokenizer, items, f"TraceLock (window {width})", "tracelock",
                                        {"controller": str(controller)}, gen_length=args.gen_length, window=width,
                                        batch_size=args.batch_size))
        print(format_table(task, setting, [r.summary() for r in rows]) + "\n")
        best = rows[0]
        print(f"sample ({best.label}):\n{items[0].prompt}\n---\n{best.completions[0]}\n")
    print(f"total {time.perf_counter() - t0:.0f} s on this machine")
    return 0


def _chosen_policies(policies: list, labels) -> list:
    """The rows named in ``labels`` (comma-separated; None: all), in table order; the first row, the reference the
    oracle replays, is always kept."""
    if not labels:
        return policies
    wanted = {label.strip() for label in labels.split(",") if label.strip()}
    unknown = wanted - {label for label, _, _ in policies}
    if unknown:
        raise ValueError(f"--policies: unknown rows {sorted(unknown)}; choose from "
                         f"{', '.join(repr(label) for label, _, _ in policies)}")
    return [row for i, row in enumerate(policies) if i == 0 or row[0] in wanted]


def run_eval(args) -> int:
    """`tracelock testbed-eval`: the quality-vs-steps tables for several settings, saved as JSON and printed.

    Resumable per policy row: each finished row is written to ``--out`` at once (atomically), and the reference
    run's canvases, which the oracle row replays, to ``<out>.canvas.safetensors``; a rerun skips what is there.
    """
    model, tokenizer = load_model(args.model, device=args.device), load_tokenizer(args.model)
    out = Path(args.out)
    canvas_file = out.with_name(out.name + ".canvas.safetensors")
    results = json.loads(out.read_text()) if out.exists() else {}
    canvases = load_file(str(canvas_file)) if canvas_file.exists() else {}
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        items = held_out(task, "test", args.n, seed=args.seed)
        for setting in args.settings.split(","):
            gen_length, width = (int(v) for v in setting.split("/"))
            key = f"{task} gen{gen_length} {args.schedule}{width}"
            settings = dict(gen_length=gen_length, batch_size=args.batch_size, workers=args.workers,
                            **{args.schedule: width})
            rows = results.setdefault(key, [])
            if any(r["n"] != len(items) for r in rows):
                raise ValueError(f"{out} holds {key!r} measured on {rows[0]['n']} items; pass --n {rows[0]['n']} "
                                 f"to resume it, or another --out for {len(items)} items")
            done = {r["policy"] for r in rows}
            policies = _chosen_policies(baseline_policies(gen_length, model.spec.family), args.policies)
            for label, name, policy_args in policies:
                if label in done:
                    continue
                print(f"  {key}: {label}", file=sys.stderr, flush=True)
                r = evaluate_policy(model, tokenizer, items, label, name, policy_args, **settings)
                rows.append(r.summary())
                if label == policies[0][0]:
                    canvases[key] = r.canvas.cpu().contiguous()
                    atomic_write(canvas_file, lambda p: save_file(canvases, p))
                atomic_write_json(out, results)
            reference_label = policies[0][0]
            if f"oracle (of {reference_label})" not in done:
                print(f"  {key}: oracle", file=sys.stderr, flush=True)
                oracle = evaluate_oracle(model, tokenizer, items, reference_label, canvases[key], **settings)
                rows.append(oracle.summary())
                atomic_write_json(out, results)
            print(format_table(task, f"gen {gen_length}, {args.schedule} {width}", rows) + "\n", flush=True)
    return 0
