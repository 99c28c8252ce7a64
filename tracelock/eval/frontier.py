"""`tracelock frontier`: quality against steps for every policy along its knob, and the steps each needs to keep the
one-token-per-step accuracy.

A sweep is one policy and one knob with several values (``threshold:tau=0.5,0.7,0.9``); every value is a point,
decoded by `tracelock eval` (`tracelock.eval.runner.run_eval`) into ``OUT/<task>/<setting>/``, so a frontier resumes
like `eval` and an eval run folder with the same arguments is reused. The knob ``per_step`` of the schedule rules
(confidence, entropy, ...) is tokens per step, ``steps = gen_length // per_step`` at each setting.

The single number per policy is its **steps at the reference accuracy**: the reference is the model family's own rule
at one token per step (LLaDA: confidence, Dream: entropy), always decoded first; the target is its accuracy minus
``tolerance`` (1 point); a policy's curve is its points in order of mean steps joined by straight lines, and the number
is the fewest mean steps at which that curve reaches the target (`steps_at_accuracy`), or None ("not reached").
"""

from __future__ import annotations

import contextlib
import csv
import inspect
import io
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from tracelock.atomic import atomic_write, atomic_write_json, atomic_write_text
from tracelock.eval.matched import format_matched, matched_from_records
from tracelock.eval.runner import PolicySpec, Setting, check_policies, parse_settings, slug

# the knob each policy is swept along by default, and its default values
DEFAULT_SWEEPS = {
    "confidence": ("per_step", (1, 2, 4, 8)),
    "entropy": ("per_step", (1, 2, 4, 8)),
    "maskgit_plus": ("per_step", (1, 2, 4, 8)),
    "topk_margin": ("per_step", (1, 2, 4, 8)),
    "random": ("per_step", (1, 2, 4)),
    "threshold": ("tau", (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)),
    "factor": ("f", (0.5, 1.0, 2.0, 4.0)),
    "l2p": ("threshold", (0.5, 0.8, 0.9, 0.96, 0.99)),
    # as dense as tau where the curve moves: accuracy at matched steps reads a curve only at its points, so a gap in
    # the grid (theta 0.5 to 0.7 jumped from 8.6 to 20.3 steps) counts against it as if the method could not go there
    "tracelock": ("theta", (0.3, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)),
    # the rules since Fast-dLLM, each at its authors' other defaults: CreditDecoding's threshold (alpha 0.7, gamma
    # 0.2, beta 0.8), KLASS's confidence bar (kl 0.01, history 2), LESS's (drift 0.04, persist 2)
    "credit": ("tau", (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)),
    "klass": ("tau", (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)),
    "less": ("tau", (0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 0.95)),
    # dInfer's hierarchy without a threshold (tau none): a run's best commits above `low`; sweep tau with low fixed
    # as `hierarchy:tau=0.5,0.7,0.9:low=0.4`
    "hierarchy": ("low", (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)),
    # the entropy budget in nats, log-spaced: 0.001 is nearly one token per step, 1.0 several
    "eb": ("gamma", (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)),
    # PC-Sampler runs LLaDA's schedule: tokens per step, as confidence (its background table is a fixed argument:
    # --sweep pc:background=testbed)
    "pc": ("per_step", (1, 2, 4, 8)),
}
# the schedule rules: `per_step` tokens per step is their `steps` argument at each generation length (any rule with
# `steps` also takes it as a fixed argument, e.g. klass:tau=0.7,0.9:per_step=2 for its fallback's schedule)
PER_STEP_POLICIES = ("confidence", "entropy", "maskgit_plus", "topk_margin", "random", "origin", "pc")
# the family's own rule at one token per step (`tracelock.testbed.evaluate.reference_rule`): for Dream the paper's
# native baseline, one token per step by neg-entropy (Dream's `entropy` commits 0, 1, ..., 1, 2 per block)
REFERENCE_RULE = {"llada": ("confidence", {}), "dream": ("confidence", {"score": "neg_entropy"})}
SPLITS = ("test", "validation")


