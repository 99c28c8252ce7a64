"""``tracelock report RUN_DIR``: the paper's diagnostics of a `tracelock eval` run as PNG plots and a markdown report.

Reads the run folder `tracelock eval` writes (``manifest.json``, ``summary.json`` and per setting and policy
``runs/<setting>/<policy>/traces``, the item files for correctness, and for TraceLock policies
``controller_steps*.safetensors``, `tracelock.eval.diagnostics.write_controller_steps`'s files) and writes to
``--out`` (default ``RUN_DIR/report``):

- ``report.md``: the summary table (metric / average steps per policy and setting, as the paper's tables), the
  divergence tables and every figure below;
- ``acceptance.png``: cumulative acceptance per policy, a panel per setting;
- ``divergence-<A>-vs-<B>.png``: divergence curves of each compared pair (``--pair``, or the first policy against
  each other one), a line per setting;
- ``score-confidence.png`` and ``threshold.png`` when controller-step files exist;
- ``grid-<setting>-<k>.png``: ``--items`` trace grids of the first pair in the first setting, items where the two
  policies' correctness differs first.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tracelock.atomic import atomic_write_bytes, atomic_write_text

EVAL_HINT = "run `tracelock eval --model ... --tasks ... --out RUN_DIR` first"
# one file per policy folder, or several (per rank or batch: ``controller_steps-rank0.safetensors``), joined
CONTROLLER_STEPS, CONTROLLER_STEPS_GLOB = "controller_steps.safetensors", "controller_steps*.safetensors"


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"RUN_DIR: {path} is not valid JSON ({err}); it is written atomically by `tracelock eval`, "
                         f"so it was edited or damaged: re-run the evaluation to rewrite the {what}") from None


def load_run(run_dir) -> tuple[dict, list]:
    """(manifest, summary rows) of a `tracelock eval` run folder, checked; errors name RUN_DIR and the fix."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"RUN_DIR {run} is not a folder; {EVAL_HINT}")
    for name in ("manifest.json", "summary.json"):
        if not (run / name).is_file():
            raise FileNotFoundError(f"RUN_DIR {run} has no {name}: not a `tracelock eval` run folder, or its run "
                                    f"has not finished; {EVAL_HINT} (re-running the same command resumes)")
    manifest = _read_json(run / "manifest.json", "manifest")
    for key, fields in (("policies", ("label", "slug", "name")), ("settings", ("label", "slug", "gen_length"))):
        entries = manifest.get(key)
        if not isinstance(entries, list) or not entries or not all(
                isinstance(e, dict) and all(f in e for f in fields) for e in entries):
            raise ValueError(f"RUN_DIR: {run / 'manifest.json'} needs a non-empty {key!r} list of objects with "
                             f"{', '.join(fields)}; {EVAL_HINT}")
    rows = _read_json(run / "summary.json", "summary").get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"setting", "policy"} <= set(r) for r in rows):
        raise ValueError(f"RUN_DIR: {run / 'summary.json'} needs a 'rows' list of objects with setting and policy; "
                         f"{EVAL_HINT}")
    return manifest, rows


def _pairs(policies: list, pair: str | None) -> list:
    """[(policy A, policy B)]: the ``--pair`` labels, or the first policy against each other one."""
    if pair is None:
        return [(policies[0], p) for p in policies[1:]]
    by_label = {p["label"]: p for p in policies}
    labels = [s.strip() for s in pair.split(",")]
    if len(labels) != 2 or any(label not in by_label for label in labels) or labels[0] == labels[1]:
        raise ValueError(f"--pair {pair!r} must be two different policy labels of the run separated by a comma; "
                         f"the run's labels are: {', '.join(repr(p['label']) for p in policies)}")
    return [(by_label[labels[0]], by_label[labels[1]])]


def captioned_summary_table(manifest: dict, rows: list) -> str:
    """The report's summary: a caption naming the metric, then the paper-style table as markdown
    (`tracelock.eval.runner.summary_table`: a row per setting, a column per policy, cells "metric / avg steps")."""
    from tracelock.eval.runner import summary_table

    name = next((r["metric_name"] for r in rows if r.get("metric_name")), "metric")
    unit = "" if "rank" in name else " (%)"
    settings, policies = [s["label"] for s in manifest["settings"]], [p["label"] for p in manifest["policies"]]
    return f"Cells: {name}{unit} / average steps per item.\n\n" + summary_table(rows, settings, policies)


def _divergence_table(div) -> str:
    lines = ["| step | mask sym. diff (%) | mask Jaccard (%) | common-token diff (%) | committed Jaccard (%) |",
             "|---|---|---|---|---|"]
    for k, s in enumerate(div.step):
        vals = [100 * getattr(div, m)[k] for m in div.METRICS]
        lines.append(f"| {s} | " + " | ".join("n/a" if v != v else f"{v:.1f}" for v in vals) + " |")
    return "\n".join(lines)


