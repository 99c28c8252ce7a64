"""Quantized against full-precision weights, paired: two `tracelock eval` folders of the same model, items, settings and
policies, one run without ``--quantize`` and one with it. Per task, setting and policy: the accuracy of each, their
difference with a 90% paired bootstrap interval over items, the share of items decoded to identical tokens, and the
mean steps of each. Writes ``--out`` (JSON: the table and the compact per-item records) and prints a markdown table.

    python bench/studies/quant_quality.py FULL_DIR INT8_DIR --out bench/results/quant-testbed-int8-validation.json

The goal it reads against: the quantized accuracy within 1 point of full precision, the 90% interval containing 0.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tracelock.atomic import atomic_write_json
from tracelock.eval.items import folder_items

RESAMPLES, SEED = 2000, 0


def paired_difference(full: np.ndarray, quant: np.ndarray, *, resamples=RESAMPLES, seed=SEED) -> dict:
    """Mean of ``quant - full`` (0/1 per item) and its 90% interval from a bootstrap over items."""
    diff = quant.astype(np.float64) - full.astype(np.float64)
    draws = np.random.default_rng(seed).integers(0, len(diff), size=(resamples, len(diff)))
    means = diff[draws].mean(axis=1)
    return dict(difference=float(diff.mean()), interval=[float(np.quantile(means, 0.05)),
                                                          float(np.quantile(means, 0.95))])


def compare_cell(full: dict, quant: dict) -> dict:
    """One (task, setting, policy): ``full`` and ``quant`` are {id: record} of the two runs."""
    ids = sorted(set(full) & set(quant))
    if not ids:
        raise ValueError("the two runs share no item: same --tasks, --limit and --seed?")
    f_ok = np.array([bool(full[i]["correct"]) for i in ids])
    q_ok = np.array([bool(quant[i]["correct"]) for i in ids])
    same = [full[i]["tokens"] == quant[i]["tokens"] for i in ids]
    return dict(n=len(ids), accuracy_full=float(f_ok.mean()), accuracy_quant=float(q_ok.mean()),
                **paired_difference(f_ok, q_ok), identical_tokens=float(np.mean(same)),
                steps_full=float(np.mean([full[i]["steps"] for i in ids])),
                steps_quant=float(np.mean([quant[i]["steps"] for i in ids])),
                records=dict(ids=ids, correct_full="".join("1" if x else "0" for x in f_ok),
                             correct_quant="".join("1" if x else "0" for x in q_ok),
                             identical="".join("1" if x else "0" for x in same),
                             steps_full=[full[i]["steps"] for i in ids], steps_quant=[quant[i]["steps"] for i in ids]))


def compare(full_dir: Path, quant_dir: Path) -> dict:
    """Every (task folder, setting, policy) both runs finished the same items of."""
    quant_manifests = list(quant_dir.glob("*/manifest.json"))
    if not quant_manifests:
        raise SystemExit(f"{quant_dir} holds no eval run (no */manifest.json)")
    cells = {}
    for manifest in sorted(quant_manifests):
        task_dir = manifest.parent
        fmt = json.loads(manifest.read_text()).get("quantize")
        for policy_dir in sorted(task_dir.glob("runs/*/*")):
            twin = full_dir / policy_dir.relative_to(quant_dir)
            quant, full = folder_items(policy_dir), folder_items(twin)
            if not quant or len(quant) != len(full):
                continue  # not finished on both sides
            key = f"{task_dir.name} {policy_dir.parent.name} {policy_dir.name}"
            cells[key] = dict(format=fmt, **compare_cell(full, quant))
    return cells


def markdown(cells: dict) -> str:
    rows = ["| task, setting, policy | n | full | quantized | difference [90%] | same tokens | steps full / quant |",
            "|---|---|---|---|---|---|---|"]
    for key, c in cells.items():
        lo, hi = c["interval"]
        rows.append(f"| {key} | {c['n']} | {100 * c['accuracy_full']:.1f} | {100 * c['accuracy_quant']:.1f} | "
                    f"{100 * c['difference']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | "
                    f"{100 * c['identical_tokens']:.1f}% | {c['steps_full']:.1f} / {c['steps_quant']:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("full", type=Path, help="the eval --out folder without --quantize")
    parser.add_argument("quant", type=Path, help="the eval --out folder of the same run with --quantize")
    parser.add_argument("--out", type=Path, help="JSON to write (default: print only)")
    args = parser.parse_args(argv)
    cells = compare(args.full, args.quant)
    print(markdown(cells))
    if args.out:
        atomic_write_json(args.out, dict(command=" ".join(["python", "bench/studies/quant_quality.py", *sys.argv[1:]]),
                                         resamples=RESAMPLES, seed=SEED, cells=cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
