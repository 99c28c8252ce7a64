"""The canonical trace store: compact safetensors shards, a done record per writer, a checksummed index.

Layout of a store folder::

    {prefix}-00000.safetensors   one shard: the traces' arrays concatenated, per-trace meta in the header
    done-{prefix}.json           the writer's record: its shards (file, sha256, bytes, ids) and skipped ids
    index.json                   every writer's shards merged (`write_index`), what readers open

A shard holds, for N traces: prompt tokens and lengths; final tokens, final states and commit steps; the recorded
steps; and the proposals *sparsely* (a recorded step's proposals exist only in its commit region, so a dense
[S, G] block would be mostly `NO_PROPOSAL`): per step a count, then (position, token[, fp16 confidence]) for each.
Every integer array takes the smallest unsigned type its values fit (uint8/16/32), so a testbed trace of 64
tokens costs about a kilobyte and a LLaDA one a little more. Nothing is pickled: safetensors plus JSON.

Every file is written to a temporary name and renamed (`os.replace`), the shard before the done record, so a crash
leaves either the old record or the new one, never a torn file; a shard the record does not list is overwritten
by the next writer with the same prefix. Readers check each shard's sha256 against the index.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from tracelock.atomic import atomic_write_bytes, atomic_write_json
from tracelock.integrity import read_json
from tracelock.traces.trace import NO_PROPOSAL, Trace

FORMAT, VERSION = "tracelock-traces", 1
INDEX = "index.json"


class CorruptShardError(ValueError):
    """A shard is missing, truncated or does not match its checksum."""


def _recover_hint(path: Path) -> str:
    return (f"delete {path} and re-run the same `tracelock collect` command: it resumes and decodes that shard's "
            "items again (or restore the file from a copy)")


def _smallest_uint(values: np.ndarray) -> np.ndarray:
    top = int(values.max()) if values.size else 0
    if values.size and int(values.min()) < 0:
        raise ValueError(f"negative value {int(values.min())} in an array the store keeps unsigned")
    for dtype in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dtype).max:
            return values.astype(dtype)
    return values.astype(np.int64)


def _check_trace(trace: Trace) -> None:
    """Shapes and values the format relies on, with the field named."""
    G, S = trace.gen_length, len(trace.steps)
    tid = trace.meta.get("id")
    if not isinstance(tid, str) or not tid:
        raise ValueError(f'trace.meta["id"] must be a non-empty string (unique in the store), got {tid!r}')
    for name, shape in (("final_state", (G,)), ("commit_step", (G,)), ("proposals", (S, G))):
        got = getattr(trace, name).shape
        if got != shape:
            raise ValueError(f"trace {tid}: {name} has shape {list(got)}, expected {list(shape)}")
    if trace.confidence is not None:
        if trace.confidence.shape != (S, G):
            raise ValueError(f"trace {tid}: confidence has shape {list(trace.confidence.shape)}, expected [{S}, {G}]")
        if not np.array_equal(np.isnan(trace.confidence), trace.proposals == NO_PROPOSAL):
            raise ValueError(f"trace {tid}: confidence must be NaN exactly where proposals is NO_PROPOSAL")
    if trace.commit_step.size and trace.commit_step.min() < 0:
        raise ValueError(f"trace {tid}: commit_step has negative entries; every position must be committed")
    if trace.proposals.size and trace.proposals.min() < NO_PROPOSAL:
        raise ValueError(f"trace {tid}: proposals hold negative token ids other than NO_PROPOSAL")
    if S and (np.any(np.diff(trace.steps) <= 0) or trace.steps[0] < 0 or trace.steps[-1] >= trace.num_steps):
        raise ValueError(f"trace {tid}: steps must increase within [0, num_steps={trace.num_steps})")


def _cat(arrays: list) -> np.ndarray:
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays]) if arrays else np.zeros(0, np.int64)


def encode_shard(traces: list[Trace]) -> bytes:
    """The safetensors bytes of one shard (see the module docstring for the arrays)."""
    for t in traces:
        _check_trace(t)
    has = [t.proposals != NO_PROPOSAL for t in traces]
    arrays = {
        "prompt": _cat([t.prompt for t in traces]),
        "prompt_len": np.array([len(t.prompt) for t in traces]),
        "gen_len": np.array([t.gen_length for t in traces]),
        "final": _cat([t.final for t in traces]),
        "final_state": _cat([t.final_state for t in traces]),
        "commit_step": _cat([t.commit_step for t in traces]),
        "num_steps": np.array([t.num_steps for t in traces]),
        "mask_id": np.array([t.mask_id for t in traces]),
        "steps": _cat([t.steps for t in traces]),
        "num_recorded": np.array([len(t.steps) for t in traces]),
        "prop_count": _cat([h.sum(1) for h in has]),
        "prop_pos": _cat([np.nonzero(h)[1] for h in has]),
        "prop_tok": _cat([t.proposals[h] for t, h in zip(traces, has)]),
        "has_conf": np.array([t.confidence is not None for t in traces], dtype=np.uint8),
    }
    arrays = {k: _smallest_uint(v) for k, v in arrays.items()}
    arrays["prop_conf"] = np.concatenate(
        [t.confidence[h] for t, h in zip(traces, has) if t.confidence is not None] or [np.zeros(0)]
    ).astype(np.float16)
    # settings shared by every trace of the shard are stored once
    as_json = [{k: json.dumps(v, sort_keys=True) for k, v in t.meta.items()} for t in traces]
    common = {k: v for k, v in as_json[0].items() if all(m.get(k) == v for m in as_json[1:])} if traces else {}
    common.pop("id", None)
    header = {"format": FORMAT, "version": str(VERSION),
              "common": json.dumps({k: traces[0].meta[k] for k in common}),
              "meta": json.dumps([{k: v for k, v in t.meta.items() if k not in common} for t in traces])}
    return st_save(arrays, metadata=header)


def decode_shard(data: bytes, path: Path) -> list[Trace]:
    """The traces of one shard's bytes; ``path`` names the file in errors."""
    try:
        arrays = st_load(data)
        # `load` drops the header's metadata: read it from the JSON header (8-byte length, then the JSON)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8:8 + header_len])["__metadata__"]
        common = json.loads(metadata["common"])
        metas = [dict(common, **m) for m in json.loads(metadata["meta"])]
    except (SafetensorError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise CorruptShardError(f"{path} is not a readable trace shard ({err}); {_recover_hint(path)}") from None
    if metadata.get("format") != FORMAT or int(metadata.get("version", -1)) > VERSION:
        raise ValueError(f"{path} is a {metadata.get('format')} v{metadata.get('version')} file; this tracelock reads "
                         f"{FORMAT} up to v{VERSION}: upgrade tracelock")
    a = {k: v.astype(np.float16) if k == "prop_conf" else v.astype(np.int64) for k, v in arrays.items()}
    offsets = {k: np.concatenate([[0], np.cumsum(v)]) for k, v in
               (("prompt", a["prompt_len"]), ("gen", a["gen_len"]), ("steps", a["num_recorded"]))}
    step_off = np.concatenate([[0], np.cumsum(a["prop_count"])])
    conf_pos = 0  # prop_conf holds only the traces that have confidences, in order
    out = []
    for i, meta in enumerate(metas):
        g0, g1 = offsets["gen"][i], offsets["gen"][i + 1]
        s0, s1 = offsets["steps"][i], offsets["steps"][i + 1]
        G, S = g1 - g0, s1 - s0
        rows = np.repeat(np.arange(S), a["prop_count"][s0:s1])
        k0, k1 = step_off[s0], step_off[s1]
        proposals = np.full((S, G), NO_PROPOSAL, np.int32)
        proposals[rows, a["prop_pos"][k0:k1]] = a["prop_tok"][k0:k1]
        confidence = None
        if a["has_conf"][i]:
            confidence = np.full((S, G), np.nan, np.float16)
            confidence[rows, a["prop_pos"][k0:k1]] = a["prop_conf"][conf_pos:conf_pos + k1 - k0]
            conf_pos += k1 - k0
        out.append(Trace(
            prompt=a["prompt"][offsets["prompt"][i]:offsets["prompt"][i + 1]].astype(np.int32),
            final=a["final"][g0:g1].astype(np.int32), final_state=a["final_state"][g0:g1].astype(np.uint8),
            commit_step=a["commit_step"][g0:g1].astype(np.int32), steps=a["steps"][s0:s1].astype(np.int32),
            proposals=proposals, confidence=confidence, mask_id=int(a["mask_id"][i]),
            num_steps=int(a["num_steps"][i]), meta=meta,
        ))
    return out


def _read_shard(folder: Path, entry: dict) -> bytes:
    path = folder / entry["file"]
    if not path.exists():
        raise CorruptShardError(f"{path} is missing (listed in the index with {entry['num_traces']} traces); "
                                "re-run the same `tracelock collect` command: it notices the missing shard and "
                                "decodes its items again")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != entry["bytes"] or digest != entry["sha256"]:
        raise CorruptShardError(f"{path} is corrupt or truncated ({len(data)} bytes, sha256 {digest[:12]}..., the "
                                f"index says {entry['bytes']} bytes, {entry['sha256'][:12]}...); {_recover_hint(path)}")
    return data


def _done_path(folder: Path, prefix: str) -> Path:
    return folder / f"done-{prefix}.json"


def read_done(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a valid done record ({err}); it is rewritten atomically, so this file was "
                         "edited or damaged by hand: delete it and its shards to start that writer over") from None
    if record.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} done record")
    return record