class _Run:
    """The run folder's traces and controller steps, loaded once each."""

    def __init__(self, run_dir: Path, manifest: dict):
        self.dir, self.manifest, self.notes = run_dir, manifest, []
        self._traces = {}

    def folder(self, setting: dict, policy: dict) -> Path:
        return self.dir / "runs" / setting["slug"] / policy["slug"]

    def traces(self, setting: dict, policy: dict):
        from tracelock.traces.store import iter_traces

        key = (setting["slug"], policy["slug"])
        if key not in self._traces:
            store = self.folder(setting, policy) / "traces"
            if (store / "index.json").is_file():
                # the diagnostics read commit steps and final tokens only: drop the per-step proposals and
                # confidences, [S, G] each (about 30 MB per 300 items at G = 128), while every store is held
                self._traces[key] = [replace(t, steps=t.steps[:0], proposals=t.proposals[:0], confidence=None)
                                     for t in iter_traces(store)]
            else:
                self._traces[key] = None
                self.notes.append(f"no trace store at `{store}`: {policy['label']} at {setting['label']} is left "
                                  "out of the trace diagnostics")
        return self._traces[key]


def write_report(run_dir, out=None, *, pair: str | None = None, every: int = 16, items: int = 3,
                 grid_every: int = 1) -> Path:
    """Write the plots and ``report.md`` of a `tracelock eval` run folder; returns the report's path.

    Args:
        run_dir (str | Path): the run folder (RUN_DIR).
        out (str | Path, optional): output folder. Default: ``RUN_DIR/report``.
        pair (str, optional): ``"label A,label B"``, the pair to compare. Default: the first policy against each
            other one.
        every (int): divergence probe interval in steps (the paper: 16). Default: 16.
        items (int): trace grids to draw. Default: 3.
        grid_every (int): a trace-grid column every this many steps. Default: 1 (every step).
    """
    _check_report_options(every, grid_every, items)
    run_dir = Path(run_dir)
    manifest, rows = load_run(run_dir)
    pairs = _pairs(manifest["policies"], pair)
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    run, settings = _Run(run_dir, manifest), manifest["settings"]

    def save(name: str, png: bytes, caption: str) -> str:
        atomic_write_bytes(out / name, png)
        return f"![{caption}]({name})"

    md = _header(run_dir, manifest) + ["## Summary", "", captioned_summary_table(manifest, rows), ""]
    md += _acceptance(run, settings, save)
    md += _divergences(run, pairs, settings, every, save)
    md += _controller_plots(run, settings, save)
    md += _grids(run, pairs, settings, items, grid_every, save)
    if run.notes:
        md += ["## Notes", ""] + [f"- {n}" for n in run.notes] + [""]
    atomic_write_text(out / "report.md", "\n".join(md))
    return out / "report.md"


