"""Where the rules since Fast-dLLM lead (validation split): CreditDecoding (``credit``), dInfer's hierarchy rule
(``hierarchy``), KLASS (``klass``), LESS (``less``), the entropy bound (``eb``) and PC-Sampler (``pc``), each traced
along its knob, against the package's strongest training-free rules (Fast-dLLM's threshold, Fast-dLLM++'s Fréchet
rule and the family's one-per-step rule at 1, 2 and 4 tokens per step, each plain and with the end-of-text hold; on
the Dream family Fast-dLLM's and Fast-dLLM++'s two forms, as the verdict read them), at matched steps.

    OMP_NUM_THREADS=1 python bench/studies/rules_since.py run --cells llada:math:64/16 --n 200 --work DIR
    python bench/studies/rules_since.py read            # the summary, from the committed records

``run`` decodes each cell (model x task x setting) with `tracelock eval` (``--tasks testbed:T@validation --limit N
--seed 1213 --settings G/W --batch-size 100 --threads 1``: the same N validation items for every policy of a cell;
resumable) and writes its per-item records, compacted, to
``bench/results/rules-since-validation/<family>-<task>-<G>-<W>.json`` (atomically, once every point is in). Where
that file exists, only the points its grid gained since are decoded and merged into it (same items, same seed).
``read`` judges each cell from those records (`tracelock.eval.matched`): every new rule's gap at matched steps
against the existing rules' envelope (at each step budget the best existing curve) and against every other new
rule, with its 90% paired bootstrap interval, and the cell's leader: the curve with the highest step-function
accuracy averaged over the step range every curve covers, with its interval against the runner-up. It writes
``bench/results/rules-since-validation/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tracelock.eval.matched import Curve, _best_at_or_below, _envelope, _interval, gap_at_matched_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "rules-since-validation"
SEED = 1213  # the item draw (and the sampling seed: every rule here is deterministic)
NEW = ("credit", "hierarchy", "klass", "less", "eb", "pc")
FAMILIES = {"llada": dict(model="testbed", score=""),
            "dream": dict(model="testbed-dream", score=":score=neg_entropy")}
RESAMPLES = 1000


def _list(name: str, key: str, values) -> list:
    return [f"{name}:{key}={v}" for v in values]


def specs(family: str, gen: int) -> dict:
    """{curve: [policy spec]} of a cell: the new rules along their knobs (plain, then held), then the existing rules
    (plain and held;
    on the Dream family Fast-dLLM's and Fast-dLLM++'s LLaDA and Dream forms, the one-per-step rule on neg-entropy).
    The new rules run in the family's form: on the Dream family with ``first_token=true`` (KLASS: its Dream code,
    ``form=dream``). The grids were set from 20 validation items (seed 99) of LLaDA math 64/16 and Dream code 64/32:
    KLASS's and LESS's confidence bars and the hierarchy rule's ``low`` move the steps little (a few steps of 30-45
    at 64 tokens), the threshold beside the runs (``tau``, at dInfer's ``low`` 0.4) and the entropy budget a lot."""
    dream = family == "dream"
    ft = ":first_token=true" if dream else ""
    steps = [s for s in (gen // 4, gen * 5 // 16, gen * 3 // 8, gen // 2, gen * 5 // 8)]  # 16, 20, 24, 32, 40 at 64
    out = {
        "credit": [f"credit:tau={t}{ft}" for t in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)],
        "hierarchy": [f"hierarchy:low={x}{ft}" for x in (0.2, 0.95)]
        + [f"hierarchy:tau={t}:low=0.4{ft}" for t in (0.5, 0.7, 0.9, 0.99)],
        "klass": [f"klass:tau={t}:kl=0.01{':form=dream' if dream else ''}{ft}" for t in (0.3, 0.5, 0.7, 0.9, 0.95)],
        "less": [f"less:tau={t}{ft}" for t in (0.3, 0.5, 0.7, 0.9, 0.95)],
        "eb": [f"eb:gamma={g}{ft}" for g in (0.001, 0.01, 0.1, 0.3, 1.0, 3.0)],
        "pc": [f"pc:background={FAMILIES[family]['model']}:steps={k}{ft}" for k in steps],
    }
    # each new rule also with the end-of-text hold, as the existing rules run (worth up to 31 points on Dream code)
    out.update({f"{rule}-hold-end": [f"{spec}:hold_end=true" for spec in out[rule]] for rule in NEW})
    score = FAMILIES[family]["score"]
    for hold in ("", ":hold_end=true"):
        name = "-hold-end" if hold else ""
        for form in (("", ":first_token=true") if dream else ("",)):
            fname = "-first-token" if form else ""
            out[f"threshold{fname}{name}"] = [f"threshold:tau={t}{form}{hold}"
                                              for t in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)]
            out[f"frechet{fname}{name}"] = [f"frechet:delta={d}{form}{hold}" for d in (0.0, 0.5, 0.7, 0.9, 0.95)]
        out[f"confidence{name}"] = [f"confidence:per_step={k}{score}{hold}" for k in (2, 4, 8)]
    return out


def _eval(argv: list) -> int:
    """`tracelock eval`, in this process."""
    from tracelock.cli import main

    return main(["eval", *argv]) or 0


def _cell_name(family: str, task: str, setting: str) -> str:
    return f"{family}-{task}-{setting.replace('/', '-')}"


def _child_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cells: list, n: int, work: Path, only: list | None = None, results: Path = RESULTS) -> None:
    from tracelock.atomic import atomic_write_json
    from tracelock.eval.items import compact_records, folder_items
    from tracelock.eval.runner import parse_policies

    for family, task, setting in cells:
        gen = int(setting.split("/")[0])
        curves = specs(family, gen)
        ids, committed = _committed(results / f"{_cell_name(family, task, setting)}.json", n) if only is None else (
            None, {})
        wanted = [s for c, ss in curves.items() if only is None or c in only for s in ss
                  if f"{c}/{parse_policies(s)[0].slug}" not in committed]
        folder = work / _cell_name(family, task, setting)
        cmd = [sys.executable, str(Path(__file__).resolve()), "eval", "--model", FAMILIES[family]["model"],
               "--tasks", f"testbed:{task}@validation", "--limit", str(n), "--seed", str(SEED), "--settings", setting,
               "--batch-size", "100", "--threads", "1", "--workers", "1", "--quiet", "--out", str(folder),
               "--policies", ",".join(wanted)]
        start, cpu = time.time(), _child_cpu()
        print(f"[{time.strftime('%H:%M:%S')}] {_cell_name(family, task, setting)}: {len(wanted)} points to decode "
              f"({len(committed)} committed), n={n}", flush=True)
        if wanted:
            subprocess.run(cmd, check=True)
        wall, cpu = time.time() - start, _child_cpu() - cpu
        print(f"[{time.strftime('%H:%M:%S')}] {_cell_name(family, task, setting)} decoded: {wall:.0f} s wall, "
              f"{cpu:.0f} s CPU", flush=True)
        if only is not None:
            continue
        slug = setting.replace("/", "-")
        per_point = {}
        for curve, ss in curves.items():
            for spec in ss:
                policy = parse_policies(spec)[0]
                if f"{curve}/{policy.slug}" in committed:
                    continue
                got = folder_items(folder / "runs" / slug / policy.slug)
                if len(got) != n:
                    raise SystemExit(f"{spec}: {len(got)} of {n} items decoded")
                per_point[f"{curve}/{policy.slug}"] = got
        rec = _merge(ids, committed, compact_records(per_point) if per_point else None, curves)
        rec = dict(what=f"{family} {task} {setting}, validation split, {n} items drawn with seed {SEED}",
                   model=FAMILIES[family]["model"], task=f"testbed:{task}@validation", setting=setting, n=n,
                   seed=SEED, specs=curves, **rec)
        rec["ids"] = rec.pop("ids")  # the ids after the description
        rec["points"] = rec.pop("points")
        results.mkdir(parents=True, exist_ok=True)
        atomic_write_json(results / f"{_cell_name(family, task, setting)}.json", rec)
        print(f"wrote {results / (_cell_name(family, task, setting) + '.json')}", flush=True)


