"""TraceLock's shipped rule against the envelope of the strongest heuristics, cell by cell and pooled, from the
committed per-item records.

A folder (``bench/results/verdict-testbed-llada``) holds one record file per cell and batch of runs,
``<what>-<task>-<G>-<W>.json`` (``{"ids": [...], "points": {"<run>/<policy slug>": {"correct": "0101...",
"steps": [...]}}}``, as `bench/studies/matched_runs.py --records` writes them) and, for the verdict's first frontier,
its ``records.json``. Every point of a cell is read on the cell's items (files of one cell must hold the same ids; a
point in two files must be the same).

Curves are the points' policy slugs with the knobs taken out (``tau``, ``per-step``, ``f``, ``delta``, ``theta``,
``gamma``, ``steps``, ``low``, ``kl``); a curve is a heuristic when its policy needs no training
(`tracelock.eval.matched.HEURISTICS`) and held when it carries ``hold-end-true``. The shipped rule is TraceLock with
``hold-end-true``; the paper's rule the frontier's ``TraceLock-ST`` curve; the gate (`tracelock fit`'s learned
correction of a training-free rule) any ``gate`` curve. Each comparison reads one TraceLock curve against the
envelope of a set of heuristic curves at matched steps (`tracelock.eval.matched.gap_at_matched_steps`):

- ``published``: the families' one-per-step rules at 1, 2, 4 tokens and Fast-dLLM's threshold (both forms on Dream),
- ``control``: those and the held threshold (the control of docs/frontier.md),
- ``strongest``: every heuristic in the records, published and held, factor and Fréchet included.

Intervals: a paired bootstrap over items, one draw of item weights per task and resample shared by every cell of
that task (the cells of a task hold the same items), so the pooled gap (the mean over cells) pairs too; 90%
intervals (5th to 95th percentile). A cell is a win (loss) when its interval lies above (below) zero; Holm's
correction over the cells uses the two-sided bootstrap p-value ``2 min(P(gap <= 0), P(gap >= 0))`` (``(k + 1) /
(R + 1)`` counts) at family-wise level 0.10, the level of a 90% interval's two sides::

    python bench/studies/verdict_envelope.py bench/results/verdict-testbed-llada bench/results/verdict-testbed-dream \\
        --out bench/results/verdict-envelope.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from tracelock.eval.matched import HEURISTICS, Curve, gap_at_matched_steps

# every knob a curve is traced along (the rules since Fast-dLLM's too: eb's gamma, PC-Sampler's steps, the
# hierarchy's low, KLASS's kl; the gate's base_gamma ends in -gamma-)
KNOB = re.compile(r"-(tau|per-step|f|delta|theta|gamma|steps|low|kl)-[0-9.]+")
CELL_FILE = re.compile(r"^(?P<what>.+)-(?P<task>math|code)-(?P<gen>\d+)-(?P<width>\d+)\.json$")
COMPARISONS = ("published", "control", "strongest")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def load_cells(folder) -> dict:
    """{(task, "G/W"): {"ids": [...], "points": {name: (correct [N] float, steps [N] float)}}} of one folder."""
    folder = Path(folder)
    cells: dict = {}

    def add(task, setting, ids, name, correct, steps, where):
        cell = cells.setdefault((task, setting), {"ids": list(ids), "points": {}})
        if cell["ids"] != list(ids):
            raise SystemExit(f"{where}: {task} {setting} holds other items than the cell's other files")
        got = (np.array([c == "1" for c in correct], dtype=np.float64), np.asarray(steps, dtype=np.float64))
        old = cell["points"].get(name)
        if old is not None and not (np.array_equal(old[0], got[0]) and np.array_equal(old[1], got[1])):
            raise SystemExit(f"{where}: point {name} of {task} {setting} differs from another file's")
        cell["points"][name] = got

    records = folder / "records.json"
    if records.exists():
        for task, settings in json.loads(records.read_text()).items():
            for setting, rec in settings.items():
                for label, p in rec["points"].items():
                    add(task.split(":")[1], setting, rec["ids"], f"{setting.replace('/', '-')}/{_slug(label)}",
                        p["correct"], p["steps"], records)
    for path in sorted(folder.glob("*.json")):
        m = CELL_FILE.match(path.name)
        if not m:
            continue
        rec = json.loads(path.read_text())
        for name, p in rec["points"].items():
            add(m["task"], f"{m['gen']}/{m['width']}", rec["ids"], name, p["correct"], p["steps"], path)
    return cells


def curve_of(point: str) -> str:
    """A point's curve: its policy slug with the knob taken out."""
    return KNOB.sub("", point.split("/", 1)[1])


