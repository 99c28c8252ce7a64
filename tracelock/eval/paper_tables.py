"""`tracelock paper-tables`: the paper's main, generalisation and deployment-ablation tables in one command.

For each task, one `tracelock eval` run folder (resumable; `tracelock report` draws its plots) holds:

- main table: random, confidence (one token per step), Fast-dLLM threshold 0.9, Learn2PD (with ``--l2p``: its
  filter trained for each block size) and TraceLock, at every generation length x width (the paper's Table "main
  results");
- generalisation: the same policies deployed at width G/4 and at the larger G/2 without retraining (the paper's
  "original block/window -> larger" table); Learn2PD's G/2 cell uses its block-G/4 filter (``filter_block``),
  chunk by chunk;
- deployment ablation at width G/4: TraceLock full, without soft-crop (the whole generation region), without the
  dynamic threshold (a static threshold logit, 0 by default: commit when sigmoid(a) > theta), without both.

Baselines decode in semi-AR blocks and TraceLock in its sliding window, as in the paper.
"""

from __future__ import annotations

from pathlib import Path

from tracelock.atomic import atomic_write_json, atomic_write_text, folder_lock, remove_stale_temps

ABLATIONS = [("full", ""), ("w/o soft-crop", ":schedule=full"), ("w/o dynamic threshold", ":static_tau={tau}"),
             ("w/o both", ":schedule=full:static_tau={tau}")]


def main_policies(with_l2p: bool) -> list[str]:
    """The main table's rows; Learn2PD when its filters are given."""
    return ["random", "confidence", "threshold:tau=0.9"] + (["l2p"] if with_l2p else []) + ["tracelock"]


def l2p_transfer(a: str) -> str:
    """The policy token of Learn2PD generalised from setting ``a`` (G/W): its block-W filter."""
    return f"l2p:filter_block={a.split('/')[1]}"


def plan(lengths: list[int], widths: list[int]) -> dict:
    """The settings each table needs: main G/W for every pair; generalisation and ablations at G/4 (and G/2)."""
    for g in lengths:
        if g % 4:
            raise ValueError(f"--lengths: {g} must be a multiple of 4 (the tables use widths G/4 and G/2)")
    main = [f"{g}/{w}" for g in lengths for w in widths]
    general = [(f"{g}/{g // 4}", f"{g}/{g // 2}") for g in lengths]
    ablation = [f"{g}/{g // 4}" for g in lengths]
    settings = list(dict.fromkeys(main + [s for pair in general for s in pair]))
    return dict(main=main, generalisation=general, ablation=ablation, settings=settings)


def _markdown(rows_by_task: dict, layout: dict, policies: list[str], ablations: list[tuple]) -> str:
    from tracelock.eval.runner import metric_cell

    parts = []
    main_header = "| task | policy | " + " | ".join(layout["main"]) + " |"
    lines = ["### Main results (metric / average steps)", "", main_header,
             "|" + "---|" * (2 + len(layout["main"]))]
    for task, rows in rows_by_task.items():
        cells = {(r["setting"], r["policy"]): r for r in rows}
        for p in policies:
            lines.append(f"| {task} | {p} | " + " | ".join(metric_cell(cells.get((s, p))) for s in layout["main"])
                         + " |")
    parts.append("\n".join(lines))
    lines = ["### Generalisation to a larger block/window (metric: original -> larger (change))", "",
             "| task | policy | " + " | ".join(f"{a} -> {b.split('/')[1]}" for a, b in layout["generalisation"])
             + " |", "|" + "---|" * (2 + len(layout["generalisation"]))]
    for task, rows in rows_by_task.items():
        cells = {(r["setting"], r["policy"]): r for r in rows}
        for p in policies:
            if p == "random":
                continue
            out = []
            for a, b in layout["generalisation"]:
                ra, rb = cells.get((a, p)), cells.get((b, l2p_transfer(a) if p == "l2p" else p))
                if ra is None or rb is None or ra["metric"] is None or rb["metric"] is None:
                    out.append("-")
                else:
                    out.append(f"{100 * ra['metric']:.1f} -> {100 * rb['metric']:.1f} "
                               f"({100 * (rb['metric'] - ra['metric']):+.1f})")
            lines.append(f"| {task} | {p} | " + " | ".join(out) + " |")
    parts.append("\n".join(lines))
    lines = ["### TraceLock deployment ablation (metric / average steps)", "",
             "| task | setting | " + " | ".join(name for name, _ in ablations) + " |",
             "|" + "---|" * (2 + len(ablations))]
    for task, rows in rows_by_task.items():
        cells = {(r["setting"], r["policy"]): r for r in rows}
        for s in layout["ablation"]:
            lines.append(f"| {task} | {s} | " + " | ".join(metric_cell(cells.get((s, spec))) for _, spec in ablations)
                         + " |")
    parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def run_tables(model, controller, tasks: list[str], out, *, l2p=None, lengths=(64, 128), widths=(16, 32),
               limit=None, static_tau: float = 0.0, batch_size=32, seed=0, workers=2, dtype="float32", device="cpu",
               rank=0, world_size=1, progress=None) -> str | None:
    """Decode what the three tables need into ``out/<task>/`` and write ``out/tables.md`` and ``tables.json``.

    Returns the markdown on rank 0 (None on other ranks).
    """
    from tracelock.eval.runner import parse_policies, parse_settings, run_eval, slug

    layout = plan(list(lengths), list(widths))
    main = main_policies(l2p is not None)
    ablations = [(name, "tracelock" + suffix.format(tau=static_tau)) for name, suffix in ABLATIONS]
    out = Path(out)
    with folder_lock(out, f"lock-rank{rank}"):  # one writer per rank; each task's eval folder has its own lock
        rows_by_task = {}
        for task in tasks:
            folder = out / slug(task)
            common = dict(n=limit, seed=seed, batch_size=batch_size, controller=controller, l2p=l2p, rank=rank,
                          world_size=world_size, dtype=dtype, device=device, workers=workers, progress=progress)
            rows = run_eval(model, task, parse_policies(",".join(main)), parse_settings(",".join(layout["settings"])),
                            folder, **common)
            extra = run_eval(model, task, parse_policies(",".join(spec for _, spec in ablations[1:])),
                             parse_settings(",".join(layout["ablation"])), folder, **common)
            for a, b in layout["generalisation"] if l2p is not None else []:
                extra_l2p = run_eval(model, task, parse_policies(l2p_transfer(a)), parse_settings(b), folder, **common)
                extra = None if extra is None else extra + extra_l2p
            if rank == 0:
                rows_by_task[task] = rows + extra
        if rank != 0:
            return None
        text = _markdown(rows_by_task, layout, main, ablations)
        atomic_write_text(out / "tables.md", text)
        atomic_write_json(out / "tables.json", dict(layout=layout, policies=main, ablations=ablations,
                                                    rows=rows_by_task, model=str(model), controller=str(controller),
                                                    l2p=None if l2p is None else str(l2p)))
        remove_stale_temps(out)
        return text


