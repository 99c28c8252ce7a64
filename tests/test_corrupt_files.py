"""Corrupted and foreign files: every reader refuses a truncated, bit-flipped, torn or foreign file with an error that
names the file and says what to do (never a deep traceback, never a silently shorter data set), and leaves every
file as it was. Two writers of one folder: the second is refused. A full disk: a clear error and no torn file.

Real files written by the real writers, then damaged on disk; ``-s`` prints the table (reader, damage, message)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tracelock
from tracelock.atomic import FolderBusyError, OutputError
from tracelock.models import write_tiny_checkpoint
from tracelock.testing import fresh_controller

pytestmark = pytest.mark.usefixtures("one_thread")
# what a clear refusal raises: the CLI prints these as one line (`tracelock.cli.main`), without a traceback
CLEAR = (ValueError, TypeError, FileNotFoundError, OutputError)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One real file of every kind, written by its real writer."""
    from tracelock.eval.runner import parse_policies, parse_settings, run_eval
    from tracelock.features import load_encoder
    from tracelock.l2p.data import block_examples
    from tracelock.l2p.train import fit_filter
    from tracelock.recording.collect import collect
    from tracelock.traces.cache import featurize
    from tracelock.traces.filters import TraceFilterConfig
    from tracelock.traces.store import iter_traces
    from tracelock.train.fit import TrainConfig, train

    root = tmp_path_factory.mktemp("made")
    model_dir = write_tiny_checkpoint(root / "llada", family="llada", seed=3)
    model = tracelock.load_model(model_dir)
    fresh_controller(model, folder=root / "controller")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"add {i} and {i + 2}"}) + "\n" for i in range(6)))
    collect(model_dir, str(prompts), root / "traces", gen_length=8, block=4, batch_size=3, shard_size=2,
            keep_confidence=True, filters=TraceFilterConfig(enabled=False))
    encoder = load_encoder(root / "controller", model)
    featurize(model, encoder, iter_traces(root / "traces"), root / "cache", shard_bytes=2000)
    train(TrainConfig(cache=str(root / "cache"), out=str(root / "run"), steps=2, batch_size=4, eval_every=1,
                      width=32, layers=1, heads=2, ffn=48, dropout=0.0, device="cpu"))
    inputs, labels, groups = block_examples(model, iter_traces(root / "traces"), 4)
    fit_filter(inputs, labels, groups, family="llada", eos_id=model.spec.eos_id, backbone={}, epochs=5,
               val_fraction=0.0).save(root / "filters")
    run_eval(model_dir, "testbed:math", parse_policies("confidence"), parse_settings("8/4"), root / "eval", n=3,
             batch_size=3, workers=1)
    return root


def _copy(made: Path, tmp_path: Path, name: str) -> Path:
    src = made / name
    dst = tmp_path / name
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    return dst


def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


def _flip(offset_from_end: int):
    def damage(path: Path):
        data = bytearray(path.read_bytes())
        data[-offset_from_end] ^= 0x10
        path.write_bytes(bytes(data))
    return damage


def _flip_header(path: Path):
    data = bytearray(path.read_bytes())
    data[12] ^= 0x01  # inside a safetensors header's JSON, or a JSON file's first keys
    path.write_bytes(bytes(data))


def _edit_json(change):
    def damage(path: Path):
        obj = json.loads(path.read_text())
        change(obj)
        path.write_text(json.dumps(obj))
    return damage


def _append(text: str):
    def damage(path: Path):
        with open(path, "a") as f:
            f.write(text)
    return damage


def _load_model(folder):
    return lambda: tracelock.load_model(folder)


def _read_store(folder):
    from tracelock.traces.store import iter_traces
    return lambda: list(iter_traces(folder))


def _read_cache(folder):
    from tracelock.traces.cache import FeatureCache

    def read():
        cache = FeatureCache(folder)
        return [cache[i] for i in range(len(cache))]
    return read


def _load_controller(folder):
    from tracelock.policies.tracelock import TraceLockPolicy
    return lambda: TraceLockPolicy(folder)


def _load_filters(folder):
    from tracelock.l2p.filter import load_filters
    return lambda: load_filters(folder)


def _resume_train(folder, cache):
    from tracelock.train.fit import TrainConfig, train
    return lambda: train(TrainConfig(cache=str(cache), out=str(folder), steps=3, batch_size=4, eval_every=1, width=32,
                                     layers=1, heads=2, ffn=48, dropout=0.0, device="cpu"), resume=True)


