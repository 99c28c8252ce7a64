"""Atomic file writes: a crash leaves either the old file or the new one, never a torn one.

Everything is written to a temporary file in the destination's folder, flushed to disk, and renamed over
the destination (``os.replace`` is atomic within one file system). The temporary file is removed on failure.
"""

import json
import os
import tempfile
from pathlib import Path


def atomic_write(path, write) -> None:
    """Run ``write(tmp)`` (``tmp`` a str path beside ``path``), fsync it, then rename it to ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes the file private (0600); give it the mode a plain open() would have, or keep the old file's,
        # so that shipped files (the bundled model) stay readable by every user of an installed package
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path, data: bytes) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")
