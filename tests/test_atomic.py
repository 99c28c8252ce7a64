"""Atomic writes: all or nothing, and files with the mode a plain write would give them."""

import os
import stat

import pytest

from tracelock.atomic import atomic_write, atomic_write_text


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_file_gets_the_umask_mode_not_mkstemps_private_one(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        assert _mode(tmp_path / "a.txt") == 0o644
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.txt", "x")
        assert _mode(tmp_path / "b.txt") == 0o600
    finally:
        os.umask(old)


def test_replacing_keeps_the_old_files_mode(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    os.chmod(path, 0o640)
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and _mode(path) == 0o640


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")

    def broken(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(path, broken)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]
