"""How far two decodes of the same frontier points agree, item by item (e.g. a GPU's against a CPU's): for every point
label in both records.json files (the controller's folder left out of the label), on the same items, the items with
the same verdict and the same steps, and each side's accuracy and mean steps.

    python bench/studies/records_agreement.py GPU/records.json CPU/records.json testbed:math 64/16 [--out \
        agreement.json]
"""

import argparse
import json
import re
from pathlib import Path

from tracelock.atomic import atomic_write_json


def plain(label: str) -> str:
    """A point label without its controller's folder (the same controller may sit elsewhere on another machine)."""
    return re.sub(r"controller=[^:]*:", "", label)


def agreement(a: dict, b: dict) -> dict:
    """{label: counts} for the points of two compact records of one cell (`tracelock.eval.items.compact_records`)."""
    if a["ids"] != b["ids"]:
        raise ValueError(f"the records hold other items ({len(a['ids'])} and {len(b['ids'])} ids): another draw")
    n = len(a["ids"])
    theirs = {plain(k): v for k, v in b["points"].items()}
    out = {}
    for label, p in a["points"].items():
        q = theirs.get(plain(label))
        if q is None:
            continue
        out[plain(label)] = dict(
            items=n, same_correct=sum(x == y for x, y in zip(p["correct"], q["correct"])),
            same_steps=sum(x == y for x, y in zip(p["steps"], q["steps"])),
            accuracy=[p["correct"].count("1") / n, q["correct"].count("1") / n],
            mean_steps=[sum(p["steps"]) / n, sum(q["steps"]) / n])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("task")
    ap.add_argument("setting")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    a, b = (json.loads(p.read_text())[args.task][args.setting] for p in (args.a, args.b))
    result = dict(task=args.task, setting=args.setting, a=str(args.a), b=str(args.b), points=agreement(a, b))
    if args.out:
        atomic_write_json(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
