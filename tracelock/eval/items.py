"""An eval run's item records: one JSON object per line (``items-rank*.jsonl``), appended as items decode, read
back by the runner (to resume), the judge and the report."""

import json
import os
from pathlib import Path

from tracelock.atomic import DiskFullError, disk_full_named


def read_items(path: Path) -> dict:
    """{id: record} of an items JSONL; a torn last line (a crash mid-append) is dropped, a later line wins."""
    out = {}
    if not path.exists():
        return out
    lines = path.read_text().split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n >= len(lines) - 1:  # the last line: a torn append
                break
            raise ValueError(f"{path}:{n} is not valid JSON; delete the file to decode its items again") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise ValueError(f"{path}:{n} is not an item record (an object with a string \"id\"); delete the file "
                             "to decode its items again")
        out[rec["id"]] = rec
    return out


def append_items(path: Path, records: list) -> None:
    """Append item records to a JSONL file, whole lines only (a full disk leaves no torn line)."""
    with open(path, "a") as f:
        size = f.tell()
        try:
            with disk_full_named(path):
                f.write("".join(json.dumps(r) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
        except DiskFullError:
            f.truncate(size)  # no torn line left behind: the batch is decoded again on the next run
            raise


def ensure_trailing_newline(path: Path) -> None:
    """Cut a torn last line so the next append starts a fresh one."""
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            path.write_bytes(data[:data.rfind(b"\n") + 1])


def folder_items(folder: Path) -> dict:
    """{id: record} over every rank's items JSONL of one (setting, policy) folder."""
    records = {}
    for path in sorted(folder.glob("items-rank*.jsonl")):
        records.update(read_items(path))
    return records


def compact_records(per_point: dict) -> dict:
    """``{label: {id: record}}`` as the compact, pairable per-item record: the ids every point holds, once, and per
    label a string of 0/1 (correct) and the list of steps, in id order."""
    ids = sorted(set.intersection(*(set(r) for r in per_point.values())))
    return dict(ids=ids, points={label: dict(correct="".join("1" if r[i]["correct"] else "0" for i in ids),
                                              steps=[r[i]["steps"] for i in ids])
                                 for label, r in per_point.items()})
