"""Fault injection for the long jobs: run a `tracelock` command in a subprocess, SIGKILL it at a chosen point, run the
same command again (it resumes), and compare the result with an uninterrupted run.

A kill point (`Kill`) is one of:

- ``before:N``: just before the job's N-th ``os.replace``: the N-th atomic write's temporary file is complete on disk
  and not yet renamed (a kill in the middle of writing a shard, a checkpoint or an index);
- ``after:N``: just after the N-th rename, before the job does anything else (between a shard and its done record,
  between a checkpoint and the JSON that names it);
- ``time:S``: S seconds after the command started (imports done), wherever the job then is.

The child process is this file run as a script (``python tests/faults.py ARGS``, the kill point, the rank to kill
under torchrun and the log file in ``FAULTS_*`` variables, which torchrun passes to every rank): it logs every
rename with its time, arms the kill (only in that rank) and calls ``tracelock.cli.main(ARGS)``.
The kill is a real SIGKILL the process sends itself: nothing is mocked, the renames themselves are the real ones.
Importable with the standard library only (the child imports tracelock after arming).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
# one torch thread per process: the test machine has 2 cores and other jobs beside
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


@dataclasses.dataclass(frozen=True)
class Kill:
    kind: str  # "before", "after" (the N-th rename) or "time" (seconds after the start)
    at: float

    def __str__(self):
        return f"{self.kind}:{self.at:g}"

    @classmethod
    def parse(cls, text: str) -> Kill:
        kind, _, at = text.partition(":")
        if kind not in ("before", "after", "time"):
            raise ValueError(f"kill point {text!r}: expected before:N, after:N or time:S")
        return cls(kind, float(at))


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    renames: list  # per process (rank), the (seconds, destination) of every rename it did, in order
    seconds: float

    @property
    def finished(self) -> bool:
        return self.returncode == 0


def run(args: list, *, log_dir: Path, kill: Kill | None = None, rank: int | None = None, nproc: int = 1,
        timeout: float = 600) -> Run:
    """Run ``tracelock ARGS`` (under torchrun with gloo when ``nproc`` > 1), killed at ``kill`` in ``rank``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("renames-*.log"):
        old.unlink()
    env = dict(ENV, FAULTS_LOG=str(log_dir / "renames-{rank}.log"), FAULTS_KILL=str(kill or ""),
               FAULTS_RANK="" if rank is None else str(rank))
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc-per-node", str(nproc)]
    t0 = time.monotonic()
    proc = subprocess.run([*launcher, str(HERE), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env)
    renames = []
    for path in sorted(log_dir.glob("renames-*.log")):
        renames.append([(float(t), dst) for t, dst in (line.split(" ", 1) for line in path.read_text().splitlines())])
    return Run(proc.returncode, proc.stdout, proc.stderr, renames, time.monotonic() - t0)


def spread(reference: Run, count: int, *, rank: int = 0) -> list[Kill]:
    """``count`` kill points spread over the reference run of one rank, cycling through a time (a share of the
    run's length: loading and computing take most of a run, and renames cluster at its end), just before a rename
    and just after one, at evenly spaced positions inside the run; then the last commit point: just after a data
    file's rename that a JSON record's rename follows (between a shard and its done record, a checkpoint and the
    state that names it)."""
    renames = reference.renames[rank]
    n = len(renames)
    if n < 2:
        raise ValueError(f"the reference run renamed {n} file(s): too few to place kill points")
    kills = []
    for i in range(count):
        share = (i + 1) / (count + 1)
        kind = ("time", "before", "after")[i % 3]
        at = round(renames[-1][0] * share, 3) if kind == "time" else min(n, max(1, round(share * n)))
        kills.append(Kill(kind, at))
    pairs = [k for k in range(1, n) if not renames[k - 1][1].endswith(".json") and renames[k][1].endswith(".json")]
    kills += [Kill("after", pairs[-1])] if pairs else []
    return list(dict.fromkeys(kills))


def kill_and_resume(args: list, out: Path, kill: Kill, *, log_dir: Path, rank: int | None = None, nproc: int = 1,
                    resume_args: list | None = None) -> dict:
    """Run ``args`` killed at ``kill``, then run ``resume_args`` (default: the same) to completion.

    Returns where the kill landed: renames done before it, whether it fired at all (the job may finish first), and
    the resumed run.
    """
    first = run(args, log_dir=log_dir, kill=kill, rank=rank, nproc=nproc)
    killed = not first.finished
    if killed and "SIGKILL" not in first.stderr and first.returncode != -signal.SIGKILL:
        raise AssertionError(f"the run failed by itself, not by the kill at {kill}:\n{first.stderr[-3000:]}")
    landed = first.renames[rank or 0] if first.renames else []
    resumed = run(resume_args or args, log_dir=log_dir, nproc=nproc)
    if not resumed.finished:
        raise AssertionError(f"the resumed run after a kill at {kill} failed:\n{resumed.stderr[-3000:]}")
    return dict(kill=str(kill), fired=killed, renames_before=len(landed), last=landed[-1][1] if landed else None,
                resumed=resumed, out=out)


def leftovers(folder: Path) -> list[str]:
    """Temporary files of atomic writes and lock files left anywhere under ``folder``."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*") if p.is_file())


def same_bytes(ref: Path, got: Path, patterns: list[str]) -> list[str]:
    """Files matching ``patterns`` (globs under each folder) that differ in name or bytes; empty: identical.

    A safetensors file's JSON header is compared as JSON: safetensors writes the ``__metadata__`` keys in its hash
    map's order, which changes from process to process; every other byte must be equal."""
    names = {str(p.relative_to(root)) for root in (ref, got) for pat in patterns for p in root.glob(pat)}
    return sorted(n for n in names if not ((ref / n).is_file() and (got / n).is_file()
                                           and _canonical(ref / n) == _canonical(got / n)))


def _canonical(path: Path):
    data = path.read_bytes()
    if path.suffix != ".safetensors" or len(data) < 8:
        return data
    import json

    n = int.from_bytes(data[:8], "little")
    try:
        return json.loads(data[8:8 + n]), data[8 + n:]
    except ValueError:
        return data


def compare_store(ref: Path, got: Path, *, paths: tuple | None = None) -> dict:
    """A trace store against the reference's, as data: lost and duplicated ids, torn (unverifiable) shards, and
    traces that differ in any array or meta field. ``paths`` (the reference run's folder, this run's): a meta field
    that names a file of the run (a controller) is compared with this run's folder read as the reference's."""
    import json

    import numpy as np

    from tracelock.traces.store import done_records, iter_traces, verify

    torn = 0
    try:
        verify(got)
    except ValueError:
        torn = 1
    written = [i for rec in done_records(got).values() for e in rec["shards"] for i in e["ids"]]
    skipped = [i for rec in done_records(got).values() for i in rec["skipped"]]
    ref_traces = {t.meta["id"]: t for t in iter_traces(ref)}
    got_traces = {t.meta["id"]: t for t in iter_traces(got)} if not torn else {}
    differ = []
    for key in set(ref_traces) & set(got_traces):
        a, b = ref_traces[key], got_traces[key]
        same = all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("prompt", "final", "final_state",
                                                                             "commit_step", "steps", "proposals"))
        same &= (a.confidence is None) == (b.confidence is None) and (
            a.confidence is None or np.array_equal(a.confidence, b.confidence, equal_nan=True))
        meta = b.meta if paths is None else json.loads(json.dumps(b.meta).replace(str(paths[1]), str(paths[0])))
        if not (same and a.meta == meta):
            differ.append(key)
    ref_skipped = {i for rec in done_records(ref).values() for i in rec["skipped"]}
    return dict(records=len(ref_traces) + len(ref_skipped), lost=len(set(ref_traces) - set(got_traces))
                + len(ref_skipped - set(skipped)), duplicated=len(written) - len(set(written)) + len(skipped)
                - len(set(skipped)), torn=torn, differ=len(differ) + len(set(got_traces) - set(ref_traces)))


