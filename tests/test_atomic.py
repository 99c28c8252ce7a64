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


def test_a_folder_lock_refuses_a_second_holder_and_outlives_no_killed_process(tmp_path):
    import signal
    import subprocess
    import sys

    from tracelock.atomic import FolderBusyError, folder_lock

    with folder_lock(tmp_path, "lock-a"):
        with pytest.raises(FolderBusyError, match=rf"{tmp_path} is being written by another tracelock process "
                                                  rf"\(pid {os.getpid()}\); wait for it to finish"):
            with folder_lock(tmp_path, "lock-a"):
                pass
        with folder_lock(tmp_path, "lock-b"):  # another name is another lock
            pass
    assert os.listdir(tmp_path) == []  # released and removed
    # a holder killed with SIGKILL leaves its file behind, and the next run takes the lock over
    code = (f"from tracelock.atomic import folder_lock\nwith folder_lock({str(tmp_path)!r}):\n"
            "    print(1, flush=True)\n    input()\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline() == b"1\n"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert os.listdir(tmp_path) == [".lock"]
    with folder_lock(tmp_path):
        pass
    assert os.listdir(tmp_path) == []


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    from tracelock.atomic import remove_stale_temps

    for name in (".a.json.x1.tmp", ".block-4.safetensors.x2.tmp", ".block-40.json.x3.tmp", "keep.tmp", ".lock",
                 "b.json"):
        (tmp_path / name).write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".c.json.x4.tmp").write_text("x")
    assert remove_stale_temps(tmp_path, prefix="block-4.") == 1
    assert remove_stale_temps(tmp_path) == 2
    assert sorted(os.listdir(tmp_path)) == [".lock", "b.json", "keep.tmp", "sub"]
    assert remove_stale_temps(tmp_path, recursive=True) == 1

