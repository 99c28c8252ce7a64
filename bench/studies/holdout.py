"""The clean hold-out of the commit-rule verdict: a draw of test problems disjoint from every earlier draw,
decoded once under rules frozen before it.

Three steps, each a subcommand:

Each hold-out lives in its own folder (``--protocol``, default ``bench/results/holdout``, the first one):

- ``draw``: the items. From each testbed task's test pool (the first ``--pool`` distinct test problems, default
  `tracelock.tasks.POOL`; a larger pool starts with the same problems), take out every item an earlier run could
  have read: the first 500 of the pool (the "first N" runs, N <= 300, and the demo's 16), the random draws of seeds
  0 and 1 at every size used (8 to 500), the verdict's draw (seed 2026, 500) and every earlier hold-out's items
  (``--exclude``); draw ``--n`` of the rest with ``--seed``. Written to ``<protocol>/items.json`` (committed before
  anything decodes them).
- ``run``: decode one cell (family, task, setting) of the frozen protocol (``<protocol>/protocol.json``: every
  policy spec per family and generation length, the controllers, the analysis). It refuses to start unless the
  protocol and the items file are committed and unchanged in git, and records the commit it ran from. Per-item
  records are appended as batches finish (`tracelock.eval.runner`), so a killed run resumes where it stopped.
  Several processes may run the same cell: each takes the policies no other one holds (`decode_shared`).
- ``records``: the compact per-item records of a finished cell, ``<out>/<name>-testbed-<family>/<name>-<task>-<G>-
  <W>.json`` (``<name>``: the protocol folder's name), for `bench/studies/verdict_envelope.py` (the same format as
  the verdict's records).

Example::

    python bench/studies/holdout.py draw --n 500 --seed 5959
    python bench/studies/holdout.py --protocol bench/results/holdout2 draw --n 300 --seed 7 --pool 4000 \
        --exclude bench/results/holdout/items.json
    OMP_NUM_THREADS=1 python bench/studies/holdout.py run --family llada --task math --setting 64/16 --work /tmp/holdout
    python bench/studies/holdout.py records --family llada --task math --setting 64/16 --work /tmp/holdout
    python bench/studies/verdict_envelope.py bench/results/holdout-testbed-llada bench/results/holdout-testbed-dream
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOLDOUT = ROOT / "bench" / "results" / "holdout"
TASKS = ("math", "code")
# what earlier runs read of the test pools: the first items, and the random draws (seed, sizes) the docs record
FIRST = 500
EARLIER_DRAWS = {0: (8, 16, 32, 64, 100, 200, 300, 500), 1: (8, 16, 32, 64, 100, 200, 300, 500), 2026: (500,)}


def earlier_items(task: str) -> set:
    """Pool places of ``task``'s test pool that an earlier run could have decoded."""
    from tracelock.tasks import POOL

    used = set(range(FIRST))
    for seed, sizes in EARLIER_DRAWS.items():
        for n in sizes:  # tracelock.tasks.draw's own sampling
            used |= set(random.Random(f"tracelock-draw:{task}:test:{seed}").sample(range(POOL), n))
    return used


def draw(n: int, seed: int, pool: int | None = None, exclude: tuple = ()) -> dict:
    """``n`` items per task from the first ``pool`` test problems, none of them one an earlier run could have read
    (`earlier_items`, and every id in the ``exclude`` items files)."""
    from tracelock.tasks import POOL

    pool = pool or POOL
    if pool < POOL:
        raise SystemExit(f"--pool {pool}: the earlier draws sampled the first {POOL} problems; give at least that")
    excluded = [json.loads(Path(f).read_text())["ids"] for f in exclude]
    out = dict(seed=seed, n=n, pool=pool, first_excluded=FIRST,
               earlier_draws={str(s): list(sizes) for s, sizes in EARLIER_DRAWS.items()},
               excluded_files=[_repo_path(f) for f in exclude], ids={})
    for task in TASKS:
        used = earlier_items(task) | {int(i.rsplit(":", 1)[1]) for ids in excluded for i in ids[task]}
        free = sorted(set(range(pool)) - used)
        if len(free) < n:
            raise SystemExit(f"{task}: only {len(free)} pool items are left; ask for fewer (--n)")
        picks = sorted(random.Random(f"tracelock-holdout:{task}:{seed}").sample(free, n))
        out["ids"][task] = [f"{task}:test:{i}" for i in picks]
        out[f"{task}_free"] = len(free)
    return out


def _repo_path(path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def pool_items(task: str, size: int) -> tuple:
    """The first ``size`` distinct test problems of ``task`` (`tracelock.tasks.POOL` of them: the shared pool)."""
    from tracelock.tasks import POOL, _pool, held_out

    return _pool(task, "test") if size == POOL else tuple(held_out(task, "test", size))


def committed(path: Path) -> str:
    """The commit ``path`` is frozen at: it must be tracked and equal to HEAD's copy."""
    rel = str(path.resolve().relative_to(ROOT))  # --protocol may be given relative to the working folder
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--error-unmatch", rel], capture_output=True)
    same = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", rel])
    if tracked.returncode or same.returncode:
        raise SystemExit(f"{rel} is not committed as it is: commit the frozen file before decoding the hold-out")
    return subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%H", "--", rel], capture_output=True,
                          text=True).stdout.strip()


def cell_specs(protocol: dict, family: str, setting: str, task: str | None = None) -> list:
    """The policy specs of one cell: the family's ``points[gen]``, or, where the protocol names its points per task (a
    gate per domain), ``points[task][setting]`` or ``points[task][gen]``."""
    gen = setting.split("/")[0]
    points = protocol["families"][family]["points"]
    if gen not in points:
        if task is None:
            raise SystemExit(f"the protocol names its {family} points per task: give the task")
        points = points[task]
    return points[setting] if setting in points else points[gen]


