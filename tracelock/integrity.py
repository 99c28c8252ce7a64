"""Reading tracelock's own files defensively: a damaged file is a `CorruptFileError` that names it and the fix.

safetensors files written with `save_tensors` carry a sha256 of their tensors in their header, so `load_tensors`
catches a flipped bit anywhere, as it does a truncated file or a broken header (files written before the digest
existed load unchecked). JSON files are read with `read_json`, which names the file when it does not parse or is
not an object. Nothing here ever writes to the file it reads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tracelock.atomic import atomic_write

__all__ = ["CorruptFileError", "load_tensors", "read_json", "read_tagged_json", "require_pair", "save_tensors",
           "tensors_digest"]

DIGEST_KEY = "tracelock_sha256"  # the only metadata key: safetensors orders several keys differently per process


class CorruptFileError(ValueError):
    """A file tracelock wrote is truncated, damaged or not what its name says."""


def tensors_digest(tensors: dict) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    import torch  # here, not at import: the CLI's parser reaches this module and must not load torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_tensors(path, tensors: dict) -> None:
    """Write ``tensors`` to ``path`` atomically, with their digest in the header."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    metadata = {DIGEST_KEY: tensors_digest(tensors)}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def load_tensors(path, *, fix: str) -> dict:
    """The tensors of a safetensors file (on the CPU); ``fix`` says what to do when it is missing or damaged."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {fix}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise CorruptFileError(f"{path} is not a readable safetensors file ({err}); {fix}") from None
    want = metadata.get(DIGEST_KEY)
    if want is not None and tensors_digest(tensors) != want:
        raise CorruptFileError(f"{path} is corrupt: its tensors do not match the sha256 recorded when it was "
                               f"written; {fix}")
    return tensors


def read_json(path, *, fix: str) -> dict:
    """A JSON object from ``path``; ``fix`` says what to do when the file is missing, torn or not an object."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing; {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"{path} is not valid JSON ({err}); {fix}") from None
    if not isinstance(obj, dict):
        raise CorruptFileError(f"{path} holds a JSON {type(obj).__name__}, not an object; {fix}")
    return obj


def read_tagged_json(path, *, key: str, tag: str, what: str, fix: str) -> dict:
    """The JSON object in ``path`` without its ``key`` field, which names what the file is and must be ``tag``
    (else ``PATH is not a WHAT``, a `CorruptFileError`); ``fix`` as in `read_json`."""
    obj = read_json(path, fix=fix)
    if obj.pop(key, None) != tag:
        raise CorruptFileError(f"{path} is not a {what}; {fix}")
    return obj


def require_pair(path: Path, beside: Path, *, what: str, hint: str) -> None:
    """A saved ``what`` is two files, ``path`` and ``beside`` it (weights and their config): a missing one is a
    FileNotFoundError that names both, ``no WHAT at PATH (+ BESIDE); HINT``."""
    if not path.is_file() or not beside.is_file():
        raise FileNotFoundError(f"no {what} at {path} (+ {beside.name}); {hint}")