@dataclass
class Sweep:
    name: str
    knob: str
    values: tuple
    fixed: dict  # the policy's other arguments (and the runner's, e.g. cache=dual), the same at every point
    title: str | None = None  # the curve's name (``curve=``), default: the policy and its fixed arguments

    @property
    def curve(self) -> str:
        """The curve's name: ``curve=``, else the policy with the fixed arguments that set it apart."""
        return self.title or self.name + "".join(f":{k}={v}" for k, v in self.fixed.items())

    def label(self, value) -> str:
        """The eval policy label of one point (the curve name keeps two sweeps of one policy apart)."""
        fixed = "".join(f":{k}={v}" for k, v in self.fixed.items())
        return f"{self.name}:{self.knob}={value}{fixed}" + (f":curve={self.title}" if self.title else "")

    def points(self, setting: Setting) -> list[PolicySpec]:
        """One eval policy per knob value, labelled `label`."""
        out = []
        for v in self.values:
            knob = {"steps": setting.gen_length // v} if self.knob == "per_step" else {self.knob: v}
            out.append(PolicySpec(self.label(v), self.name, {**knob, **self.fixed}))
        return out


def _number(text: str, where: str):
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"--sweep {where}: {text!r} is not a number")
    return value


def _value(text: str):
    """A fixed argument: JSON (numbers, true/false) where it parses, None for ``none``, else the text (a path, a name):
    `tracelock.policy_specs.spec_value`, as every command reads a spec's value."""
    from tracelock.policy_specs import spec_value

    return spec_value(text)


def parse_sweep(text: str) -> Sweep:
    """``name[:knob=v1,v2,...][:key=value...][:curve=TITLE]``; a bare ``name`` takes its `DEFAULT_SWEEPS` grid. The
    values of one key are the list grammar of every command (`tracelock.policy_specs.policy_groups`): the points of a
    sweep are what ``--policies name:knob=v1,v2`` runs as policies."""
    from tracelock.policies import POLICIES
    from tracelock.policy_specs import policy_groups
    from tracelock.text import did_you_mean

    try:
        groups = policy_groups(text, option="--sweep", names=tuple(POLICIES))
    except ValueError as err:
        if "lists values of two keys" in str(err):
            raise ValueError(str(err).replace("lists values of two keys", "sweeps two knobs")
                             .replace("list one key per policy", "sweep one knob per --sweep")) from None
        raise
    if len(groups) != 1:
        raise ValueError(f"--sweep {text!r} names {len(groups)} policies ({', '.join(g[0] for g in groups)}); give "
                         "each its own --sweep")
    name, _, pairs, listed, listed_values = groups[0]
    params = inspect.signature(POLICIES[name].__init__).parameters.values()
    accepted = {p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD}
    # the gate passes base_<argument> on to its base rule (which checks them when the sweep's policies are built)
    forwards = any(p.kind is p.VAR_KEYWORD and p.name == "base_args" for p in params)
    if name in PER_STEP_POLICIES or "steps" in accepted:
        accepted.add("per_step")
    accepted |= {"schedule", "cache", "refresh_every", "refresh_shift"}  # the runner's (see runner.RUNNER_KEYS)
    knob, values, fixed, title = None, None, {}, None
    for i, (key, value) in enumerate(pairs):
        if key == "curve":
            title = value
            continue
        if key not in accepted and not (forwards and key.startswith("base_")):
            raise ValueError(f"--sweep {text!r}: {name} has no knob or argument {key!r}; choose from "
                             f"{', '.join(sorted(accepted))}{did_you_mean(key, accepted)}")
        if i == listed:
            knob, values = key, tuple(_number(v, text) for v in listed_values if v.strip())
        else:
            fixed[key] = _value(value)
    if knob is None:
        if name not in DEFAULT_SWEEPS:
            raise ValueError(f"--sweep {text!r}: {name} has no default knob; give one, e.g. {name}:KNOB=v1,v2")
        knob, values = DEFAULT_SWEEPS[name]
        if knob in fixed:  # a single value given for the default knob: that one point
            values = (fixed.pop(knob),)
    if not values:
        raise ValueError(f"--sweep {text!r} sweeps {knob} over no values; give at least one")
    if knob == "per_step" and not all(isinstance(v, int) and v >= 1 for v in values):
        raise ValueError(f"--sweep {text!r}: per_step (tokens per step) takes whole numbers >= 1")
    return Sweep(name, knob, values, fixed, title)