def _read_items(folder):
    from tracelock.eval.runner import folder_items
    return lambda: folder_items(folder)


def _read_prompts(path):
    from tracelock.recording.collect import load_items
    return lambda: load_items(str(path), None)


# (reader, damage, what to copy, file to damage (relative to the copy's parent), damage, read(copy, made))
CASES = [
    ("model checkpoint", "truncated model.safetensors", "llada", "llada/model.safetensors", _truncate,
     lambda c, m: _load_model(c)),
    ("model checkpoint", "bit flip in the safetensors header", "llada", "llada/model.safetensors", _flip_header,
     lambda c, m: _load_model(c)),
    ("model checkpoint", "config.json not JSON", "llada", "llada/config.json", _truncate,
     lambda c, m: _load_model(c)),
    ("model checkpoint", "config.json with wrong types", "llada", "llada/config.json",
     _edit_json(lambda o: o.update(num_hidden_layers="two", d_model=None)), lambda c, m: _load_model(c)),
    ("model checkpoint", "config.json with a negative size", "llada", "llada/config.json",
     _edit_json(lambda o: o.update(n_layers=-1)), lambda c, m: _load_model(c)),
    ("trace store", "truncated shard", "traces", "traces/rank0-00001.safetensors", _truncate,
     lambda c, m: _read_store(c)),
    ("trace store", "bit flip in a shard", "traces", "traces/rank0-00001.safetensors", _flip(3),
     lambda c, m: _read_store(c)),
    ("trace store", "index lists ids its shard does not hold", "traces", "traces/index.json",
     _edit_json(lambda o: o["shards"][0]["ids"].append("prompts:99")), lambda c, m: _read_store(c)),
    ("trace store", "index lists a missing shard", "traces", "traces/index.json",
     _edit_json(lambda o: o["shards"].append(dict(o["shards"][0], file="rank0-00099.safetensors"))),
     lambda c, m: _read_store(c)),
    ("trace store", "index.json torn", "traces", "traces/index.json", _truncate, lambda c, m: _read_store(c)),
    ("trace store", "index.json with wrong types", "traces", "traces/index.json",
     _edit_json(lambda o: o.update(shards={"a": 1})), lambda c, m: _read_store(c)),
    ("trace store", "done record torn (resume)", "traces", "traces/done-rank0.json", _truncate,
     lambda c, m: lambda: tracelock.traces.store.TraceWriter(c, prefix="rank0")),
    ("feature cache", "truncated codes file", "cache", "cache/shard-00000.codes.npy", _truncate,
     lambda c, m: _read_cache(c)),
    ("feature cache", "bit flip in a codes file", "cache", "cache/shard-00000.codes.npy", _flip(5),
     lambda c, m: _read_cache(c)),
    ("feature cache", "index shape disagrees with the file", "cache", "cache/index.json",
     _edit_json(lambda o: o["shards"][0]["files"]["state"].update(shape=[3])), lambda c, m: _read_cache(c)),
    ("feature cache", "index.json torn", "cache", "cache/index.json", _truncate, lambda c, m: _read_cache(c)),
    ("feature cache", "index.json with wrong types", "cache", "cache/index.json",
     _edit_json(lambda o: o.update(code_dim="twelve")), lambda c, m: _read_cache(c)),
    ("controller folder", "best.json missing", "controller", "controller/best.json", lambda p: p.unlink(),
     lambda c, m: _load_controller(c)),
    ("controller folder", "encoder.safetensors missing", "controller", "controller/encoder.safetensors",
     lambda p: p.unlink(), lambda c, m: _load_controller(c)),
    ("controller folder", "truncated best.safetensors", "controller", "controller/best.safetensors", _truncate,
     lambda c, m: _load_controller(c)),
    ("controller folder", "bit flip in best.safetensors", "controller", "controller/best.safetensors", _flip(3),
     lambda c, m: _load_controller(c)),
    ("controller folder", "bit flip in encoder.safetensors", "controller", "controller/encoder.safetensors",
     _flip(3), lambda c, m: _load_controller(c)),
    ("controller folder", "best.json with wrong types", "controller", "controller/best.json",
     _edit_json(lambda o: o.update(width="wide")), lambda c, m: _load_controller(c)),
    ("controller folder", "best.json torn", "controller", "controller/best.json", _truncate,
     lambda c, m: _load_controller(c)),
    ("Learn2PD filters", "truncated block-4.safetensors", "filters", "filters/block-4.safetensors", _truncate,
     lambda c, m: _load_filters(c)),
    ("Learn2PD filters", "bit flip in block-4.safetensors", "filters", "filters/block-4.safetensors", _flip(3),
     lambda c, m: _load_filters(c)),
    ("Learn2PD filters", "block-4.json with wrong types", "filters", "filters/block-4.json",
     _edit_json(lambda o: o.update(hidden=[4])), lambda c, m: _load_filters(c)),
    ("training state (resume)", "state.json torn", "run", "run/state.json", _truncate,
     lambda c, m: _resume_train(c, m / "cache")),
    ("training state (resume)", "bit flip in the state's weights", "run", "run/state-00000002.safetensors", _flip(3),
     lambda c, m: _resume_train(c, m / "cache")),
    ("eval items JSONL", "a torn line before the last", "eval", "eval/runs/8-4/confidence/items-rank0.jsonl",
     lambda p: p.write_text(p.read_text().replace('"correct"', '"corr', 1)), lambda c, m: _read_items(
         c / "runs/8-4/confidence")),
    ("eval items JSONL", "a line that is JSON but not a record", "eval", "eval/runs/8-4/confidence/items-rank0.jsonl",
     lambda p: p.write_text("[1, 2]\n" + p.read_text()), lambda c, m: _read_items(c / "runs/8-4/confidence")),
    ("prompts JSONL", "a non-JSON line", "prompts.jsonl", "prompts.jsonl", _append("not json\n{\"prompt\": \"x\"}\n"),
     lambda c, m: _read_prompts(c)),
    ("prompts JSONL", "a prompt that is not a string", "prompts.jsonl", "prompts.jsonl", _append('{"prompt": 7}\n'),
     lambda c, m: _read_prompts(c)),
]