def kind_of(curve: str) -> str:
    """heuristic / held (a held heuristic) / shipped / paper / gate / other (Learn2PD, TraceLock otherwise)."""
    name = curve.split("-")[0]
    if name in HEURISTICS:
        return "held" if "hold-end-true" in curve else "heuristic"
    if name == "gate":
        return "gate"
    if name == "tracelock":
        if "curve-tracelock-st" in curve:
            return "paper"
        return "shipped" if "hold-end-true" in curve else "other"
    return "other"


def judged(curve: str, learned: str) -> bool:
    """The curve judged against the envelopes: the shipped rule's, the paper's, or (``held-threshold``, the hold's
    share alone) Fast-dLLM's threshold with the hold, in its plain form on both families."""
    if learned == "held-threshold":
        return curve == "threshold-hold-end-true"
    return kind_of(curve) == learned


def members(curves: dict, comparison: str) -> list:
    """The heuristic curves of one comparison's envelope."""
    out = []
    for name in curves:
        kind = kind_of(name)
        published = kind == "heuristic" and name.split("-")[0] in ("confidence", "threshold")
        if comparison == "published" and published:
            out.append(name)
        elif comparison == "control" and (published or (kind == "held" and name.startswith("threshold"))):
            out.append(name)
        elif comparison == "strongest" and kind in ("heuristic", "held"):
            out.append(name)
    return out


def build_curves(cell: dict) -> dict:
    grouped: dict = {}
    for point, value in sorted(cell["points"].items()):
        grouped.setdefault(curve_of(point), []).append((point, value))
    return {name: Curve(name, [v[0] for _, v in pts], [v[1] for _, v in pts], [p for p, _ in pts])
            for name, pts in grouped.items()}


def holm(pvalues: dict, alpha: float = 0.10) -> set:
    """The keys whose null (gap 0) Holm's step-down procedure rejects at family-wise level ``alpha``."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    rejected = set()
    for i, key in enumerate(order):
        if pvalues[key] > alpha / (len(order) - i):
            break
        rejected.add(key)
    return rejected


def knob_of(point: str) -> float | None:
    """A point's knob value (its ``tau``, ``f``, ``theta``, ...); None when it has none."""
    m = KNOB.search(point.split("/", 1)[1])
    return float(m.group(0).rsplit("-", 1)[1]) if m else None


def analyse(folders: list, *, resamples: int = 2000, seed: int = 0, learned: str = "shipped",
            knobs: tuple | None = None) -> dict:
    """Every comparison in every cell of ``folders``: gap, 90% interval, P(gap > 0), p-value, plain and Holm verdicts,
    the envelope's members; pooled over all cells, math and code, with intervals. ``knobs`` (lo, hi) keeps only the
    judged curve's points whose knob lies in [lo, hi] (the shipped rule at the theta points a reading first had)."""
    cells = {}
    for folder in folders:
        for (task, setting), cell in load_cells(folder).items():
            family = "dream" if "dream" in Path(folder).name else "llada"
            cells[(family, task, setting)] = cell
    return analyse_cells(cells, resamples=resamples, seed=seed, learned=learned, knobs=knobs)