def run_tables_cli(args) -> int:
    from tracelock.cli_options import split_tasks
    from tracelock.distributed import torchrun_group
    from tracelock.progress import status

    tasks = split_tasks(args.tasks)
    with torchrun_group(args.device) as (rank, world, device):
        text = run_tables(args.model, args.controller, tasks, args.out, l2p=args.l2p,
                          lengths=_ints(args.gen_lengths, "--gen-lengths"),
                          widths=_ints(args.widths, "--widths"), limit=args.limit, static_tau=args.static_tau,
                          batch_size=args.batch_size, seed=args.seed, workers=args.workers, dtype=args.model_dtype,
                          device=device, rank=rank, world_size=world, progress=status)
    if text is not None:
        print(text)
        print(f"tables in {Path(args.out) / 'tables.md'}; run folders (for `tracelock report`) in {args.out}/*/")
    return 0


def _ints(text: str, arg: str) -> list[int]:
    from tracelock.cli_values import MAX_GEN_LENGTH

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{arg} {text!r} must be comma-separated integers, e.g. 64,128") from None
    if not values or min(values) < 1 or max(values) > MAX_GEN_LENGTH:
        raise ValueError(f"{arg} {text!r} must name at least one integer, each in 1..{MAX_GEN_LENGTH}")
    return values


def add_parsers(sub) -> None:
    from tracelock.cli_options import add_model, option_help
    from tracelock.cli_parser import add_alias
    from tracelock.cli_values import positive_int
    from tracelock.eval.cli import add_run_arguments

    p = sub.add_parser("paper-tables", help="the paper's main, generalisation and deployment-ablation tables "
                                            "(resumable, torchrun-ready)")
    add_model(p)
    p.add_argument("--controller", required=True, help="a `tracelock train --out` folder")
    p.add_argument("--l2p", help="a `tracelock train-l2p --out` folder with a filter for every width (adds Learn2PD; "
                                 "default: none, no Learn2PD rows)")
    p.add_argument("--tasks", default="testbed:math,testbed:code", help=option_help("--tasks"))
    p.add_argument("--gen-lengths", default="64,128", metavar="N,N,...",
                   help="generation lengths, comma-separated (multiples of 4); the tables cross them with --widths")
    add_alias(p, "--lengths", "--gen-lengths", dest="gen_lengths")
    p.add_argument("--widths", default="16,32", metavar="W,W,...",
                   help="block/window widths of the main table, comma-separated")
    p.add_argument("--limit", type=positive_int, metavar="N",
                   help="the first N items per task (required for testbed tasks; default: every item of a file task)")
    p.add_argument("--static-tau", type=float, default=0.0, help="threshold logit of the static-threshold ablation")
    p.add_argument("--out", required=True, help="output folder (re-running with the same arguments resumes)")
    add_run_arguments(p)
    p.set_defaults(func=run_tables_cli)