def _committed(path: Path, n: int) -> tuple:
    """(ids, {label: compact record}) of a cell's committed records, to decode only the points a grid gained since;
    (None, {}) where there is none. A record of another item count is refused."""
    if not path.exists():
        return None, {}
    rec = json.loads(path.read_text())
    if rec["n"] != n:
        raise SystemExit(f"{path} holds n={rec['n']}, not --n {n}: pass --n {rec['n']} or another --results")
    return rec["ids"], rec["points"]


def _merge(ids: list | None, committed: dict, fresh: dict | None, curves: dict) -> dict:
    """One compact record of the committed points (over ``ids``, the items every one of them holds) and the freshly
    decoded ones, in the specs' order; a fresh point must hold each committed item (the same draw)."""
    from tracelock.eval.runner import parse_policies

    points = dict(committed)
    if fresh is not None:
        if ids is not None and not set(ids) <= set(fresh["ids"]):
            raise SystemExit("the fresh points miss items of the committed ones: a different draw")
        keep = fresh["ids"] if ids is None else ids
        at = {i: k for k, i in enumerate(fresh["ids"])}
        for label, p in fresh["points"].items():
            points[label] = dict(correct="".join(p["correct"][at[i]] for i in keep),
                                 steps=[p["steps"][at[i]] for i in keep])
        ids = keep
    order = [f"{c}/{parse_policies(s)[0].slug}" for c, ss in curves.items() for s in ss]
    return dict(ids=ids, points={label: points[label] for label in order if label in points})