class TraceWriter:
    """Append traces to a store folder in shards of ``shard_size``; reopening resumes the same ``prefix``.

    Args:
        directory (str | Path): the store folder (created if missing).
        shard_size (int): traces per shard. Default: 64.
        prefix (str): this writer's file prefix; concurrent writers (ranks) need distinct ones. Default: "traces".
        on_shard (callable, optional): called with each shard's entry once its done record is on disk.

    ``extra`` is a JSON-able dict kept in the done record (e.g. a running time); ``skip(id, reason)`` records an
    item that produced no trace, so a resumed run does not redo it. On reopening, shards the record lists but whose
    file is gone are dropped from the record (their items count as not done); a corrupt one is an error.
    """

    def __init__(self, directory, *, shard_size: int = 64, prefix: str = "traces", on_shard=None):
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"shard_size={shard_size!r} must be a positive int (traces per shard)")
        if not prefix or not all(c.isalnum() or c in "-_" for c in prefix):
            raise ValueError(f"prefix={prefix!r} must be non-empty letters, digits, '-' or '_'")
        self.folder, self.shard_size, self.prefix, self.on_shard = Path(directory), shard_size, prefix, on_shard
        self.folder.mkdir(parents=True, exist_ok=True)
        path = _done_path(self.folder, prefix)
        record = read_done(path) if path.exists() else {}
        self.shards, self.skipped = [], dict(record.get("skipped", {}))
        self.extra = dict(record.get("extra", {}))
        for entry in record.get("shards", []):
            if not (self.folder / entry["file"]).exists():
                print(f"tracelock: {self.folder / entry['file']} is missing; its {entry['num_traces']} items will be "
                      "decoded again", file=sys.stderr)
                continue
            _read_shard(self.folder, entry)
            self.shards.append(entry)
        self._next = max((int(e["file"].rsplit("-", 1)[1].split(".")[0]) + 1 for e in self.shards), default=0)
        self._buffer, self._written = [], {i for e in self.shards for i in e["ids"]}
        self._write_record()

    def done_ids(self) -> set:
        """Ids written to a shard or skipped, as of this writer's record and buffer."""
        return self._written | set(self.skipped) | {t.meta["id"] for t in self._buffer}

    def add(self, trace: Trace) -> None:
        _check_trace(trace)
        if trace.meta["id"] in self.done_ids():
            raise ValueError(f"trace id {trace.meta['id']!r} is already in the store; ids must be unique")
        self._buffer.append(trace)
        if len(self._buffer) >= self.shard_size:
            self.flush()

    def skip(self, item_id: str, reason: str) -> None:
        if item_id in self.done_ids():
            raise ValueError(f"item id {item_id!r} is already in the store; ids must be unique")
        self.skipped[item_id] = reason

    def flush(self) -> None:
        """Write the buffered traces as one shard (if any), then the done record."""
        entry = None
        if self._buffer:
            name = f"{self.prefix}-{self._next:05d}.safetensors"
            data = encode_shard(self._buffer)
            atomic_write_bytes(self.folder / name, data)
            entry = dict(file=name, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data),
                         num_traces=len(self._buffer), ids=[t.meta["id"] for t in self._buffer])
            self.shards.append(entry)
            self._written.update(entry["ids"])
            self._buffer, self._next = [], self._next + 1
        self._write_record()
        if entry is not None and self.on_shard is not None:
            self.on_shard(entry)

    def close(self, write_index: bool = True) -> None:
        """Flush; with ``write_index`` also merge every writer's record into ``index.json`` (one writer at a time:
        under torchrun rank 0 does it after a barrier)."""
        self.flush()
        if write_index:
            build_index(self.folder)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()

    def _write_record(self) -> None:
        atomic_write_json(_done_path(self.folder, self.prefix),
                          dict(format=FORMAT, version=VERSION, prefix=self.prefix, shards=self.shards,
                               skipped=self.skipped, extra=self.extra))