def steps_at_accuracy(points: list, target: float) -> float | None:
    """The fewest mean steps at which the curve through ``points`` [(steps, metric)] reaches ``target``.

    The curve joins the points in order of steps with straight lines; the answer is the first point of it at or above
    ``target`` (interpolated between the two sweep points around the crossing), or None when no point reaches it.
    """
    pts = sorted((s, m) for s, m in points if s is not None and m is not None)
    for i, (s, m) in enumerate(pts):
        if m >= target:
            if i == 0:
                return float(s)
            s0, m0 = pts[i - 1]
            return float(s0 + (target - m0) * (s - s0) / (m - m0))
    return None


def value_at_steps(points: list, steps: float | None) -> float | None:
    """The curve through ``points`` [(steps, value)], joined by straight lines in order of steps, read at ``steps``
    (None for None or outside the points): the seconds per item a policy takes at its steps at the reference."""
    pts = sorted(points)
    if steps is None or not pts or not pts[0][0] <= steps <= pts[-1][0]:
        return None
    for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
        if s0 <= steps <= s1:
            return float(v0 if s1 == s0 else v0 + (steps - s0) * (v1 - v0) / (s1 - s0))
    return float(pts[0][1])


def pareto(points: list) -> list[bool]:
    """For each (steps, metric): no other point has fewer-or-equal steps and a higher-or-equal metric, one strictly."""
    return [not any((s2 <= s and m2 >= m) and (s2 < s or m2 > m) for s2, m2 in points) for s, m in points]


def setting_records(runs: Path, policies: list) -> dict:
    """The compact per-item record of one setting's points: the item ids once, and per point label a string of
    0/1 (correct) and the list of steps, in id order, so any two points pair item by item."""
    from tracelock.eval.items import compact_records, folder_items

    return compact_records({p.label: folder_items(runs / p.slug) for p in policies})


def _family(model_path) -> str:
    from tracelock.models.loading import resolve_path
    from tracelock.models.spec import ModelSpec

    return ModelSpec.from_pretrained(resolve_path(model_path)).family


def reference_sweep(name: str, args: dict) -> Sweep:
    """The one-point sweep of the reference rule (``args``: its fixed arguments; a ``steps`` among them is the
    point's own)."""
    return Sweep(name, "per_step", (1,), {k: v for k, v in args.items() if k != "steps"})


def frontier_points(rows: list, sweeps: list, reference: PolicySpec) -> dict:
    """{policy name: [point]} from eval summary rows (one setting), each point with its knob value, metric, steps,
    seconds per item and Pareto flag (over all points of the setting)."""
    by_label = {r["policy"]: r for r in rows}
    curves = {}
    for sw in [reference_sweep(reference.name, reference.args)] + sweeps:
        for value in sw.values:
            row = by_label.get(sw.label(value))
            if row is None:
                continue
            point = dict(label=sw.label(value), knob=sw.knob, value=value, metric=row["metric"],
                         avg_steps=row["avg_steps"], seconds_per_item=row["seconds_per_item"], n=row["n"])
            curve = curves.setdefault(sw.curve, [])
            if all(p["label"] != point["label"] for p in curve):
                curve.append(point)
    everything = [(p["avg_steps"], p["metric"]) for c in curves.values() for p in c]
    flags = iter(pareto(everything))
    for c in curves.values():
        for p in c:
            p["pareto"] = next(flags)
    return curves


