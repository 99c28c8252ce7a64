"""`tracelock demo`: the bundled testbed model, held-out items, every heuristic baseline, one table each
(``--policies`` picks the rows, and adds any other rule as a row of its own: ``--policies credit,klass``)."""

import json
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from tracelock.atomic import atomic_write, atomic_write_json
from tracelock.cli_options import testbed_task_names
from tracelock.cli_parser import warn_deprecated
from tracelock.models import load_model, load_tokenizer
from tracelock.models.loading import resolve_path
from tracelock.models.spec import ModelSpec
from tracelock.policy_specs import POLICY_NAMES, expand_policy_list, spec_value
from tracelock.progress import progress_bar, status
from tracelock.tasks import draw, held_out
from tracelock.testbed.evaluate import (
    baseline_policies,
    demo_policies,
    evaluate_oracle,
    evaluate_policies,
    evaluate_policy,
    format_table,
)


def _demo_controller(args):
    """The controller of the TraceLock row: ``--controller``; with ``--train-controller``, the one the method
    pipeline trains in ``--work``; otherwise the controller shipped with the bundled ``--model``."""
    from tracelock.models.loading import BUNDLED_CONTROLLERS

    if args.controller:
        return args.controller
    if not args.train_controller:
        if str(args.model) in BUNDLED_CONTROLLERS:
            return str(args.model)  # the policy resolves the name to the shipped controller
        raise ValueError(f"--tracelock with --model {args.model}: only the bundled models ship a controller; pass "
                         "--controller DIR (a `tracelock train --out` folder) or --train-controller to train one")
    from tracelock.testbed.demo_method import train_demo_controller

    t0 = time.perf_counter()
    run = train_demo_controller(args.model, args.work, say=status)
    print(f"controller ready in {run} ({time.perf_counter() - t0:.0f} s: collect, fit-encoder, featurize, train)\n")
    return run