def analyse_cells(raw: dict, *, resamples: int = 2000, seed: int = 0, learned: str = "shipped",
                  knobs: tuple | None = None, comparisons: tuple = COMPARISONS) -> dict:
    """`analyse` on cells given as {(family, task, setting): {"ids": [...], "points": {name: (correct, steps)}}}
    (`load_cells`' form); the cells of a task must hold the same items (one bootstrap draw per task)."""
    cells, ids_of = {}, {}
    for (family, task, setting), cell in raw.items():
        points = cell["points"]
        if knobs is not None:
            points = {k: v for k, v in points.items()
                      if not judged(curve_of(k), learned) or knobs[0] <= knob_of(k) <= knobs[1]}
        cells[(family, task, setting)] = build_curves(dict(cell, points=points))
        if ids_of.setdefault(task, cell["ids"]) != cell["ids"]:
            raise SystemExit(f"the {task} cells hold different items; a shared bootstrap needs the same items")
    rng = np.random.default_rng(seed)
    weights = [{task: rng.multinomial(len(ids), np.full(len(ids), 1 / len(ids))).astype(np.float64)
                for task, ids in ids_of.items()} for _ in range(resamples)]
    out = {"resamples": resamples, "seed": seed, "learned": learned, "comparisons": {}}
    # the held threshold judged alone: its own envelopes would hold it, so only the published one is read
    for comparison in comparisons if learned != "held-threshold" else ("published",):
        rows, draws = {}, {}
        for key, curves in sorted(cells.items()):
            family, task, setting = key
            policy = [c for n, c in curves.items() if judged(n, learned)]
            base = [curves[n] for n in members(curves, comparison)]
            if len(policy) != 1 or not base:
                continue
            gap = gap_at_matched_steps(policy[0], base)
            boot = np.array([gap_at_matched_steps(policy[0], base, w[task]) for w in weights], dtype=np.float64)
            lo, hi = np.percentile(boot, [5, 95], method="nearest")
            p = min(1.0, 2 * min((np.sum(boot <= 0) + 1), (np.sum(boot >= 0) + 1)) / (resamples + 1))
            steps, _ = policy[0].points()
            rows[f"{family} {task} {setting}"] = dict(
                gap=gap, interval=[float(lo), float(hi)], above_zero=float(np.mean(boot > 0)), p=p,
                verdict="win" if lo > 0 else "loss" if hi < 0 else "tie", members=[c.name for c in base],
                policy_steps=[float(steps.min()), float(steps.max())], n=policy[0].n_items)
            draws[f"{family} {task} {setting}"] = boot
        rejected = holm({k: r["p"] for k, r in rows.items()})
        for k, r in rows.items():
            r["holm"] = ("win" if r["gap"] > 0 else "loss") if k in rejected else "tie"
        pooled = {}
        groups = (("all", lambda k: True), ("math", lambda k: " math " in k), ("code", lambda k: " code " in k),
                  ("llada", lambda k: k.startswith("llada")), ("dream", lambda k: k.startswith("dream")))
        for name, keep in groups:
            keys = [k for k in rows if keep(k)]
            if keys:
                values = np.mean([draws[k] for k in keys], axis=0)
                lo, hi = np.percentile(values, [5, 95], method="nearest")
                pooled[name] = dict(gap=float(np.mean([rows[k]["gap"] for k in keys])), interval=[float(lo), float(hi)],
                                    cells=len(keys))
        tally = {v: sum(r["verdict"] == v for r in rows.values()) for v in ("win", "tie", "loss")}
        tally_holm = {v: sum(r["holm"] == v for r in rows.values()) for v in ("win", "tie", "loss")}
        out["comparisons"][comparison] = dict(cells=rows, pooled=pooled, tally=tally, tally_holm=tally_holm)
    return out


def markdown(result: dict) -> str:
    lines = []
    for comparison, d in result["comparisons"].items():
        lines += [f"## {result['learned']} against the {comparison} envelope", "",
                  "| cell | gap [90%] | P(gap > 0) | p | verdict | Holm |", "|---|---|---|---|---|---|"]
        for key, r in d["cells"].items():
            lo, hi = r["interval"]
            lines.append(f"| {key} | {100 * r['gap']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | "
                         f"{r['above_zero']:.2f} | {r['p']:.3f} | {r['verdict']} | {r['holm']} |")
        t, th = d["tally"], d["tally_holm"]
        lines += ["", f"plain: {t['win']} wins, {t['tie']} ties, {t['loss']} losses; Holm: {th['win']} wins, "
                      f"{th['tie']} ties, {th['loss']} losses", ""]
        for name, p in d["pooled"].items():
            lines.append(f"- pooled {name} ({p['cells']} cells): {100 * p['gap']:+.1f} "
                         f"[{100 * p['interval'][0]:+.1f}, {100 * p['interval'][1]:+.1f}]")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="record folders (bench/results/verdict-testbed-llada, ...)")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--resamples", type=int, default=2000,
                   help="bootstrap resamples (default 2000: a two-sided p-value reaches 0.001, under Holm's 0.10 / 16)")
    p.add_argument("--learned", default="shipped", choices=["shipped", "paper", "gate", "held-threshold"],
                   help="the curve judged: TraceLock's shipped rule (default), the paper's, the fitted gate, or the "
                        "held threshold alone against the published envelope (the hold's share)")
    p.add_argument("--knobs", nargs=2, type=float, metavar=("LO", "HI"),
                   help="judge only the points of the learned curve whose knob (theta) lies in [LO, HI]")
    args = p.parse_args(argv)
    result = analyse(args.folders, resamples=args.resamples, learned=args.learned,
                     knobs=tuple(args.knobs) if args.knobs else None)
    if args.out:
        from tracelock.atomic import atomic_write_json

        atomic_write_json(args.out, result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
