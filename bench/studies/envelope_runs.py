"""The verdict's cells filled up to the hold-out protocol's grid: every point of
``bench/results/holdout/protocol.json`` that a verdict cell's committed records lack, decoded on the verdict's own
items (the test split, 500 per task, seed 2026) with `tracelock eval`, and its per-item records written beside the
others as ``bench/results/verdict-testbed-<family>/envelope-<task>-<G>-<W>.json`` (read by
`bench/studies/verdict_envelope.py`).

    python bench/studies/envelope_runs.py missing --family llada --task math --setting 64/16     # what a cell lacks
    OMP_NUM_THREADS=1 python bench/studies/envelope_runs.py run --family llada --task math --setting 64/16 --work DIR
    python bench/studies/envelope_runs.py records --family llada --task math --setting 64/16 --work DIR

``run`` calls ``tracelock eval --model M --tasks testbed:T --limit 500 --seed 2026 --settings G/W --controller C
--batch-size 100 --threads 1 --out DIR/<family>/<task>-<G>-<W> --policies <the missing points>``, which resumes a
killed run where it stopped (its items are appended as batches finish).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from verdict_envelope import load_cells  # noqa: E402

SEED, LIMIT = 2026, 500


def _norm(slug: str) -> str:
    """A point slug without its curve title (the frontier's Dream-form threshold carries one)."""
    return re.sub(r"-curve-.*$", "", slug)


def missing(family: str, task: str, setting: str) -> list:
    """The protocol's policy specs of a cell that its committed records lack."""
    from tracelock.eval.runner import parse_policies

    protocol = json.loads((ROOT / "bench" / "results" / "holdout" / "protocol.json").read_text())
    cell = load_cells(ROOT / "bench" / "results" / f"verdict-testbed-{family}")[(task, setting)]
    have = {_norm(name.split("/", 1)[1]) for name in cell["points"]}
    specs = protocol["families"][family]["points"][setting.split("/")[0]]
    return [s for s in specs if _norm(parse_policies(s)[0].slug) not in have]


def _folder(work: Path, family: str, task: str, setting: str) -> Path:
    return work / family / f"{task}-{setting.replace('/', '-')}"


def run(family: str, task: str, setting: str, work: Path) -> None:
    protocol = json.loads((ROOT / "bench" / "results" / "holdout" / "protocol.json").read_text())
    fam = protocol["families"][family]
    specs = missing(family, task, setting)
    if not specs:
        return
    cmd = [str(Path(sys.executable).parent / "tracelock"), "eval", "--model", fam["model"], "--tasks",
           f"testbed:{task}", "--limit", str(LIMIT), "--seed", str(SEED), "--settings", setting, "--controller",
           fam["controller"], "--batch-size", "100", "--threads", "1", "--workers", "1", "--quiet", "--out",
           str(_folder(work, family, task, setting)), "--policies", ",".join(specs)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def records(family: str, task: str, setting: str, work: Path) -> Path:
    from tracelock.atomic import atomic_write_json
    from tracelock.eval.items import compact_records, folder_items
    from tracelock.eval.runner import parse_policies

    specs = missing(family, task, setting)
    slug = setting.replace("/", "-")
    per_point = {}
    for spec in specs:
        policy = parse_policies(spec)[0]
        found = list(_folder(work, family, task, setting).glob(f"**/runs/{slug}/{policy.slug}"))
        got = folder_items(found[0]) if found else {}
        if len(got) != LIMIT:
            raise SystemExit(f"{spec}: {len(got)} of {LIMIT} items decoded; run the cell first")
        per_point[f"envelope-{slug}/{policy.slug}"] = got
    out = ROOT / "bench" / "results" / f"verdict-testbed-{family}" / f"envelope-{task}-{slug}.json"
    rec = compact_records(per_point)
    ids = load_cells(ROOT / "bench" / "results" / f"verdict-testbed-{family}")[(task, setting)]["ids"]
    if rec["ids"] != ids:
        raise SystemExit(f"{out}: the new points hold other items than the cell's records")
    atomic_write_json(out, rec)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["missing", "run", "records"])
    p.add_argument("--family", required=True, choices=["llada", "dream"])
    p.add_argument("--task", required=True, choices=["math", "code"])
    p.add_argument("--setting", required=True)
    p.add_argument("--work", type=Path, help="the eval run folders (run, records)")
    args = p.parse_args(argv)
    if args.command == "missing":
        print("\n".join(missing(args.family, args.task, args.setting)))
    elif args.command == "run":
        run(args.family, args.task, args.setting, args.work)
    else:
        print(records(args.family, args.task, args.setting, args.work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