def _check_rows(rows: list, *, gen_length: int, block, window) -> None:
    """The ``--policies`` rows' policies built and set up without the model, so a bad spec fails before any row
    decodes; a rule with a memory per slot (credit, klass, less) runs in blocks, not in a window."""
    from tracelock.policies import POLICIES, resolve_policy

    for label, name, args in rows:
        try:
            resolve_policy(name, args, gen_length=gen_length, num_regions=gen_length // block if block else 1)
        except (ValueError, TypeError) as err:
            raise ValueError(f"--policies {label}: {err}") from None
        if window and POLICIES[name].reads_vocab:
            raise ValueError(f"--policies {label}: {name} keeps a memory per slot of a block, which a sliding window "
                             f"moves: decode in blocks (--block N; testbed-eval: --schedule block), not in a window "
                             f"of {window}")


def _code_sandbox(tasks: list[str]) -> dict | None:
    """When ``tasks`` hold the code task: fail closed now, before the model loads (the error names the opt-in), and
    return the sandbox's record (`tracelock.sandbox.sandbox_record`); None without code."""
    if "code" not in tasks:
        return None
    from tracelock.sandbox import require_containment, sandbox_record

    require_containment()
    return sandbox_record()


def run_demo(args) -> int:
    t0 = time.perf_counter()
    sandbox = _code_sandbox(testbed_task_names(args.tasks))
    block = args.block if args.block or args.window else 16
    width = args.window or block
    family = ModelSpec.from_pretrained(resolve_path(args.model)).family
    default = demo_policies(args.gen_length, family)
    policies = _chosen_policies(default, getattr(args, "policies", None), command="tracelock demo", labels=False)
    _check_rows([row for row in policies if row not in default], gen_length=args.gen_length,
                block=None if args.window else block, window=args.window)
    controller = _demo_controller(args) if args.tracelock or args.controller or args.train_controller else None
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    setting = f"gen {args.gen_length}, " + (f"window {args.window}" if args.window else f"block {block}")
    for task in testbed_task_names(args.tasks):
        items = held_out(task, "test", args.limit, seed=args.seed)
        # every row decodes every item: the baselines, the oracle and, if asked, TraceLock
        bar = progress_bar(total=len(items) * (len(policies) + 1 + (controller is not None)), desc=task)
        rows = evaluate_policies(model, tokenizer, items, gen_length=args.gen_length,
                                 block=None if args.window else block, window=args.window, policies=policies,
                                 batch_size=args.batch_size, progress=bar.set_postfix_str, on_batch=bar.update)
        if controller is not None:
            # TraceLock in its own soft-crop window of the same width (the paper's protocol)
            bar.set_postfix_str("tracelock")
            rows.append(evaluate_policy(model, tokenizer, items, f"TraceLock (window {width})", "tracelock",
                                        {"controller": str(controller)}, gen_length=args.gen_length, window=width,
                                        batch_size=args.batch_size, on_batch=bar.update))
        bar.close()
        print(format_table(task, setting, [r.summary() for r in rows]) + "\n")
        if task == "code" and not sandbox["contained"]:
            print("the code answers ran without containment (--allow-uncontained-code)\n")
        best = rows[0]
        print(f"sample ({best.label}):\n{items[0].prompt}\n---\n{best.completions[0]}\n")
    print(f"total {time.perf_counter() - t0:.0f} s on this machine")
    return 0


def _spec(name: str, args: dict) -> str:
    """A table row as a policy spec: ("threshold", {"tau": 0.9}) -> "threshold:tau=0.9"."""
    return name + "".join(f":{k}={v}" for k, v in args.items())


def _chosen_policies(policies: list, wanted, *, command: str = "tracelock testbed-eval", labels: bool = True) -> list:
    """The rows ``wanted`` names (comma-separated policy specs such as ``threshold:tau=0.9``, or, deprecated, the
    rows' labels such as "threshold 0.9" when ``labels``; None: all), in table order; a spec that is no row of this
    setting's table becomes a row of its own, labelled by its spec, after them (``credit:tau=0.9``, ``klass``). The
    first row, the reference the oracle replays, is always kept."""
    if not wanted:
        return policies
    row_labels = {label for label, _, _ in policies}
    chosen, extra, specs = set(), [], []
    for token in (t.strip() for t in wanted.split(",")):
        if labels and token in row_labels:
            name, args = next((n, a) for label, n, a in policies if label == token)
            warn_deprecated(command, f"--policies {token!r}", f"--policies {_spec(name, args)}")
            chosen.add(token)
        elif token:
            specs.append(token)
    try:
        expanded = expand_policy_list(",".join(specs), names=POLICY_NAMES) if specs else []
    except ValueError as err:
        if not labels:
            raise
        raise ValueError(f"{err} (nor a row of the table: {', '.join(repr(label) for label in row_labels)})") from None
    for token, name, pairs in expanded:
        args = {k: spec_value(v) for k, v in pairs}
        match = next((label for label, n, a in policies if (n, a) == (name, args)), None)
        if match is not None:
            chosen.add(match)
        elif token not in {label for label, _, _ in extra}:
            extra.append((token, name, args))
    return [row for i, row in enumerate(policies) if i == 0 or row[0] in chosen] + extra


def run_testbed_eval(args) -> int:
    """`tracelock testbed-eval`: the quality-vs-steps tables for several settings, saved as JSON and printed.

    Resumable per policy row: each finished row is written to ``--out`` at once (atomically), and the reference
    run's canvases, which the oracle row replays, to ``<out>.canvas.safetensors``; a rerun skips what is there.
    """
    family = ModelSpec.from_pretrained(resolve_path(args.model)).family
    sandbox = _code_sandbox(testbed_task_names(args.tasks))
    chosen = {}  # each setting's rows, their specs checked before the model loads
    for setting in args.settings.split(","):
        gen_length, width = _setting(setting)
        default = baseline_policies(gen_length, family)
        chosen[setting] = _chosen_policies(default, args.policies)
        _check_rows([row for row in chosen[setting] if row not in default], gen_length=gen_length,
                    block=width if args.schedule == "block" else None,
                    window=width if args.schedule == "window" else None)
    model, tokenizer = load_model(args.model, device=args.device), load_tokenizer(args.model)
    out = Path(args.out)
    canvas_file = out.with_name(out.name + ".canvas.safetensors")
    results = json.loads(out.read_text()) if out.exists() else {}
    canvases = load_file(str(canvas_file)) if canvas_file.exists() else {}
    for task in testbed_task_names(args.tasks):
        ids, items = zip(*draw(task, "test", args.limit, seed=args.seed))
        for setting in args.settings.split(","):
            gen_length, width = _setting(setting)
            key = f"{task} gen{gen_length} {args.schedule}{width}"
            settings = dict(gen_length=gen_length, batch_size=args.batch_size, workers=args.workers,
                            **{args.schedule: width})
            rows = results.setdefault(key, [])
            if any(r["n"] != len(items) for r in rows):
                raise ValueError(f"{out} holds {key!r} measured on {rows[0]['n']} items; pass --limit "
                                 f"{rows[0]['n']} to resume it, or another --out for {len(items)} items")
            done = {r["policy"] for r in rows}
            policies = chosen[setting]
            for label, name, policy_args in policies:
                if label in done:
                    continue
                status(f"{key}: {label}")
                with progress_bar(total=len(items), desc=key) as bar:
                    r = evaluate_policy(model, tokenizer, items, label, name, policy_args, on_batch=bar.update,
                                        **settings)
                rows.append({**r.summary(), "item_ids": list(ids),
                             **({"sandbox": sandbox} if task == "code" else {})})
                if label == policies[0][0]:
                    canvases[key] = r.canvas.cpu().contiguous()
                    atomic_write(canvas_file, lambda p: save_file(canvases, p))
                atomic_write_json(out, results)
            reference_label = policies[0][0]
            if f"oracle (of {reference_label})" not in done:
                status(f"{key}: oracle")
                with progress_bar(total=len(items), desc=key) as bar:
                    oracle = evaluate_oracle(model, tokenizer, items, reference_label, canvases[key],
                                             on_batch=bar.update, **settings)
                rows.append({**oracle.summary(), "item_ids": list(ids),
                             **({"sandbox": sandbox} if task == "code" else {})})
                atomic_write_json(out, results)
            print(format_table(task, f"gen {gen_length}, {args.schedule} {width}", rows) + "\n", flush=True)
    return 0


def _setting(text: str) -> tuple[int, int]:
    """"64/16" -> (64, 16)."""
    gen, sep, width = text.strip().partition("/")
    if not (sep and gen.isdigit() and width.isdigit() and int(gen) > 0 and int(width) > 0):
        raise ValueError(f"--settings: {text!r} must look like GEN/WIDTH, e.g. 64/16")
    return int(gen), int(width)