def kind_of(curve: str) -> str:
    """"new" for a rule since Fast-dLLM, "existing" for the package's earlier training-free rules."""
    return "new" if curve.split("-")[0] in NEW else "existing"


def load_cell(path: Path) -> dict:
    """A cell's records as {curve: `Curve`} (points in step order) with its ids and name."""
    rec = json.loads(Path(path).read_text())
    curves = {}
    for curve in rec["specs"]:
        labels = [lb for lb in rec["points"] if lb.split("/", 1)[0] == curve]
        if not labels:
            continue
        correct = [[c == "1" for c in rec["points"][lb]["correct"]] for lb in labels]
        steps = [rec["points"][lb]["steps"] for lb in labels]
        curves[curve] = Curve(curve, correct, steps, [lb.split("/", 1)[1] for lb in labels])
    return dict(name=f"{rec['setting']}", rec=rec, curves=curves)


class Fixed(Curve):
    """A curve given by its points' (mean steps, accuracy) alone: one resample of a `Curve`."""

    def __init__(self, name, steps, acc, labels):
        super().__init__(name, np.asarray(acc)[:, None], np.asarray(steps)[:, None], labels)
        self._points = (np.asarray(steps, dtype=np.float64), np.asarray(acc, dtype=np.float64))

    def points(self, weights=None):
        return self._points


def mean_accuracy(curve, lo: float, hi: float) -> float:
    """The curve's step-function accuracy (`tracelock.eval.matched`: the best of its points at or below s steps)
    averaged over s in [lo, hi] (exact; its value at lo when lo == hi)."""
    steps, acc = curve.points()
    if hi <= lo:
        return float(_best_at_or_below(steps, acc, np.array([lo]))[0])
    cuts = np.unique(np.concatenate([steps[(steps > lo) & (steps < hi)], [lo, hi]]))
    return float((_best_at_or_below(steps, acc, cuts[:-1]) * np.diff(cuts)).sum() / (hi - lo))


def common_range(curves: dict) -> tuple:
    """The step range every curve covers: from the dearest of the curves' cheapest points to the cheapest dearest
    point above it. A curve whose dearest point lies below that start is read at its best there (the step function:
    the best of its points at or below s steps); where every curve ends below it, the range is that one budget."""
    means = [c.points()[0] for c in curves.values()]
    lo = max(m.min() for m in means)
    above = [m.max() for m in means if m.max() > lo]
    return lo, min(above) if above else lo