def done_records(directory) -> dict:
    """{prefix: done record} of every writer in the folder."""
    folder = Path(directory)
    return {p.name[len("done-"):-len(".json")]: read_done(p) for p in sorted(folder.glob("done-*.json"))}


def stored_ids(directory, *, exclude: str | None = None) -> set:
    """Ids that the folder's writers (all but the ``exclude`` prefix) have written to a shard or skipped."""
    return {i for prefix, rec in done_records(directory).items() if prefix != exclude
            for i in [*rec["skipped"], *(j for e in rec["shards"] for j in e["ids"])]}


def build_index(directory) -> dict:
    """Merge every writer's done record into ``index.json`` (atomically) and return it."""
    folder = Path(directory)
    shards = [e for rec in done_records(folder).values() for e in rec["shards"]]
    ids = [i for e in shards for i in e["ids"]]
    if len(ids) != len(set(ids)):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"{folder}: trace ids appear in more than one shard ({dup}...); two writers wrote the same "
                         "items: keep one collection per folder")
    index = dict(format=FORMAT, version=VERSION, num_traces=len(ids), bytes=sum(e["bytes"] for e in shards),
                 shards=shards)
    atomic_write_json(folder / INDEX, index)
    return index


def _entry_ok(entry) -> bool:
    """A shard entry of the index or a done record has the fields readers rely on, with their JSON types."""
    return (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("ids"), list)
            and isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int))