# the file a refusal must name when it is not the damaged one (the index points at a shard that is not there)
NAMES = {"index lists a missing shard": "rank0-00099.safetensors"}
# a refusal says what to do
FIXES = ("delete", "re-run", "rerun", "rebuild", "refit", "restore", "train", "download", "copy", "fix",
         "rewrite", "reinstall", "write one")


@pytest.mark.parametrize("reader,damage,copy,target,apply,read", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_a_damaged_file_is_refused_by_name(made, tmp_path, reader, damage, copy, target, apply, read):
    copied = _copy(made, tmp_path, copy)
    apply(tmp_path / target)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(CLEAR) as err:
        read(copied, made)()
    message = str(err.value)
    print(f"\n| {reader} | {damage} | {type(err.value).__name__}: {message.replace(str(tmp_path) + '/', '')} |")
    assert NAMES.get(damage, Path(target).name) in message, message  # names the file
    assert any(word in message for word in FIXES), message  # and what to do
    assert {p: p.read_bytes() for p in before} == before  # nothing was rewritten


def test_the_command_line_prints_one_line_not_a_traceback(made, tmp_path, capsys):
    """A damaged input through the CLI: exit code 2 and one line naming the file (in this process)."""
    from tracelock.cli import main

    traces = _copy(made, tmp_path, "traces")
    _flip(3)(traces / "rank0-00000.safetensors")
    cases = {"featurize": ["featurize", "--traces", str(traces), "--model", str(made / "llada"), "--encoder",
                           str(made / "controller"), "--out", str(tmp_path / "cache")],
             "train-l2p": ["train-l2p", "--traces", str(traces), "--model", str(made / "llada"), "--block", "4",
                           "--out", str(tmp_path / "filters"), "--epochs", "2"]}
    for name, argv in cases.items():
        assert main(argv) == 2
        err = capsys.readouterr().err
        # a progress bar may have started on stderr before the damage was found; the error is one line after it
        lines = [line for line in err.splitlines() if line.startswith("tracelock ")]
        assert len(lines) == 1 and lines[0].startswith(f"tracelock {name}: error: ") and err.endswith("\n"), err
        assert "rank0-00000.safetensors" in lines[0] and "Traceback" not in err


def test_a_second_writer_of_one_folder_is_refused_and_nothing_is_touched(made, tmp_path):
    """Another process holds the folder (a real second process): collect into it is refused at once."""
    from tracelock.recording.collect import collect

    out = _copy(made, tmp_path, "traces")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from tracelock.atomic import folder_lock
        with folder_lock({str(out)!r}, "lock-rank0"):
            print("held", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = {p: p.read_bytes() for p in out.iterdir()}
        with pytest.raises(FolderBusyError, match=rf"being written by another tracelock process \(pid {holder.pid}\)"):
            collect(made / "llada", str(made / "prompts.jsonl"), out, gen_length=8, block=4, batch_size=3,
                    shard_size=2, keep_confidence=True)
        assert {p: p.read_bytes() for p in out.iterdir()} == before
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0 and not (out / ".lock-rank0").exists()  # released on a clean exit


# run in a child process: a private mount namespace with a small tmpfs as the output folder (the harness's own
# mounts are untouched), collect into it until the disk is full, report what the folder holds, then remount it
# larger and run the same command again
FULL_DISK = r"""
import ctypes, json, os, subprocess, sys
from pathlib import Path
libc = ctypes.CDLL(None, use_errno=True)
out, argv = Path(sys.argv[1]), sys.argv[2:]
if libc.unshare(0x00020000) != 0 or libc.mount(b"none", b"/", None, 16384 | (1 << 18), None) != 0:
    print(json.dumps({"skip": os.strerror(ctypes.get_errno())}))
    sys.exit(0)
out.mkdir(parents=True)
def mount(size, flags=0):
    if libc.mount(b"tmpfs", str(out).encode(), b"tmpfs", flags, f"size={size}".encode()) != 0:
        raise OSError(ctypes.get_errno(), "mount tmpfs")
mount("24k")
def run():
    proc = subprocess.run([sys.executable, "-m", "tracelock", *argv, "--out", str(out)], capture_output=True, text=True)
    from tracelock.traces.store import _read_shard, done_records
    shards_ok = all(_read_shard(out, e) for rec in done_records(out).values() for e in rec["shards"])
    json_ok = all(json.loads(p.read_text()) is not None for p in out.glob("*.json"))
    return dict(code=proc.returncode, stderr=proc.stderr, files=sorted(p.name for p in out.iterdir()),
                shards_ok=shards_ok, json_ok=json_ok)
full = run()
# the other writers of the package on the full disk: numpy arrays (the feature cache) and safetensors
import numpy as np, torch
from tracelock.integrity import save_tensors
from tracelock.traces.cache import _write_npy
writers = {"npy": lambda: _write_npy(out / "x.npy", np.zeros(1 << 16)),
           "safetensors": lambda: save_tensors(out / "x.safetensors", {"x": torch.zeros(1 << 16)})}
for name, write in writers.items():
    try:
        write()
        full[name] = "written"
    except Exception as err:
        full[name] = type(err).__name__
full["files_after"] = sorted(p.name for p in out.iterdir())
mount("4m", 32)  # MS_REMOUNT: the same files, more room
print(json.dumps(dict(full=full, again=run())))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (or a user namespace)")
def test_a_full_disk_is_a_clear_error_and_leaves_no_torn_file(made, tmp_path):
    out = tmp_path / "small-disk"
    argv = ["collect", "--model", str(made / "llada"), "--prompts", str(made / "prompts.jsonl"), "--gen-length", "8",
            "--block", "4", "--batch-size", "3", "--shard-size", "2", "--confidence", "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(out), *argv], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    if "skip" in report:
        pytest.skip(f"a private mount namespace is not permitted here: {report['skip']}")
    full, again = report["full"], report["again"]
    print(f"\n| collect into a full 24 KiB tmpfs | exit {full['code']}: {full['stderr'].strip()} | files left: "
          f"{full['files']} |")
    assert full["code"] == 2 and full["stderr"].count("\n") == 1, full["stderr"]
    assert "no space left on the device while writing" in full["stderr"] and "Traceback" not in full["stderr"]
    # no temporary file left, every shard its done record lists is whole, every JSON file parses
    assert not [f for f in full["files"] if f.endswith(".tmp")] and full["shards_ok"] and full["json_ok"]
    assert full["npy"] == full["safetensors"] == "DiskFullError" and full["files_after"] == full["files"]
    # with room again, the same command resumes and finishes
    assert again["code"] == 0 and again["shards_ok"] and "index.json" in again["files"], again["stderr"]