def summarize_setting(rows: list, sweeps: list, reference: PolicySpec, tolerance: float) -> dict:
    curves = frontier_points(rows, sweeps, reference)
    ref_row = next(r for r in rows if r["policy"] == reference.label)
    target = ref_row["metric"] - tolerance
    at_ref = {name: steps_at_accuracy([(p["avg_steps"], p["metric"]) for p in c], target)
              for name, c in curves.items()}
    seconds = {name: value_at_steps([(p["avg_steps"], p["seconds_per_item"]) for p in c], at_ref[name])
               for name, c in curves.items()}
    # where a curve's cheapest point already reaches the target, its true number is that point's steps or fewer
    at_most = {name: at_ref[name] is not None and at_ref[name] == min(p["avg_steps"] for p in c)
               for name, c in curves.items()}
    return dict(reference=dict(policy=reference.label, metric=ref_row["metric"], avg_steps=ref_row["avg_steps"]),
                target=target, curves=curves, steps_at_reference=at_ref, seconds_per_item_at_reference=seconds,
                reached_at_cheapest_point=at_most)


def _csv(result: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["task", "setting", "curve", "label", "knob", "value", "metric", "avg_steps", "seconds_per_item", "n",
                "pareto", "steps_at_reference", "seconds_per_item_at_reference"])
    for task, settings in result["tasks"].items():
        for setting, s in settings.items():
            for name, curve in s["curves"].items():
                for p in curve:
                    w.writerow([task, setting, name, p["label"], p["knob"], p["value"], p["metric"], p["avg_steps"],
                                p["seconds_per_item"], p["n"], p["pareto"], s["steps_at_reference"][name],
                                s["seconds_per_item_at_reference"][name]])
    return buf.getvalue()


def frontier_figure(result: dict) -> bytes:
    """One panel per (task, setting): metric against mean steps, a line per curve, Pareto points ringed, the target
    accuracy dashed."""
    from tracelock.eval.plots import _figure, _png

    panels = [(t, s, d) for t, settings in result["tasks"].items() for s, d in settings.items()]
    # one colour per curve in every panel (cells decoded by calls with their sweeps in another order stay readable)
    colour = {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(n for *_, d in panels for n in d["curves"]))}
    fig, axes = _figure(len(panels), columns=3)
    for ax, (task, setting, d) in zip(axes, panels):
        for name, curve in d["curves"].items():
            pts = sorted((p["avg_steps"], 100 * p["metric"], p["pareto"]) for p in curve)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3.5, label=name, color=colour[name])
            front = [p for p in pts if p[2]]
            ax.scatter([p[0] for p in front], [p[1] for p in front], s=70, facecolors="none",
                       edgecolors=colour[name], linewidths=1.4)
        ax.axhline(100 * d["target"], color="grey", ls="--", lw=0.8)
        ax.set_title(f"{task}, {setting}", fontsize=9)
        ax.set_xlabel("mean steps")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    return _png(fig)


def _machine(device) -> dict:
    """Where the points were decoded, so their seconds per item can be read: CPU, threads, GPU, torch."""
    import os
    import platform

    import torch

    gpu = torch.cuda.get_device_name() if str(device).startswith("cuda") and torch.cuda.is_available() else None
    processor = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):  # Linux names the CPU model here; platform does not
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        processor = names[0] if names else processor
    return dict(processor=processor, cpus=os.cpu_count(),
                torch_threads=torch.get_num_threads(), gpu=gpu, torch=torch.__version__)


