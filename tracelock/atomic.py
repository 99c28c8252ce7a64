"""Atomic file writes: a crash leaves either the old file or the new one, never a torn one.

Everything is written to a temporary file in the destination's folder, flushed to disk, and renamed over
the destination (``os.replace`` is atomic within one file system). The temporary file is removed on failure;
a full disk is a `DiskFullError` naming the file. A process killed mid-write leaves its temporary file
(``.NAME.XXXXXXXX.tmp``), never read by anyone; `remove_stale_temps` deletes them once a job has its folder to
itself. `folder_lock` keeps two jobs from writing one output folder at once.
"""

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

# a failed write on a file system with less free space than this counts as a full disk: numpy and safetensors
# report ENOSPC without an errno ("N requested and M written", "I/O error: No space left on device")
_FULL_BELOW = 1 << 20


class OutputError(OSError):
    """An output folder cannot be written: the disk is full, or another process holds it."""


class DiskFullError(OutputError):
    """No space left on the device while writing a file (the file is left as it was)."""


class FolderBusyError(OutputError):
    """Another process is writing the same output folder."""


def _disk_full(err: BaseException, folder: Path) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # numpy's short write has no errno; safetensors raises its own error type
    if not (isinstance(err, OSError) and err.errno is None or type(err).__name__ == "SafetensorError"):
        return False
    try:
        return shutil.disk_usage(folder).free < _FULL_BELOW
    except OSError:
        return False


@contextlib.contextmanager
def disk_full_named(path):
    """Turn a failed write of ``path`` on a full disk into a `DiskFullError` that names the file and the fix."""
    try:
        yield
    except Exception as err:
        if isinstance(err, DiskFullError) or not _disk_full(err, Path(path).parent):
            raise
        raise DiskFullError(errno.ENOSPC, f"no space left on the device while writing {path} ({err}); the file "
                            "was left as it was: free some space (or pass another --out) and run the same command "
                            "again") from None


def atomic_write(path, write) -> None:
    """Run ``write(tmp)`` (``tmp`` a str path beside ``path``), fsync it, then rename it to ``path``."""
    path = Path(path)
    with disk_full_named(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with disk_full_named(path):
            write(tmp)
        # mkstemp makes the file private (0600); give it the mode a plain open() would have, or keep the old file's,
        # so that shipped files (the bundled model) stay readable by every user of an installed package
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask())
        with open(tmp, "rb") as f, disk_full_named(path):
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


def remove_stale_temps(folder, *, prefix: str = "", recursive: bool = False) -> int:
    """Delete the temporary files that killed writers left in ``folder`` (only ``.{prefix}*.tmp``); returns how
    many. Call it only while no other process writes there (under `folder_lock`, or after every rank finished)."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    found = [p for p in (folder.rglob if recursive else folder.glob)(f".{prefix}*.tmp") if p.is_file()]
    for path in found:
        path.unlink(missing_ok=True)
    return len(found)


@contextlib.contextmanager
def folder_lock(folder, name: str = "lock"):
    """Hold ``folder/.{name}`` exclusively while the block runs; a second holder gets `FolderBusyError` at once.

    The lock is an flock: the kernel drops it when its process dies, so a killed job never blocks the next run.
    The file is removed on a clean exit (a killed job leaves it, harmlessly, for the next run to take over).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".{name}"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderBusyError(errno.EBUSY, f"{folder} is being written by another tracelock process (pid "
                                  f"{holder}); wait for it to finish, or pass another --out") from None
        # the previous holder may have removed the file between our open and our lock: lock the current one
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield path
    finally:
        path.unlink(missing_ok=True)  # while still holding it, so nobody locks a file about to vanish
        os.close(fd)