def verify_cache(cache) -> None:
    """Check every file of every shard of a `FeatureCache` against its sha256 in the index, not only the shards an
    item read loads (raises `CacheCorruptError` naming the first file missing or corrupt)."""
    from tracelock.traces.cache import CacheCorruptError, _sha256

    for shard in cache.index["shards"]:
        for field in shard["files"]:
            path = cache.folder / shard["files"][field]["file"]
            if not path.is_file() or _sha256(path) != shard["files"][field]["sha256"]:
                raise CacheCorruptError(f"{path} is missing or corrupt; delete {cache.folder} and rerun "
                                        "`tracelock featurize`")


def compare_cache(ref: Path, got: Path) -> dict:
    """A feature cache against the reference's, as data, item by item keyed by (trace id, step)."""
    import numpy as np

    from tracelock.traces.cache import FeatureCache

    def items(folder):
        cache = FeatureCache(folder)
        verify_cache(cache)
        return cache, {(cache[i]["trace_id"], cache[i]["step"]): i for i in range(len(cache))}

    ref_cache, ref_items = items(ref)
    try:
        got_cache, got_items = items(got)
    except ValueError:
        return dict(records=len(ref_items), lost=len(ref_items), duplicated=0, torn=1, differ=0)
    traces = [t["id"] for s in got_cache.index["shards"] for t in s["traces"]]
    differ = [k for k in set(ref_items) & set(got_items) if any(
        not np.array_equal(np.asarray(v), np.asarray(got_cache[got_items[k]][f]))
        for f, v in ref_cache[ref_items[k]].items())]
    return dict(records=len(ref_items), lost=len(set(ref_items) - set(got_items)),
                duplicated=len(traces) - len(set(traces)), torn=0,
                differ=len(differ) + len(set(got_items) - set(ref_items)))