def run_frontier(model, tasks: list, settings: list, sweeps: list, out, *, split="test", limit=None, tolerance=0.01,
                 controller=None, l2p=None, batch_size=32, seed=0, schedule="auto", device="cpu", dtype="float32",
                 quantize=None, workers=2, max_step_gap=None, progress=None, command=None) -> dict:
    """Decode every sweep point (and the family's reference rule at one token per step) on each task and setting;
    write ``frontier.json``, ``frontier.csv`` and ``frontier.png`` in ``out`` (with the cells an earlier call left there
    on the same draw of items); return the result. ``quantize`` decodes with quantized weights (`load_model`'s); one
    folder holds one format. ``max_step_gap``: each sweep's knob is then traced further in each cell until its
    consecutive points lie at most that many mean steps apart (`tracelock.eval.dense`)."""
    from tracelock.eval.dense import check_max_gap, largest_gap
    from tracelock.eval.runner import run_eval

    check_max_gap(max_step_gap)
    if split not in SPLITS:
        raise ValueError(f"--split {split!r} does not exist for evaluation; choose from {', '.join(SPLITS)} "
                         "(choose settings on validation, report on test)")
    if not sweeps:
        raise ValueError("the sweep is empty: give at least one --sweep, e.g. --sweep threshold:tau=0.7,0.9")
    if not tasks:
        raise ValueError("--tasks names no task; e.g. --tasks testbed:math,testbed:code")
    family = _family(model)
    ref_name, ref_args = REFERENCE_RULE[family]
    # every point of every setting is checked before the first decodes (a bad value would stop a long run midway)
    for setting in settings:
        check_policies([p for sw in sweeps for p in sw.points(setting)], [setting], schedule, controller=controller,
                       l2p=l2p)
    out = Path(out)
    result = dict(model=str(model), family=family, split=split, limit=limit, seed=seed, tolerance=tolerance,
                  reference_rule=reference_sweep(ref_name, ref_args).curve + ", one token per step", command=command,
                  machine=_machine(device), tasks={})
    if quantize:
        result["quantize"] = quantize
    result["tasks"], records = _earlier_cells(out, result)
    for task in tasks:
        if not task.startswith("testbed:") and split != "test":
            raise ValueError(f"--split {split}: only testbed tasks have a validation split; {task!r} has one set")
        if "@" in task:
            raise ValueError(f"--tasks {task!r}: give the split with --split, not in the task name")
        spec = task if split == "test" else f"{task}@{split}"
        for setting in settings:
            reference = reference_sweep(ref_name, ref_args).points(setting)[0]
            folder = out / slug(task) / setting.slug
            cell = list(sweeps)  # this cell's sweeps: the listed values, and those its holes add
            for _ in range(DENSE_ROUNDS + 1):
                policies = [reference] + [p for sw in cell for p in sw.points(setting) if p.label != reference.label]
                if progress:
                    progress(f"{spec} {setting.label}: {len(policies)} points")
                rows = run_eval(model, spec, policies, [setting], folder, n=limit, seed=seed,
                                batch_size=batch_size, schedule=schedule, controller=controller, l2p=l2p,
                                device=device, dtype=dtype, quantize=quantize, workers=workers, progress=progress)
                denser = cell if max_step_gap is None else [
                    _denser(sw, rows, max_step_gap, setting, schedule, controller=controller, l2p=l2p) for sw in cell]
                if denser == cell:
                    break
                cell = denser
            summary = summarize_setting(rows, cell, reference, tolerance)
            summary["largest_step_gap"] = {name: largest_gap([(p["value"], p["avg_steps"]) for p in c])
                                           for name, c in summary["curves"].items()}
            if max_step_gap is not None:
                summary["max_step_gap"] = max_step_gap
            recs = setting_records(folder / "runs" / setting.slug, policies)
            records.setdefault(task, {})[setting.label] = recs
            summary["matched"] = matched_from_records(recs, summary["curves"], tolerance=tolerance)
            summary["machine"] = result["machine"]  # per cell: one frontier.json can add up calls on other machines
            result["tasks"].setdefault(task, {})[setting.label] = summary
    atomic_write_json(out / "records.json", records)
    atomic_write_json(out / "frontier.json", result)
    atomic_write_text(out / "frontier.csv", _csv(result))
    png = frontier_figure(result)
    atomic_write(out / "frontier.png", lambda p: Path(p).write_bytes(png))
    return result


# rounds of midpoints a hole may take: each halves it (in the knob), so a hole 256 times narrower than the listed
# values' spacing would still be split
DENSE_ROUNDS = 8