def run(protocol_dir: Path, family: str, task: str, setting: str, work: Path, batch_size: int, workers: int) -> None:
    import torch

    from tracelock.atomic import atomic_write_json
    from tracelock.eval.runner import _decode_policy, parse_policies, parse_settings
    from tracelock.eval.tasks import EvalItem, make_task
    from tracelock.models import load_model, load_tokenizer

    frozen = {p.name: committed(p) for p in (protocol_dir / "protocol.json", protocol_dir / "items.json")}
    protocol = json.loads((protocol_dir / "protocol.json").read_text())
    drawn = json.loads((protocol_dir / "items.json").read_text())
    ids = drawn["ids"][task]
    fam = protocol["families"][family]
    pool = pool_items(task, drawn["pool"])
    items = [EvalItem(i, pool[int(i.rsplit(":", 1)[1])].prompt, pool[int(i.rsplit(":", 1)[1])]) for i in ids]
    scorer = make_task(f"testbed:{task}")
    (s,) = parse_settings(setting)
    folder = work / family / f"{task}-{s.slug}"
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "manifest.json"
    if not manifest.exists():  # two processes joining a cell at once both write it, each whole (atomic)
        atomic_write_json(manifest, dict(frozen=frozen, family=family, task=task, setting=setting,
                                         torch=torch.__version__))
    model, tokenizer = load_model(fam["model"]), load_tokenizer(fam["model"])
    policies = [p for spec in cell_specs(protocol, family, setting, task) for p in parse_policies(spec)]

    def decode(policy):
        _decode_policy(model, tokenizer, scorer, items, policy, s, folder / policy.slug, rank=0,
                       batch_size=batch_size, seed=0, schedule="auto", controller=fam.get("controller"),
                       first_folder=folder / policies[0].slug, workers=workers)
        print(f"{family} {task} {setting} {policy.label}: done", flush=True)

    decode_shared(policies, lambda policy: folder / policy.slug, decode)


def decode_shared(policies: list, folder_of, decode, poll: float = 5.0) -> None:
    """``decode(policy)`` for every policy, while other processes may run the same cell: each holds a lock on the
    policy's folder while it decodes, and a policy whose folder another process holds is left for later, so two
    processes leapfrog through one cell instead of one idling. Returns once every policy went through ``decode``
    here, which skips the items already done (so a policy another process finished costs a read)."""
    import contextlib
    import time

    from tracelock.atomic import FolderBusyError, folder_lock

    pending = list(policies)
    while pending:
        for policy in list(pending):
            with contextlib.ExitStack() as held:
                try:
                    held.enter_context(folder_lock(folder_of(policy), "holdout-lock"))
                except FolderBusyError:
                    continue  # another process is on it: come back once it is done
                decode(policy)
            pending.remove(policy)
        if pending:
            time.sleep(poll)


def records(protocol_dir: Path, family: str, task: str, setting: str, work: Path, out: Path) -> Path:
    from tracelock.atomic import atomic_write_json
    from tracelock.eval.items import compact_records, folder_items
    from tracelock.eval.runner import parse_policies, parse_settings

    protocol = json.loads((protocol_dir / "protocol.json").read_text())
    n = len(json.loads((protocol_dir / "items.json").read_text())["ids"][task])
    name = protocol_dir.name
    (s,) = parse_settings(setting)
    folder = work / family / f"{task}-{s.slug}"
    per_point = {}
    for spec in cell_specs(protocol, family, setting, task):
        for policy in parse_policies(spec):
            got = folder_items(folder / policy.slug)
            if len(got) != n:
                raise SystemExit(f"{folder / policy.slug}: {len(got)} of {n} items decoded; run the cell first")
            per_point[f"{name}-{s.slug}/{policy.slug}"] = got
    path = out / f"{name}-testbed-{family}" / f"{name}-{task}-{s.slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, compact_records(per_point))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", type=Path, default=HOLDOUT,
                   help="the hold-out's folder: its protocol.json and items.json (default: the first hold-out's)")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("draw", help="draw the hold-out items into <protocol>/items.json")
    d.add_argument("--n", type=int, default=500)
    d.add_argument("--seed", type=int, required=True)
    d.add_argument("--pool", type=int, default=None, help="draw from the first N distinct test problems")
    d.add_argument("--exclude", type=Path, action="append", default=[],
                   help="an earlier hold-out's items.json whose items are left out (repeatable)")
    for name in ("run", "records"):
        c = sub.add_parser(name)
        c.add_argument("--family", required=True, choices=["llada", "dream"])
        c.add_argument("--task", required=True, choices=TASKS)
        c.add_argument("--setting", required=True, help="GEN/WIDTH, one of the protocol's")
        c.add_argument("--work", type=Path, required=True, help="the run folders (resumable)")
        if name == "run":
            c.add_argument("--batch-size", type=int, default=100)
            c.add_argument("--workers", type=int, default=1, help="sandbox processes for code scoring")
        else:
            c.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    if args.command == "draw":
        args.protocol.mkdir(parents=True, exist_ok=True)
        path = args.protocol / "items.json"
        if path.exists():
            raise SystemExit(f"{path} exists: the hold-out is drawn once")
        path.write_text(json.dumps(draw(args.n, args.seed, args.pool, tuple(args.exclude)), indent=1) + "\n")
        print(path)
    elif args.command == "run":
        run(args.protocol, args.family, args.task, args.setting, args.work, args.batch_size, args.workers)
    else:
        print(records(args.protocol, args.family, args.task, args.setting, args.work, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
