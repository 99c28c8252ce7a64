"""The feature cache: encoder codes of every position at every replayed step of a set of traces.

`featurize` replays each trace through the frozen backbone (`tracelock.traces.replay`), encodes the three
taps with a `TapEncoder` and appends one item per (trace, step) to a shard. A shard is a handful of raw ``.npy``
files (no pickle; opened with ``mmap_mode="r"``), rows = positions of all its items back to back:

- ``codes`` [R, C] float16, or int8 with ``scale`` [R] float32 (``codes = q * scale``, ``|error| <= scale / 2``)
- ``state`` [R] uint8, ``label`` [R] int8, ``eot`` [R] bool, ``confidence`` [R] float16
- ``items`` [n, 5] int64: trace number in the shard, step, first row, length, prompt length

``index.json`` lists the shards with each file's shape, dtype and sha256, the traces of each shard and the
encoder's digest. Files and the index are written atomically (temp file + rename) and the index last, so a crash
loses at most the shard being built; a rerun skips every trace the index already holds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from tracelock import states
from tracelock.atomic import atomic_write, atomic_write_json, folder_lock, remove_stale_temps
from tracelock.traces.replay import replay

FORMAT = "tracelock-feature-cache/1"
INDEX = "index.json"
DTYPES = ("fp16", "int8")
STEP_MODES = ("recorded", "all")
# per-row columns other than the codes, with their on-disk dtypes
ROW_FIELDS = {"state": np.uint8, "label": np.int8, "eot": np.bool_, "confidence": np.float16}


class CacheCorruptError(ValueError):
    """A cache file does not match its index entry (checksum, shape or dtype)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_npy(path: Path, arr: np.ndarray) -> dict:
    def write(tmp):
        with open(tmp, "wb") as f:
            np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)

    atomic_write(path, write)
    return dict(file=path.name, shape=list(arr.shape), dtype=arr.dtype.str, sha256=_sha256(path),
                bytes=path.stat().st_size)


def quantise_int8(codes: np.ndarray) -> tuple:
    """[R, C] float -> (q [R, C] int8, scale [R] float32) with ``q * scale`` within ``scale / 2`` of ``codes``."""
    scale = (np.abs(codes).max(axis=1) / 127.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(codes / safe[:, None]), -127, 127).astype(np.int8)
    return q, scale


def _trace_items(model, encoder, trace, steps, batch_size):
    """One dict of per-row arrays per replayed step of ``trace``."""
    P, G = len(trace.prompt), trace.gen_length
    final = torch.from_numpy(trace.final.astype(np.int64)).to(model.device)
    eot = np.zeros(P + G, np.bool_)
    eot[P:] = trace.final_is_eot()
    for step, taps, props, conf in replay(model, trace, steps, batch_size=batch_size):
        state = trace.state_at(step)
        active = state[P:] == states.ACTIVE
        label = np.full(P + G, -1, np.int8)
        label[P:][active] = (props == final).cpu().numpy()[active]
        confidence = np.zeros(P + G, np.float16)
        confidence[P:] = conf.cpu().numpy()
        yield step, dict(codes=encoder.codes(*taps).cpu().numpy(), state=state, label=label, eot=eot,
                         confidence=confidence), P


class _ShardBuilder:
    def __init__(self, dtype):
        self.dtype, self.traces, self.items, self.rows, self.nbytes = dtype, [], [], [], 0

    def add_trace(self, trace_id, items):
        start, offset = len(self.items), sum(len(r["state"]) for r in self.rows)
        for step, arrays, prompt_len in items:
            codes = arrays["codes"]
            if self.dtype == "fp16":
                half = codes.astype(np.float16)
                if not np.isfinite(half).all():
                    raise ValueError(f"trace {trace_id!r} step {step}: codes overflow float16 (max |code| "
                                     f"{np.abs(codes).max():.3g}); featurize with --cache-dtype int8")
                arrays = dict(arrays, codes=half)
            else:
                q, scale = quantise_int8(codes)
                arrays = dict(arrays, codes=q, scale=scale)
            n = len(arrays["state"])
            self.items.append((len(self.traces), step, offset, n, prompt_len))
            self.rows.append(arrays)
            self.nbytes += sum(a.nbytes for a in arrays.values())
            offset += n
        self.traces.append(dict(id=trace_id, items=[start, len(self.items)]))

    def write(self, folder: Path, name: str) -> dict:
        fields = ["codes"] + (["scale"] if self.dtype == "int8" else []) + list(ROW_FIELDS)
        files = {f: _write_npy(folder / f"{name}.{f}.npy", np.concatenate([r[f] for r in self.rows]))
                 for f in fields}
        files["items"] = _write_npy(folder / f"{name}.items.npy", np.array(self.items, np.int64).reshape(-1, 5))
        return dict(name=name, traces=self.traces, files=files)