def _denser(sweep: Sweep, rows: list, max_gap: float, setting: Setting, schedule: str, **folders) -> Sweep:
    """``sweep`` with a midpoint in each of its holes wider than ``max_gap`` mean steps (itself when none); a value
    the setting refuses (`check_policies`: a schedule's steps that do not divide into its blocks) is not tried."""
    from dataclasses import replace

    from tracelock.eval.dense import geometric, values_to_add

    def valid(value) -> bool:
        try:
            check_policies(replace(sweep, values=(value,)).points(setting), [setting], schedule, **folders)
        except ValueError:
            return False
        return True

    steps = {r["policy"]: r["avg_steps"] for r in rows}
    points = [(v, steps[sweep.label(v)]) for v in sweep.values if sweep.label(v) in steps]
    new = values_to_add(points, max_gap, whole=sweep.knob == "per_step", log=geometric(sweep.values), valid=valid)
    return replace(sweep, values=tuple(sorted((*sweep.values, *new)))) if new else sweep


# what makes an earlier call's cells comparable with this one's: the same items, judged the same way
_SAME_DRAW = ("model", "family", "split", "limit", "seed", "tolerance")


def _earlier_cells(out: Path, result: dict) -> tuple[dict, dict]:
    """The task/setting cells (and their records) an earlier call wrote in ``out`` on the same draw of items, so
    that one setting per call (a long sweep split into runs) adds up to one frontier.json; a cell this call decodes
    again replaces its old one. Anything else in ``out`` (another draw, an older format) is left to be overwritten."""
    try:
        earlier = json.loads((out / "frontier.json").read_text())
        records = json.loads((out / "records.json").read_text())
    except (OSError, ValueError):
        return {}, {}
    if any(earlier.get(k) != result[k] for k in _SAME_DRAW) or earlier.get("quantize") != result.get("quantize"):
        return {}, {}
    cells = earlier.get("tasks", {})
    for task_cells in cells.values():  # cells of a file from before the per-cell machine: the file's machine
        for cell in task_cells.values():
            cell.setdefault("machine", earlier.get("machine"))
    return cells, records


def steps_cell(d: dict, curve: str, seconds_digits: int | None = None) -> str:
    """One curve's steps at the reference in a setting's summary ``d``, as the tables print it: "-" (no such curve),
    "not reached", or the steps, "≤" first when the curve's cheapest point already reaches the target (never for the
    reference rule, its own target), with the seconds per item there when ``seconds_digits`` is given."""
    steps = d["steps_at_reference"].get(curve)
    if curve not in d["curves"]:
        return "-"
    if steps is None:
        return "not reached"
    is_reference = any(p["label"] == d["reference"]["policy"] for p in d["curves"][curve])
    at_most = d["reached_at_cheapest_point"][curve] and not is_reference
    seconds = "" if seconds_digits is None else f" ({d['seconds_per_item_at_reference'][curve]:.{seconds_digits}f} s)"
    return ("≤" if at_most else "") + f"{steps:.1f}" + seconds