def load_index(directory) -> dict:
    """The folder's ``index.json``: {format, version, num_traces, bytes, shards: [{file, sha256, bytes, ids}]}."""
    path = Path(directory) / INDEX
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: not a trace store, or its collection has not finished; "
                                "re-run `tracelock collect` with the same arguments to resume and write it")
    # the index is rebuilt from the writers' done records by every finished collect
    fix = "re-run the same `tracelock collect` command: it finds every shard done and writes the index again"
    index = read_json(path, fix=fix)
    if index.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} index")
    shards = index.get("shards")
    if not isinstance(shards, list) or not all(map(_entry_ok, shards)):
        raise CorruptShardError(f"{path} does not list its shards as {{file, sha256, bytes, ids}} entries; {fix}")
    return index


def iter_traces(directory, *, check: bool = True) -> Iterator[Trace]:
    """Every trace of the store, shard by shard in index order; each shard's checksum is checked first."""
    folder = Path(directory)
    for entry in load_index(folder)["shards"]:
        path = folder / entry["file"]
        data = _read_shard(folder, entry) if check else path.read_bytes()
        traces = decode_shard(data, path)
        if [t.meta.get("id") for t in traces] != entry["ids"]:  # never a silently shorter or other data set
            raise CorruptShardError(f"{path} holds other traces than {INDEX} lists for it; {_recover_hint(path)}")
        yield from traces


def verify(directory) -> dict:
    """Check every shard (present, checksum, decodable, ids as indexed); returns {shards, traces, bytes}."""
    folder = Path(directory)
    index = load_index(folder)
    for entry in index["shards"]:
        path = folder / entry["file"]
        ids = [t.meta.get("id") for t in decode_shard(_read_shard(folder, entry), path)]
        if ids != entry["ids"]:
            raise CorruptShardError(f"{path} holds other traces than the index lists; {_recover_hint(path)}")
    return dict(shards=len(index["shards"]), traces=index["num_traces"], bytes=index["bytes"])


def store_bytes_per_trace(directory) -> float:
    """Shard bytes (tokens, proposals, per-trace meta) per stored trace."""
    index = load_index(directory)
    return index["bytes"] / index["num_traces"] if index["num_traces"] else float("nan")