def compare_jsonl(ref: Path, got: Path, *, key: str = "id", ignore: tuple = ()) -> dict:
    """Two JSONL files as records keyed by ``key`` (fields in ``ignore`` left out): lost, duplicated, torn lines."""
    import json

    def records(path):
        out, torn = [], 0
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                out.append({k: v for k, v in json.loads(line).items() if k not in ignore})
            except json.JSONDecodeError:
                torn += 1
        return out, torn

    (a, _), (b, torn) = records(ref), records(got)
    keys_a, keys_b = [r[key] for r in a], [r[key] for r in b]
    by_a = {r[key]: r for r in a}
    return dict(records=len(a), lost=len(set(keys_a) - set(keys_b)), duplicated=len(keys_b) - len(set(keys_b)),
                torn=torn, differ=sum(by_a.get(r[key]) != r for r in b))


def add_up(*verdicts: dict) -> dict:
    """Sum per-part verdicts (records, lost, duplicated, torn, differ)."""
    return {k: sum(v[k] for v in verdicts) for k in ("records", "lost", "duplicated", "torn", "differ")}


def _arm(kill: Kill | None, log_path: str) -> None:
    """In the child: log every rename; SIGKILL this process at ``kill``."""
    start, count, lock = time.monotonic(), [0], threading.Lock()
    real_replace = os.replace
    log = open(log_path, "a", buffering=1)

    def die():
        log.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def replace(src, dst, *a, **kw):
        with lock:
            count[0] += 1
            n = count[0]
        if kill is not None and kill.kind == "before" and n == kill.at:
            die()
        real_replace(src, dst, *a, **kw)
        log.write(f"{time.monotonic() - start:.4f} {dst}\n")
        if kill is not None and kill.kind == "after" and n == kill.at:
            die()

    os.replace = replace
    if kill is not None and kill.kind == "time":
        timer = threading.Timer(kill.at, die)
        timer.daemon = True
        timer.start()


def _child(argv: list) -> int:
    rank = int(os.environ.get("RANK", "0"))
    kill, only = os.environ["FAULTS_KILL"], os.environ["FAULTS_RANK"]
    _arm(Kill.parse(kill) if kill and (not only or int(only) == rank) else None,
         os.environ["FAULTS_LOG"].format(rank=rank))
    from tracelock.cli import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