def format_summary(result: dict) -> str:
    """The steps-at-reference table: a row per (task, setting), a column per curve."""
    names = list(dict.fromkeys(n for s in result["tasks"].values() for d in s.values() for n in d["curves"]))
    lines = [f"steps at the reference accuracy ({result['reference_rule']} minus "
             f"{100 * result['tolerance']:g} point), {result['split']} split; in brackets seconds per item there; "
             "≤: the curve's cheapest point already reaches it",
             "", "| task | setting | reference | " + " | ".join(names) + " |", "|---" * (len(names) + 3) + "|"]
    for task, settings in result["tasks"].items():
        for setting, d in settings.items():
            ref = d["reference"]
            cells = [steps_cell(d, n, seconds_digits=3) for n in names]
            lines.append(f"| {task} | {setting} | {100 * ref['metric']:.1f}% / {ref['avg_steps']:.1f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run(args) -> int:
    from tracelock.cli_options import split_tasks
    from tracelock.extras import require_extra

    require_extra("report", "frontier", "draws frontier.png")

    sweeps = [parse_sweep(s) for s in args.sweep or []]
    result = run_frontier(args.model, split_tasks(args.tasks),
                          parse_settings(args.settings), sweeps, args.out, split=args.split, limit=args.limit,
                          tolerance=args.tolerance, controller=args.controller, l2p=args.l2p,
                          batch_size=args.batch_size, seed=args.seed, schedule=args.schedule, device=args.device,
                          dtype=args.model_dtype, quantize=args.quantize, workers=args.workers,
                          max_step_gap=args.max_step_gap,
                          progress=lambda what: print(f"  {what}", file=sys.stderr, flush=True),
                          command=shlex.join(["tracelock", *sys.argv[1:]]))
    print(format_summary(result))
    print("\n" + format_matched(result))
    print(f"\nfrontier.json, records.json (per item), frontier.csv and frontier.png in {args.out}")
    return 0


def add_parsers(sub) -> None:
    from tracelock.cli_options import (
        add_allow_uncontained,
        add_batch_size,
        add_device,
        add_limit,
        add_model,
        add_model_dtype,
        add_quantize,
        add_settings,
        option_help,
    )
    from tracelock.cli_values import seed_int, workers_int

    p = sub.add_parser("frontier", help="quality against steps along each policy's knob; steps at the reference "
                                        "accuracy (resumable)")
    add_model(p)
    p.add_argument("--tasks", required=True, help=option_help("--tasks"))
    p.add_argument("--split", default="test", choices=SPLITS,
                   help="held-out split of the testbed tasks (default: test; choose settings on validation)")
    add_limit(p, help="N items of each task drawn at random with --seed (default: all; testbed tasks need it)")
    add_settings(p, default="64/16", schedule_help="auto: tracelock in a sliding window of WIDTH, the others in "
                                                   "blocks of WIDTH; block or window: every policy so")
    p.add_argument("--policies", metavar="SPEC,SPEC",
                   help=option_help("--policies", "each policy with its listed knob values a sweep, the same as one "
                                                  "--sweep per policy (default: the --sweep options)"))
    p.add_argument("--sweep", action="append", metavar="NAME[:KNOB=V1,V2,...][:KEY=VALUE...]",
                   help="a policy and the values of its knob, repeatable, e.g. --sweep threshold:tau=0.7,0.9 "
                        "--sweep confidence:per_step=1,2,4 (the list grammar of --policies: each value a point); "
                        "curve=TITLE names the curve (two sweeps of one policy, e.g. two controllers); a bare name "
                        "takes its default grid: " +
                        "; ".join(f"{n} {k}={','.join(map(str, v))}" for n, (k, v) in DEFAULT_SWEEPS.items()))
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="the reference accuracy is the one-per-step rule's minus this (default: 0.01, one point)")
    p.add_argument("--max-step-gap", type=float, metavar="G",
                   help="trace each knob further, a midpoint at a time, until consecutive points of every curve lie "
                        "at most G mean steps apart in every cell (e.g. 1.5; default: the listed values only)")
    p.add_argument("--controller", help="a `tracelock train --out` folder, for tracelock sweeps (default: none; "
                                         "a sweep may name its own with controller=DIR)")
    p.add_argument("--l2p", help="a `tracelock train-l2p --out` folder, for l2p sweeps (default: none)")
    add_batch_size(p, default=32)
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random draw of items (default: 0)")
    p.add_argument("--workers", type=workers_int, default=2, help="sandbox processes for code scoring (default: 2)")
    add_allow_uncontained(p)
    add_model_dtype(p, old=())
    add_quantize(p)
    add_device(p)
    p.add_argument("--out", required=True, help="folder: one eval run per task and setting, frontier.json/csv/png")
    p.checks.append(_sweeps_of_policies)
    p.set_defaults(func=_run)


def _sweeps_of_policies(args) -> None:
    """``--policies a:knob=v1,v2,b`` as ``--sweep a:knob=v1,v2 --sweep b``; one of the two spellings is required."""
    from tracelock.policy_specs import policy_groups

    if args.policies is not None:
        for name, _, pairs, listed, values in policy_groups(args.policies, option="--policies"):
            text = name + "".join(f":{k}={','.join(values) if i == listed else v}" for i, (k, v) in enumerate(pairs))
            args.sweep = [*(args.sweep or []), text]
    if not args.sweep:
        raise ValueError("the following arguments are required: --sweep (or --policies SPEC,SPEC)")
