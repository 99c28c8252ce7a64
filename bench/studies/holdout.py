"""The clean hold-out of the commit-rule verdict: a draw of test problems disjoint from every earlier draw,
decoded once under rules frozen before it.

Three steps, each a subcommand:

- ``draw``: the items. From each testbed task's test pool (`tracelock.tasks.POOL` problems), take out every
  item an earlier run could have read: the first 500 of the pool (the "first N" runs, N <= 300, and the demo's 16),
  the random draws of seeds 0 and 1 at every size used (8 to 500), and the verdict's draw (seed 2026, 500); draw
  ``--n`` of the rest with ``--seed``. Written to ``bench/results/holdout/items.json`` (committed before anything
  decodes them).
- ``run``: decode one cell (family, task, setting) of the frozen protocol (``bench/results/holdout/protocol.json``:
  every policy spec per family and generation length, the controllers, the analysis). It refuses to start unless
  the protocol and the items file are committed and unchanged in git, and records the commit it ran from. Per-item
  records are appended as batches finish (`tracelock.eval.runner`), so a killed run resumes where it stopped.
  Several processes may run the same cell: each takes the policies no other one holds (`decode_shared`).
- ``records``: the compact per-item records of a finished cell, ``<out>/holdout-testbed-<family>/holdout-<task>-<G>-
  <W>.json``, for `bench/studies/verdict_envelope.py` (the same format as the verdict's records).

Example::

    python bench/studies/holdout.py draw --n 500 --seed 5959
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


def draw(n: int, seed: int) -> dict:
    from tracelock.tasks import POOL

    out = dict(seed=seed, n=n, pool=POOL, first_excluded=FIRST,
               earlier_draws={str(s): list(sizes) for s, sizes in EARLIER_DRAWS.items()}, ids={})
    for task in TASKS:
        free = sorted(set(range(POOL)) - earlier_items(task))
        if len(free) < n:
            raise SystemExit(f"{task}: only {len(free)} pool items are left; ask for fewer (--n)")
        picks = sorted(random.Random(f"tracelock-holdout:{task}:{seed}").sample(free, n))
        out["ids"][task] = [f"{task}:test:{i}" for i in picks]
        out[f"{task}_free"] = len(free)
    return out


def committed(path: Path) -> str:
    """The commit ``path`` is frozen at: it must be tracked and equal to HEAD's copy."""
    rel = str(path.relative_to(ROOT))
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--error-unmatch", rel], capture_output=True)
    same = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", rel])
    if tracked.returncode or same.returncode:
        raise SystemExit(f"{rel} is not committed as it is: commit the frozen file before decoding the hold-out")
    return subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%H", "--", rel], capture_output=True,
                          text=True).stdout.strip()


def cell_specs(protocol: dict, family: str, setting: str) -> list:
    gen = setting.split("/")[0]
    return protocol["families"][family]["points"][gen]


def run(family: str, task: str, setting: str, work: Path, batch_size: int, workers: int) -> None:
    import torch

    from tracelock.atomic import atomic_write_json
    from tracelock.eval.runner import _decode_policy, parse_policies, parse_settings
    from tracelock.eval.tasks import EvalItem, make_task
    from tracelock.models import load_model, load_tokenizer
    from tracelock.tasks import _pool

    frozen = {p.name: committed(p) for p in (HOLDOUT / "protocol.json", HOLDOUT / "items.json")}
    protocol = json.loads((HOLDOUT / "protocol.json").read_text())
    ids = json.loads((HOLDOUT / "items.json").read_text())["ids"][task]
    fam = protocol["families"][family]
    pool = _pool(task, "test")
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
    policies = [p for spec in cell_specs(protocol, family, setting) for p in parse_policies(spec)]

    def decode(policy):
        _decode_policy(model, tokenizer, scorer, items, policy, s, folder / policy.slug, rank=0,
                       batch_size=batch_size, seed=0, schedule="auto", controller=fam["controller"],
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


def records(family: str, task: str, setting: str, work: Path, out: Path) -> Path:
    from tracelock.atomic import atomic_write_json
    from tracelock.eval.items import compact_records, folder_items
    from tracelock.eval.runner import parse_policies, parse_settings

    protocol = json.loads((HOLDOUT / "protocol.json").read_text())
    n = len(json.loads((HOLDOUT / "items.json").read_text())["ids"][task])
    (s,) = parse_settings(setting)
    folder = work / family / f"{task}-{s.slug}"
    per_point = {}
    for spec in cell_specs(protocol, family, setting):
        for policy in parse_policies(spec):
            got = folder_items(folder / policy.slug)
            if len(got) != n:
                raise SystemExit(f"{folder / policy.slug}: {len(got)} of {n} items decoded; run the cell first")
            per_point[f"holdout-{s.slug}/{policy.slug}"] = got
    path = out / f"holdout-testbed-{family}" / f"holdout-{task}-{s.slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, compact_records(per_point))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("draw", help="draw the hold-out items into bench/results/holdout/items.json")
    d.add_argument("--n", type=int, default=500)
    d.add_argument("--seed", type=int, required=True)
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
        HOLDOUT.mkdir(parents=True, exist_ok=True)
        path = HOLDOUT / "items.json"
        if path.exists():
            raise SystemExit(f"{path} exists: the hold-out is drawn once")
        path.write_text(json.dumps(draw(args.n, args.seed), indent=1) + "\n")
        print(path)
    elif args.command == "run":
        run(args.family, args.task, args.setting, args.work, args.batch_size, args.workers)
    else:
        print(records(args.family, args.task, args.setting, args.work, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