def _open_index(out: Path, header: dict) -> dict:
    path = out / INDEX
    if not path.exists():
        return dict(header, shards=[])
    index = _read_index(path)
    for key in ("dtype", "steps", "code_dim"):
        if index.get(key) != header[key]:
            raise ValueError(f"{out} already holds a cache with {key}={index.get(key)!r}, not {header[key]!r}; "
                             "featurize into a new --out folder")
    if index["encoder"]["digest"] != header["encoder"]["digest"]:
        raise ValueError(f"{out} already holds a cache built with another encoder (digest "
                         f"{index['encoder']['digest'][:12]}); featurize into a new --out folder")
    return index


def _read_index(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: build the cache with `tracelock featurize --out "
                                f"{path.parent}`")
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CacheCorruptError(f"{path} is not valid JSON ({err}); rebuild the cache") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise CacheCorruptError(f"{path}: format {found!r}, expected {FORMAT!r}; rebuild the cache")
    if not _index_ok(index):
        raise CacheCorruptError(f"{path} does not hold a valid cache index (code_dim, groups, shards with their "
                                f"traces and files); delete {path.parent} and rerun `tracelock featurize`")
    return index


def _file_ok(meta) -> bool:
    return (isinstance(meta, dict) and isinstance(meta.get("file"), str) and isinstance(meta.get("shape"), list)
            and isinstance(meta.get("dtype"), str) and isinstance(meta.get("sha256"), str))


def _shard_ok(shard) -> bool:
    return (isinstance(shard, dict) and isinstance(shard.get("files"), dict) and "items" in shard["files"]
            and all(map(_file_ok, shard["files"].values())) and isinstance(shard.get("traces"), list)
            and all(isinstance(t, dict) and isinstance(t.get("id"), str) for t in shard["traces"]))


def _index_ok(index: dict) -> bool:
    """The fields readers rely on, with their JSON types."""
    code_dim = index.get("code_dim")
    return (isinstance(code_dim, int) and not isinstance(code_dim, bool) and code_dim > 0
            and isinstance(index.get("groups"), dict) and isinstance(index.get("shards"), list)
            and all(map(_shard_ok, index["shards"])))


def featurize(model, encoder, traces, out, *, dtype: str = "fp16", steps: str = "recorded", batch_size: int = 8,
              shard_bytes: int = 256 << 20) -> dict:
    """Build (or extend) the feature cache in ``out`` from ``traces``.

    Args:
        model (DiffusionBackbone): the frozen backbone the traces were decoded with.
        encoder (TapEncoder): must match the backbone (`TapEncoder.check_backbone`).
        traces (iterable of Trace): each with a unique ``meta["id"]``; ids already in the cache are skipped.
        out (str | Path): cache folder.
        dtype (str): "fp16" or "int8" (per-row scale). Default: "fp16".
        steps (str): "recorded" (the trace's recorded steps) or "all" (every forward). Default: "recorded".
        batch_size (int): steps per backbone forward. Default: 8.
        shard_bytes (int): a shard is written once it holds this many bytes. Default: 256 MiB.

    Returns:
        dict: traces added and skipped, items added, shards written.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {DTYPES}")
    if steps not in STEP_MODES:
        raise ValueError(f"steps={steps!r}: choose one of {STEP_MODES}")
    encoder.check_backbone(model)
    encoder = encoder.to(model.device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    header = dict(format=FORMAT, dtype=dtype, steps=steps, code_dim=encoder.code_dim, groups=encoder.groups,
                  encoder=dict(digest=encoder.digest(), config=encoder.config()))
    with folder_lock(out):  # one writer per cache folder
        index = _open_index(out, header)
        done = {t["id"] for s in index["shards"] for t in s["traces"]}
        summary = dict(added=0, skipped=0, items=0, shards=0)
        builder = _ShardBuilder(dtype)

        def flush():
            nonlocal builder
            if builder.traces:
                index["shards"].append(builder.write(out, f"shard-{len(index['shards']):05d}"))
                atomic_write_json(out / INDEX, index)
                summary["shards"] += 1
            builder = _ShardBuilder(dtype)

        seen = set()
        for trace in traces:
            trace_id = trace.meta.get("id")
            if not isinstance(trace_id, str) or not trace_id:
                raise ValueError("every trace needs a string meta['id'] (the cache's resume key); the trace store "
                                 "assigns one")
            if trace_id in seen:
                raise ValueError(f"trace id {trace_id!r} appears twice in the input; trace ids must be unique")
            seen.add(trace_id)
            if trace_id in done:
                summary["skipped"] += 1
                continue
            which = trace.steps if steps == "recorded" else np.arange(trace.num_steps)
            items = list(_trace_items(model, encoder, trace, which, batch_size))
            builder.add_trace(trace_id, items)
            summary["added"] += 1
            summary["items"] += len(items)
            if builder.nbytes >= shard_bytes:
                flush()
        flush()
        if not (out / INDEX).exists():
            atomic_write_json(out / INDEX, index)
        remove_stale_temps(out)  # shard files a killed run left half-written
        return summary


class FeatureCache:
    """Read a feature cache: one item per (trace, step), opened lazily with ``mmap_mode="r"``.

    Args:
        folder (str | Path): the cache folder (``tracelock featurize --out``).
        verify (bool): check each shard's sha256 against the index the first time it is opened (a mismatch
            raises `CacheCorruptError`). Default: True.

    ``cache[i]`` is a dict: codes [L, C] float32 (dequantised), state [L] uint8, label [L] int8 (1/0 for positions
    active at that step, -1 elsewhere), eot [L] bool, confidence [L] float32, prompt_len, trace_id, step.
    """

    def __init__(self, folder, verify: bool = True):
        self.folder = Path(folder)
        self.index = _read_index(self.folder / INDEX)
        self.verify = verify
        self.code_dim = int(self.index["code_dim"])
        self.groups = {k: list(v) for k, v in self.index["groups"].items()}
        self.dtype = self.index["dtype"]
        self._shards = [None] * len(self.index["shards"])
        self._items, self.trace_ids, self._item_trace = [], [], []
        for s, shard in enumerate(self.index["shards"]):
            items = self._load(shard, "items", mmap=False)
            for t in shard["traces"]:
                lo, hi = t["items"]
                self._item_trace.extend([len(self.trace_ids)] * (hi - lo))
                self.trace_ids.append(t["id"])
            self._items.append(np.column_stack([np.full(len(items), s), items]))
        self._items = np.concatenate(self._items) if self._items else np.zeros((0, 6), np.int64)
        self._item_trace = np.array(self._item_trace, np.int64)

    def _load(self, shard: dict, field: str, mmap: bool = True) -> np.ndarray:
        meta = shard["files"][field]
        path = self.folder / meta["file"]
        if not path.is_file():
            raise CacheCorruptError(f"{path} is missing from the cache in {self.folder}; rebuild the cache")
        if self.verify and _sha256(path) != meta["sha256"]:
            raise CacheCorruptError(f"{path} is corrupt (sha256 differs from {INDEX}); delete {self.folder} and "
                                    "rerun `tracelock featurize`")
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        if list(arr.shape) != meta["shape"] or arr.dtype.str != meta["dtype"]:
            raise CacheCorruptError(f"{path}: shape {arr.shape} / dtype {arr.dtype.str} differ from {INDEX} "
                                    f"({meta['shape']} / {meta['dtype']}); rebuild the cache")
        return arr

    def _shard(self, s: int) -> dict:
        if self._shards[s] is None:
            shard = self.index["shards"][s]
            self._shards[s] = {f: self._load(shard, f) for f in shard["files"] if f != "items"}
        return self._shards[s]

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"item {i} out of range for a cache of {len(self)} items")
        s, tnum, step, row, n, prompt_len = (int(v) for v in self._items[i])
        arrays = self._shard(s)
        rows = slice(row, row + n)
        codes = np.asarray(arrays["codes"][rows], dtype=np.float32)
        if "scale" in arrays:
            codes *= arrays["scale"][rows][:, None]
        return dict(codes=codes, state=np.array(arrays["state"][rows]), label=np.array(arrays["label"][rows]),
                    eot=np.array(arrays["eot"][rows]), confidence=arrays["confidence"][rows].astype(np.float32),
                    prompt_len=prompt_len, trace_id=self.trace_ids[self._item_trace[i]], step=step)

    def split(self, fraction: float, seed: int = 0) -> tuple:
        """(train_indices, val_indices) of the items, split by trace: ``fraction`` of the traces (at least one,
        and at least one left for training when there are two or more) go to validation."""
        if not 0 < fraction < 1:
            raise ValueError(f"fraction={fraction} must be in (0, 1): the share of traces held out for validation")
        n = len(self.trace_ids)
        if n < 2:
            raise ValueError(f"the cache holds {n} trace(s); a split by trace needs at least 2")
        n_val = min(max(round(fraction * n), 1), n - 1)
        val_traces = np.random.default_rng(seed).permutation(n)[:n_val]
        is_val = np.isin(self._item_trace, val_traces)
        return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def cache_bytes_per_trace(folder) -> float:
    """Bytes on disk (shard files and index) per trace of the cache in ``folder``."""
    folder = Path(folder)
    index = _read_index(folder / INDEX)
    n = sum(len(s["traces"]) for s in index["shards"])
    if n == 0:
        raise ValueError(f"the cache in {folder} holds no traces")
    files = [folder / f["file"] for s in index["shards"] for f in s["files"].values()]
    return (sum(p.stat().st_size for p in files) + (folder / INDEX).stat().st_size) / n