def _check_report_options(every, grid_every, items) -> None:
    for name, value in (("every", every), ("grid_every", grid_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a positive int (steps)")
    if isinstance(items, bool) or not isinstance(items, int) or items < 0:
        raise ValueError(f"--items={items!r} must be a non-negative int (trace grids to draw)")


def _header(run_dir: Path, manifest: dict) -> list:
    """Markdown lines: the title, the run's facts, and the uncontained-code warning when the run opted in."""
    title = f"# Report: {manifest.get('task', '?')} on {manifest.get('model', '?')}"
    facts = ", ".join(f"{k} {manifest[k]}" for k in ("n", "seed", "controller") if manifest.get(k) is not None)
    md = [title, "", f"Run folder `{run_dir}`" + (f"; {facts}." if facts else "."), ""]
    if (manifest.get("sandbox") or {}).get("opt_in"):  # said where nobody can miss it
        md += ["**The generated code of this run ran without containment**, on the explicit opt-in "
               "(`--allow-uncontained-code` / `TRACELOCK_ALLOW_UNCONTAINED_CODE=1`): it could read and write what "
               "its user may; its items are marked `uncontained_code` in the per-item records.", ""]
    return md


def _acceptance(run: _Run, settings: list, save) -> list:
    """Markdown lines with the cumulative-acceptance figure (a panel per setting), when any policy has traces."""
    from tracelock.eval import diagnostics as dx
    from tracelock.eval import plots

    curves = {}
    for s in settings:
        per_policy = {p["label"]: dx.cumulative_acceptance(t) for p in run.manifest["policies"]
                      if (t := run.traces(s, p))}
        if per_policy:
            curves[s["label"]] = per_policy
    if not curves:
        return []
    return ["## Cumulative acceptance", "", "Share of generation positions committed after s steps, mean over "
            "items (a finished item counts as fully committed).", "",
            save("acceptance.png", plots.acceptance_figure(curves), "cumulative acceptance"), ""]


def _divergences(run: _Run, pairs: list, settings: list, every: int, save) -> list:
    """Markdown lines with each pair's divergence tables (one per setting) and figure, probed every ``every``
    steps; a pair with no setting where both have traces is left out."""
    from tracelock.eval import diagnostics as dx
    from tracelock.eval import plots

    md = []
    for a, b in pairs:
        per_setting = {s["label"]: dx.divergence_over_items(ta, tb, every) for s in settings
                       if (ta := run.traces(s, a)) and (tb := run.traces(s, b))}
        if not per_setting:
            continue
        md += [f"## Trace divergence: {a['label']} vs {b['label']}", "",
               f"Every {every} steps and at the last step; sym. diff and common-token diff as % of the generation "
               "length, mask Jaccard over the still-masked sets (the paper's columns; n/a once every item is fully "
               "committed), plus the committed sets' Jaccard.", ""]
        for setting, div in per_setting.items():
            md += [f"Setting {setting} ({div.items} items):", "", _divergence_table(div), ""]
        png = plots.divergence_figure(per_setting, f"Trace divergence: {a['label']} vs {b['label']}")
        md += [save(f"divergence-{a['slug']}-vs-{b['slug']}.png", png, "trace divergence"), ""]
    return md


def _controller_plots(run: _Run, settings: list, save) -> list:
    """Markdown lines with the controller score against confidence and the learned threshold over steps, from the
    policies' controller-step files; a TraceLock policy without them gets a note."""
    from tracelock.eval import diagnostics as dx
    from tracelock.eval import plots

    corr, thr = {}, {}
    for s in settings:
        for p in run.manifest["policies"]:
            files = sorted(run.folder(s, p).glob(CONTROLLER_STEPS_GLOB))
            if files:
                steps = dx.ControllerSteps.concat(dx.read_controller_steps(f) for f in files)
                corr.setdefault(s["label"], {})[p["label"]] = dx.score_confidence_correlation(steps)
                thr.setdefault(s["label"], {})[p["label"]] = dx.threshold_over_steps(steps)
            elif p["name"] == "tracelock":
                run.notes.append(f"no `{CONTROLLER_STEPS}` for {p['label']} at {s['label']}: its controller "
                                 "plots are left out")
    if not corr:
        return []
    return ["## Controller score vs confidence, and the learned threshold", "",
            "Per step, over the active slots of every row decoded at that step.", "",
            save("score-confidence.png", plots.correlation_figure(corr), "confidence vs controller score"), "",
            save("threshold.png", plots.threshold_figure(thr), "learned threshold over steps"), ""]


def _grids(run: _Run, pairs: list, settings: list, items: int, grid_every: int, save) -> list:
    """Markdown lines with ``items`` trace grids of the first pair in the first setting that has both traces."""
    from tracelock.eval import diagnostics as dx
    from tracelock.eval import plots
    from tracelock.eval.items import folder_items

    if not pairs or items == 0:
        return []
    a, b = pairs[0]
    for s in settings:
        ta, tb = run.traces(s, a), run.traces(s, b)
        if not ta or not tb:
            continue
        matched = dx.pair_traces(ta, tb)
        ca, cb = ({i: rec["correct"] for i, rec in folder_items(run.folder(s, p)).items()} for p in (a, b))
        # the informative items first: where one policy got it right and the other did not
        order = sorted(range(len(matched)), key=lambda i: ca.get(matched[i][0].meta["id"]) ==
                       cb.get(matched[i][0].meta["id"]))
        md = [f"## Trace grids: {a['label']} vs {b['label']}, setting {s['label']}", "",
              "Generation positions down, steps across: green = same token committed in both, red = different "
              "tokens or committed in one only, grey = masked in both.", ""]
        for k, i in enumerate(order[:items]):
            x, y = matched[i]
            item = x.meta["id"]
            title = (f"item {item}, setting {s['label']}\n{a['label']} ({x.num_steps} steps, correct={ca.get(item)})"
                     f" vs {b['label']} ({y.num_steps} steps, correct={cb.get(item)})")
            steps, grid = dx.trace_grid(x, y, grid_every)
            md += [save(f"grid-{s['slug']}-{k}.png", plots.grid_figure(steps, grid, title), f"trace grid {item}"),
                   ""]
        return md
    return []


def _report(args):
    from tracelock.extras import require_extra

    require_extra("report", "report", "draws its plots")
    path = write_report(args.run_dir, args.out, pair=args.pair, every=args.every, items=args.items,
                        grid_every=args.grid_every)
    print(f"wrote {path} and its plots")


def add_parsers(sub) -> None:
    p = sub.add_parser("report", help="diagnostics plots and a markdown report of a `tracelock eval` run folder")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the folder `tracelock eval --out` wrote")
    p.add_argument("--out", help="output folder (default: RUN_DIR/report)")
    p.add_argument("--pair", help='two policy labels to compare, "label A,label B" (default: the first policy '
                                  "against each other one)")
    from tracelock.cli_values import bounded_int, positive_int

    p.add_argument("--every", type=positive_int, default=16, help="divergence probe interval in steps (default 16)")
    p.add_argument("--items", type=bounded_int(100, "a plot each"), default=3, help="trace grids to draw (default 3)")
    p.add_argument("--grid-every", type=positive_int, default=1, help="a trace-grid column every N steps (default 1)")
    p.set_defaults(func=_report)