def _draws(curves: dict, resamples: int, seed: int) -> list:
    """``resamples`` paired resamples of the items (one multinomial draw each, shared by every curve), each as
    {curve: its points' means on that resample} (`Fixed` curves, for matched.py's functions)."""
    n = next(iter(curves.values())).n_items
    rng = np.random.default_rng(seed)
    weights = np.stack([rng.multinomial(n, np.full(n, 1 / n)) for _ in range(resamples)]).astype(np.float64)
    means = {name: (weights @ c.steps.T / n, weights @ c.correct.T / n) for name, c in curves.items()}
    return [{name: Fixed(name, s[r], a[r], curves[name].labels) for name, (s, a) in means.items()}
            for r in range(resamples)]


def gap_past_the_end(policy, others: list) -> float | None:
    """For a curve that starts where every other has ended (no range in common, so `gap_at_matched_steps` has no
    answer): the mean over the curve's own step range of its acc(s) minus the others' envelope read as the step
    function does past their dearest points (their best at or below s steps). None where the envelope starts above
    the curve's cheapest point."""
    steps, acc = policy.points()
    lo, hi = steps.min(), steps.max()
    if min(c.points()[0].min() for c in others) > lo:
        return None
    if hi == lo:
        s = np.array([lo])
        return float((_best_at_or_below(steps, acc, s) - _envelope(others, s))[0])
    cuts = np.unique(np.concatenate([steps, *(c.points()[0] for c in others), [lo, hi]]))
    cuts = cuts[(cuts >= lo) & (cuts <= hi)]
    left = cuts[:-1]
    diff = _best_at_or_below(steps, acc, left) - _envelope(others, left)
    return float((diff * np.diff(cuts)).sum() / (hi - lo))


def _measure(curves: dict, leader: str, runner_up: str, past: tuple = ()) -> dict:
    """Every statistic of a cell on one (possibly resampled) set of curves; ``past``: the comparisons (``("envelope",
    rule)`` or a pair of rules) also read by `gap_past_the_end`, having no step range in common."""
    # the existing rules' envelope as one curve of all their points: at every s the best of them at or below s is
    # the best of the curves' own step functions, so every gap below is the one against the curves themselves
    points = [curves[name].points() for name in curves if kind_of(name) == "existing"]
    existing = [Fixed("existing", np.concatenate([s for s, _ in points]), np.concatenate([a for _, a in points]),
                      [str(i) for i in range(sum(len(s) for s, _ in points))])]
    new = [name for name in curves if kind_of(name) == "new"]
    out = {}
    for i, a in enumerate(new):
        out[("envelope", a)] = gap_at_matched_steps(curves[a], existing)
        if ("envelope", a) in past:
            out[("past", "envelope", a)] = gap_past_the_end(curves[a], existing)
        for b in new[i + 1:]:
            out[(a, b)] = gap_at_matched_steps(curves[a], [curves[b]])
            if (a, b) in past:  # the dearer one read past the other's end; the cheaper one gets its sign turned
                if curves[a].points()[0].min() >= curves[b].points()[0].max():
                    out[("past", a, b)] = gap_past_the_end(curves[a], [curves[b]])
                else:
                    out[("past", a, b)] = _signed(gap_past_the_end(curves[b], [curves[a]]), -1)
    lo, hi = common_range(curves)
    out["margin"] = mean_accuracy(curves[leader], lo, hi) - mean_accuracy(curves[runner_up], lo, hi)
    return out


def _verdict(interval) -> str:
    lo, hi = interval
    if lo is not None and lo > 0:
        return "win"
    if hi is not None and hi < 0:
        return "loss"
    return "tie"


def _signed(value, sign: int):
    return None if value is None else sign * value


def _stat(value, draws) -> dict:
    interval = _interval(draws)
    return dict(gap=value, interval=list(interval), verdict=None if value is None else _verdict(interval))


