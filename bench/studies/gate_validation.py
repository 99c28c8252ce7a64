"""The fitted gates on the validation split in every cell of the second hold-out (both bundled models, math and code,
the four settings), on the items of the rules-since validation cells, so that each gate is read against the whole
training-free envelope at matched steps, and its grid set, before the hold-out is frozen.

    OMP_NUM_THREADS=1 python bench/studies/gate_validation.py run --cells llada:math:64/16,llada:math:64/32 --work DIR
    python bench/studies/gate_validation.py read

``run`` decodes in each cell (`tracelock eval`'s runner: resumable; the same 100 validation items, seed 1213, as
``bench/results/rules-since-validation/``):

- the family's bundled gate for the task (`GATES`, `tracelock fit`'s choice) along its base's knob, from `GRID`, then
  a midpoint in every hole wider than `MAX_STEP_GAP` mean steps until none is left (`tracelock.eval.dense`), so the
  curve has no holes; its base in the cell's better form on validation (`held_base`: with or without the end hold);
- Fast-dLLM's factor rule, plain and held (`FACTOR`): the one training-free rule of the package the rules-since cells
  do not hold.

It writes ``bench/results/gate-validation/<family>-<task>-<G>-<W>.json`` (compact per-item records, atomically).
``read`` judges each gate against the envelope of every training-free curve of the cell (the rules-since cell's
and the factor rule's) with `verdict_envelope`'s reading (step function on both sides, gap at matched steps, 90%
paired bootstrap interval, Holm over the cells, pooled) and writes ``bench/results/gate-validation/summary.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "gate-validation"
RULES = ROOT / "bench" / "results" / "rules-since-validation"
SEED, N = 1213, 100  # the rules-since cells' draw
MAX_STEP_GAP = 1.5
DENSE_ROUNDS = 6
# the bundled gates (tracelock/models/loading.py), one per family and task, each with its base in gate.json
GATES = {("llada", "math"): "testbed-llada-math", ("llada", "code"): "testbed-llada-code",
         ("dream", "math"): "testbed-dream-math", ("dream", "code"): "testbed-dream-code"}
MODELS = {"llada": "testbed", "dream": "testbed-dream"}
GRID = (0.01, 0.1, 0.3, 1.0, 3.0)  # eb's gamma in the rules-since cells, less 0.001 (its dearest, every rule's plateau)
FACTOR = (0.5, 1.0, 2.0, 4.0)


def cell_name(family: str, task: str, setting: str) -> str:
    return f"{family}-{task}-{setting.replace('/', '-')}"


@functools.cache
def held_base(family: str, task: str, setting: str) -> bool:
    """Whether the gate's base runs with the end-of-text hold in this cell: the form of the entropy bound with the
    higher mean accuracy in the rules-since validation cell (its summary), which leads or ties the package's rules in
    most cells (plain at width 16 and on math up to width 32, held elsewhere)."""
    cell = json.loads((RULES / "summary.json").read_text())["cells"][f"{family} {task} {setting}"]
    return cell["mean_accuracy"]["eb-hold-end"] > cell["mean_accuracy"]["eb"]


def gate_spec(family: str, task: str, value, setting: str) -> str:
    """The bundled gate at ``value`` of its knob, its base in the cell's form (`held_base`), named only where that
    differs from the form the gate was fitted with (its gate.json)."""
    from tracelock.policies.gate import chosen_gate

    chosen = chosen_gate(GATES[(family, task)])
    held = held_base(family, task, setting)
    form = "" if held == bool(chosen["base_args"].get("hold_end", False)) else f":base_hold_end={str(held).lower()}"
    return f"gate:controller={GATES[(family, task)]}{form}:{chosen['knob']}={value}"


def specs(family: str, task: str, gate_values, setting: str) -> dict:
    """{curve: [policy spec]} of a cell: the gate at ``gate_values`` of its knob, the factor rule plain and held."""
    # the factor rule has one form on both families (no first_token), as the first hold-out ran it
    return {"gate": [gate_spec(family, task, v, setting) for v in sorted(gate_values)],
            "factor": [f"factor:f={f}" for f in FACTOR],
            "factor-hold-end": [f"factor:f={f}:hold_end=true" for f in FACTOR]}


def run(cells: list, work: Path, results: Path = RESULTS) -> None:
    for family, task, setting in cells:
        run_cell(family, task, setting, work / cell_name(family, task, setting), results)


def run_cell(family: str, task: str, setting: str, folder: Path, results: Path = RESULTS) -> None:
    from tracelock.atomic import atomic_write_json
    from tracelock.eval.dense import trace_densely
    from tracelock.eval.items import compact_records, folder_items
    from tracelock.eval.runner import parse_policies, parse_settings, run_eval

    (s,) = parse_settings(setting)
    cost = [0.0, 0]  # CPU seconds and item-steps decoded by this call: the hold-out's cost estimate

    def records(spec):
        return folder_items(folder / "runs" / s.slug / parse_policies(spec)[0].slug)

    def decode(spec_list):
        policies = [p for spec in spec_list for p in parse_policies(spec)]
        before, cpu = sum(_item_steps(records(x)) for x in spec_list), time.process_time()
        run_eval(MODELS[family], f"testbed:{task}@validation", policies, [s], folder, n=N, seed=SEED,
                 batch_size=100, workers=1)
        cost[0] += time.process_time() - cpu
        cost[1] += sum(_item_steps(records(x)) for x in spec_list) - before

    decode([x for ss in specs(family, task, GRID, setting).values() for x in ss])
    values = trace_densely(GRID, lambda v: _mean_steps(records(gate_spec(family, task, v, setting))),
                           lambda new: decode([gate_spec(family, task, v, setting) for v in new]), MAX_STEP_GAP,
                           DENSE_ROUNDS, whole=False, log=True)
    curves = specs(family, task, values, setting)
    rec = compact_records({f"{c}/{parse_policies(x)[0].slug}": records(x) for c, ss in curves.items() for x in ss})
    path = results / f"{cell_name(family, task, setting)}.json"
    results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, dict(
        what=f"{family} {task} {setting}, validation split, {N} items drawn with seed {SEED}", model=MODELS[family],
        task=f"testbed:{task}@validation", setting=setting, n=N, seed=SEED, specs=curves,
        cpu_per_item_step=_cost(path, cost), ids=rec["ids"], points=rec["points"]))
    print(f"wrote {path}: the gate at {len(values)} values", flush=True)


def _item_steps(records: dict) -> int:
    return sum(r["steps"] for r in records.values())


def _cost(path: Path, cost: list) -> float:
    """CPU seconds per item-step of this call's decodes; a call that decoded nothing keeps the earlier figure (None
    where there is none: a run that resumed a killed one after its last decode)."""
    if cost[1] == 0:
        return json.loads(path.read_text())["cpu_per_item_step"] if path.exists() else None
    return round(cost[0] / cost[1], 6)


def _mean_steps(records: dict) -> float:
    return sum(r["steps"] for r in records.values()) / len(records)


def cells_of(results: Path = RESULTS, rules: Path = RULES) -> dict:
    """{(family, task, setting): {"ids", "points": {name: (correct, steps)}}}: each gate cell with its rules-since
    cell's points (the same items), in `verdict_envelope`'s form."""
    import numpy as np

    out = {}
    for path in sorted(results.glob("*-*-*-*.json")):
        gate = json.loads(path.read_text())
        other = json.loads((rules / path.name).read_text())
        if other["ids"] != gate["ids"]:
            raise SystemExit(f"{path.name}: the gate's items are not the rules-since cell's")
        family, task = path.stem.split("-")[:2]
        points = {}
        for rec in (other, gate):
            for label, p in rec["points"].items():
                points[f"{gate['setting'].replace('/', '-')}/{label.split('/', 1)[1]}"] = (
                    np.array([c == "1" for c in p["correct"]], dtype=np.float64),
                    np.asarray(p["steps"], dtype=np.float64))
        out[(family, task, gate["setting"])] = dict(ids=gate["ids"], points=points)
    return out


def read(results: Path = RESULTS, *, resamples: int = 2000) -> dict:
    """The gates against the envelope of every training-free curve, cell by cell and pooled (written to
    ``results/summary.json``)."""
    import verdict_envelope as ve

    from tracelock.atomic import atomic_write_json

    result = ve.analyse_cells(cells_of(results), resamples=resamples, learned="gate", comparisons=("strongest",))
    result["what"] = ("the fitted gates (one per family and task) against every training-free rule of the package, "
                      f"plain and held, validation split ({N} items per task, seed {SEED}), gap at matched steps")
    atomic_write_json(results / "summary.json", result)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="decode cells and write their records")
    r.add_argument("--cells", required=True, help="FAMILY:TASK:G/W, comma-separated")
    r.add_argument("--work", type=Path, required=True, help="the eval run folders (resumable)")
    r.add_argument("--results", type=Path, default=RESULTS)
    q = sub.add_parser("read", help="judge the records and write the summary")
    q.add_argument("--results", type=Path, default=RESULTS)
    q.add_argument("--resamples", type=int, default=2000)
    args = p.parse_args(argv)
    if args.command == "run":
        run([tuple(c.split(":")) for c in args.cells.split(",")], args.work, args.results)
    else:
        import verdict_envelope as ve

        print(ve.markdown(read(args.results, resamples=args.resamples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
