"""Accuracy at matched steps (`tracelock.eval.matched`) from `tracelock eval` policy folders of the same items and
setting, e.g. a validation study whose points were decoded by several eval runs.

Heuristic folders (before ``--``) group into curves by their policy name (``threshold-tau-0.9`` and
``threshold-tau-0.8`` are one curve); the folders after ``--`` group by their name with theta taken out
(``tracelock-theta-0.9-hold-end-true`` joins ``tracelock-theta-0.95-hold-end-true``). Each such curve gets its gap
at matched steps against the strongest heuristic and its steps to the heuristics' best accuracy minus 1 point, with
90% paired bootstrap intervals::

    python bench/studies/matched_runs.py runs/a/runs/64-16/confidence runs/a/runs/64-16/threshold-tau-0.9 ... \
        -- runs/b/runs/64-16/tracelock-theta-0.9 runs/b/runs/64-16/tracelock-theta-0.95

``--records FILE`` (first) also writes every folder's per-item record, pairable: the item ids once, and per folder
(named ``<run folder>/<policy folder>``) a 0/1 string (correct) and the steps, in id order.
"""

import json
import re
import sys
from pathlib import Path

from tracelock.atomic import atomic_write_json
from tracelock.eval.items import compact_records, folder_items
from tracelock.eval.matched import Curve, verdict


def curve(name: str, folders: list) -> Curve:
    records = [folder_items(Path(f)) for f in folders]
    ids = sorted(set.intersection(*(set(r) for r in records)))
    if not ids:
        raise SystemExit(f"{name}: its folders share no item")
    return Curve(name, [[float(bool(r[i]["correct"])) for i in ids] for r in records],
                 [[float(r[i]["steps"]) for i in ids] for r in records])


def group(folders: list, pattern: str) -> dict:
    out = {}
    for f in folders:
        out.setdefault(re.sub(pattern, "", Path(f).name), []).append(f)
    return out


def records(folders: list) -> dict:
    """The folders' per-item records on their common items: ids once, a 0/1 string and the steps per folder."""
    return compact_records({f"{Path(f).parents[2].name}/{Path(f).name}": folder_items(Path(f)) for f in folders})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = None
    if argv[:1] == ["--records"]:
        if len(argv) < 2:
            raise SystemExit("--records needs a file name")
        out, argv = argv[1], argv[2:]
    if "--" not in argv:
        raise SystemExit("usage: matched_runs.py [--records FILE] HEURISTIC_FOLDER... -- POLICY_FOLDER...")
    cut = argv.index("--")
    if out:
        atomic_write_json(out, records(argv[:cut] + argv[cut + 1:]))
    heuristics = [curve(n, fs) for n, fs in group(argv[:cut], r"-(tau|per-step)-[0-9.]+").items()]
    rows = {}
    for name, folders in group(argv[cut + 1:], r"-theta-[0-9.]+").items():
        c = curve(name, folders)
        if any(h.n_items != c.n_items for h in heuristics):
            raise SystemExit(f"{name}: not the heuristics' items (every folder must hold the same items, all done)")
        steps, acc = c.points()
        rows[name] = dict(points=[(round(float(s), 1), round(100 * float(a), 1)) for s, a in zip(steps, acc)],
                          **verdict(c, heuristics))
    json.dump(rows, sys.stdout, indent=1, default=float)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