def analyse_cell(path: Path, *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """One cell's reading (see the module docstring); the item resample is shared by every comparison."""
    cell = load_cell(path)
    curves, rec = cell["curves"], cell["rec"]
    lo, hi = common_range(curves)
    means = {name: mean_accuracy(c, lo, hi) for name, c in curves.items()}
    ranked = sorted(means, key=lambda name: -means[name])
    leader, runner_up = ranked[0], ranked[1]
    best_existing = next(name for name in ranked if kind_of(name) == "existing")
    point = _measure(curves, leader, runner_up)
    past = tuple(key for key, value in point.items() if isinstance(key, tuple) and value is None)
    point = _measure(curves, leader, runner_up, past)
    n = len(rec["ids"])
    draws = [_measure(d, leader, runner_up, past) for d in _draws(curves, resamples, seed)]
    new = [name for name in curves if kind_of(name) == "new"]
    rules = {}
    for a in new:
        vs_new = {}
        for b in new:
            if a == b:
                continue
            key, sign = ((a, b), 1) if (a, b) in point else ((b, a), -1)
            vs_new[b] = _stat(_signed(point[key], sign), [_signed(d[key], sign) for d in draws])
            if key in past:  # no step range in common: the dearer one read past the other's end
                vs_new[b]["past_the_end"] = _stat(_signed(point[("past", *key)], sign),
                                                  [_signed(d[("past", *key)], sign) for d in draws])
        rules[a] = dict(vs_existing=_stat(point[("envelope", a)], [d[("envelope", a)] for d in draws]),
                        mean_accuracy=means[a], vs_new=vs_new)
        if ("envelope", a) in past:  # no step range in common with the existing rules: read past their end
            rules[a]["vs_existing_past_their_end"] = _stat(point[("past", "envelope", a)],
                                                           [d[("past", "envelope", a)] for d in draws])
    margin = _stat(point["margin"], [d["margin"] for d in draws])
    return dict(
        model=rec["model"], task=rec["task"], setting=rec["setting"], n=n, seed=rec["seed"],
        curves={name: dict(kind=kind_of(name), points=[[lb, round(float(s), 3), round(float(a), 4)] for lb, s, a in
                                                      zip(c.labels, *c.points())])
                for name, c in curves.items()},
        common_range=[round(float(lo), 3), round(float(hi), 3)],
        mean_accuracy={name: means[name] for name in ranked},
        leader=dict(curve=leader, kind=kind_of(leader), runner_up=runner_up, margin=margin["gap"],
                    interval=margin["interval"], verdict="leads" if margin["verdict"] == "win" else "tie"),
        best_existing=best_existing, new=rules)


CELL = re.compile(r"(llada|dream)-(math|code)-(\d+)-(\d+)\.json")


def read(folder: Path = RESULTS, *, resamples: int = RESAMPLES, out: Path | None = None) -> dict:
    """The summary of every cell's records in ``folder`` (written to ``out`` when given)."""
    from tracelock.atomic import atomic_write_json

    cells = {}
    order = {"llada": 0, "dream": 1, "math": 0, "code": 1}
    files = sorted((f for f in Path(folder).glob("*.json") if CELL.fullmatch(f.name)),
                   key=lambda f: (order[CELL.fullmatch(f.name)[1]], int(CELL.fullmatch(f.name)[3]),
                                  int(CELL.fullmatch(f.name)[4]), order[CELL.fullmatch(f.name)[2]]))
    for f in files:
        family, task, g, w = CELL.fullmatch(f.name).groups()
        cells[f"{family} {task} {g}/{w}"] = analyse_cell(f, resamples=resamples)
    result = dict(what="the rules since Fast-dLLM against the existing training-free rules, validation split: gap at "
                       "matched steps (accuracy, 0-1) with 90% paired bootstrap intervals",
                  resamples=resamples, seed=SEED, cells=cells)
    if out is not None:
        atomic_write_json(out, result)
    return result


def _pts(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}"


def _cell_text(x) -> str:
    lo, hi = x["interval"]
    return f"{_pts(x['gap'])} [{_pts(lo)}, {_pts(hi)}]"


def format_summary(result: dict) -> str:
    lines = []
    for name, cell in result["cells"].items():
        lead = cell["leader"]
        lo, hi = cell["common_range"]
        lines += [f"## {name} (n={cell['n']}; common range {lo:.1f}-{hi:.1f} steps)", "",
                  f"leader: {lead['curve']} ({100 * cell['mean_accuracy'][lead['curve']]:.1f}%), runner-up "
                  f"{lead['runner_up']} ({100 * cell['mean_accuracy'][lead['runner_up']]:.1f}%): margin "
                  f"{_cell_text(dict(gap=lead['margin'], interval=lead['interval']))}: {lead['verdict']}",
                  f"best existing: {cell['best_existing']} ({100 * cell['mean_accuracy'][cell['best_existing']]:.1f}%)",
                  "", "| rule | mean acc | vs existing envelope | " + " | ".join(cell["new"]) + " |",
                  "|---|---|---|" + "---|" * len(cell["new"])]
        for rule, r in cell["new"].items():
            row = ["" if b not in r["vs_new"] else _cell_text(r["vs_new"][b]) if "past_the_end" not in r["vs_new"][b]
                   else f"{_cell_text(r['vs_new'][b]['past_the_end'])} (past)" for b in cell["new"]]
            x = r.get("vs_existing_past_their_end", r["vs_existing"])
            note = " (past their end)" if "vs_existing_past_their_end" in r else ""
            lines.append(f"| {rule} | {100 * r['mean_accuracy']:.1f}% | {_cell_text(x)} {x['verdict']}{note} | "
                         + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


NAMES = {"llada": "LLaDA", "dream": "Dream"}


def format_docs(result: dict) -> str:
    """docs/frontier.md's tables: per cell the leader at matched steps and each new rule against the existing
    rules' envelope."""
    lines = []
    for name, cell in result["cells"].items():
        family, task, setting = name.split()
        lead, lo_hi = cell["leader"], cell["common_range"]
        acc = cell["mean_accuracy"]
        margin = _cell_text(dict(gap=lead["margin"], interval=lead["interval"]))
        lines += [f"**{NAMES[family]} {task} {setting}** (common range {lo_hi[0]:.1f}-{lo_hi[1]:.1f} steps): leader "
                  f"`{lead['curve']}` ({100 * acc[lead['curve']]:.1f}%), runner-up `{lead['runner_up']}` "
                  f"({100 * acc[lead['runner_up']]:.1f}%), margin {margin}: "
                  f"{'leads' if lead['verdict'] == 'leads' else 'a tie'}; best existing `{cell['best_existing']}` "
                  f"({100 * acc[cell['best_existing']]:.1f}%).", "",
                  "| rule | its points: steps, accuracy | gap to the existing envelope [90%] | reading |",
                  "|---|---|---|---|"]
        for rule, r in cell["new"].items():
            pts = cell["curves"][rule]["points"]
            steps, accs = [p[1] for p in pts], [p[2] for p in pts]
            x, past = r["vs_existing"], r.get("vs_existing_past_their_end")
            gap = _cell_text(x) if past is None else f"{_cell_text(past)} (past their end)"
            reading = x["verdict"] if past is None else f"{past['verdict']}: dearer than every existing point"
            lines.append(f"| {rule} | {min(steps):.1f}-{max(steps):.1f}, {100 * min(accs):.0f}-{100 * max(accs):.0f}% "
                         f"| {gap} | {reading} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:
        return _eval(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="decode cells and write their records")
    r.add_argument("--cells", required=True, help="FAMILY:TASK:G/W, comma-separated")
    r.add_argument("--n", type=int, required=True)
    r.add_argument("--work", type=Path, required=True, help="the eval run folders")
    r.add_argument("--results", type=Path, default=RESULTS, help="where the records go")
    r.add_argument("--only", help="curves to decode (comma-separated; a timing run: no records written)")
    q = sub.add_parser("read", help="judge the committed records and write the summary")
    q.add_argument("--folder", type=Path, default=RESULTS)
    q.add_argument("--resamples", type=int, default=RESAMPLES)
    q.add_argument("--out", type=Path, help="the summary JSON (default: FOLDER/summary.json)")
    q.add_argument("--docs", action="store_true", help="print docs/frontier.md's tables instead")
    args = p.parse_args(argv)
    if args.command == "read":
        result = read(args.folder, resamples=args.resamples, out=args.out or args.folder / "summary.json")
        print(format_docs(result) if args.docs else format_summary(result))
    elif args.command == "run":
        cells = [tuple(c.split(":")) for c in args.cells.split(",")]
        run(cells, args.n, args.work, args.only.split(",") if args.only else None, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
