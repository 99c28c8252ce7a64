"""`tracelock collect` end to end (subprocesses, torchrun with gloo, crash and resume), prompt specs, filters."""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tracelock.models import write_tiny_checkpoint
from tracelock.recording.collect import collect, load_items
from tracelock.traces import filters
from tracelock.traces.filters import TraceFilterConfig, code_reasons, text_reason
from tracelock.traces.store import iter_traces, load_index, verify

PROMPTS = ["What is 2 + 3 ?", "add 4 and 5", "x", "hello there", "count to ten", "why", "seven", "list three"]
ARGS = ["--gen-length", "8", "--block", "4", "--batch-size", "3", "--shard-size", "2", "--fraction", "0.5",
        "--confidence", "--min-tokens", "2"]
# NOTE: one torch thread per process: two made decoding 10x slower on the shared 2-core test machine
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run(*args, env=None, check=True):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env or ENV)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("collect")
    model = write_tiny_checkpoint(root / "llada", family="llada", seed=3)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root, ["--model", str(model), "--prompts", str(prompts), *ARGS]


@pytest.fixture(scope="module")
def reference(setup):
    """One uninterrupted single-process run: the store every other run must reproduce."""
    root, args = setup
    out = root / "reference"
    proc = run("-m", "tracelock", "collect", *args, "--out", str(out))
    assert "traces of 8 decoded items" in proc.stdout
    return out


def _by_id(folder):
    return {t.meta["id"]: t for t in iter_traces(folder)}


def _assert_same_store(a, b):
    ta, tb = _by_id(a), _by_id(b)
    assert sorted(ta) == sorted(tb)
    for key, x in ta.items():
        y = tb[key]
        for name in ("prompt", "final", "final_state", "commit_step", "steps", "proposals"):
            assert np.array_equal(getattr(x, name), getattr(y, name)), (key, name)
        assert np.array_equal(x.confidence, y.confidence, equal_nan=True)
        assert x.meta == y.meta
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    # bytes per trace may differ: shard headers are amortised over however the traces fell into shards
    assert [sa[k] for k in ("items", "decoded", "kept", "filtered")] == [sb[k] for k in ("items", "decoded", "kept",
                                                                                         "filtered")]


def test_collect_writes_a_verified_store(reference):
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["items"] == summary["decoded"] == 8
    assert summary["kept"] + sum(summary["filtered"].values()) == 8 and summary["kept"] > 0
    assert summary["seconds"] > 0 and summary["bytes_per_trace"] > 0
    assert verify(reference)["traces"] == summary["kept"]
    traces = list(iter_traces(reference))
    assert [t.meta["id"] for t in traces] == sorted(t.meta["id"] for t in traces)
    for t in traces:
        assert t.meta["policy"] == "confidence" and t.meta["block"] == 4 and t.meta["task"] == "jsonl"
        assert t.gen_length == 8 and t.confidence is not None and t.steps[0] == 0
    done = json.loads((reference / "done-rank0.json").read_text())
    assert set(done["skipped"]) | {i for s in done["shards"] for i in s["ids"]} == {f"prompts:{i}" for i in range(8)}
    assert not [p for p in reference.iterdir() if p.name.endswith(".tmp")]


def test_crash_and_resume_ends_with_the_same_traces(setup, reference):
    root, args = setup
    out = root / "crashed"
    crash = dict(ENV, TRACELOCK_COLLECT_EXIT_AFTER_SHARDS="1")
    proc = run("-m", "tracelock", "collect", *args, "--out", str(out), env=crash, check=False)
    assert proc.returncode == 86, proc.stderr
    assert len(list(out.glob("rank0-*.safetensors"))) == 1 and not (out / "index.json").exists()
    # resume through the Python API in this process (one interpreter start less; the CLI calls the same function)
    opts = dict(zip(args[::2], args[1::2]))
    with _one_thread():
        collect(opts["--model"], opts["--prompts"], out, gen_length=8, block=4, batch_size=3, shard_size=2,
                fraction=0.5, keep_confidence=True, filters=TraceFilterConfig(min_tokens=2))
    _assert_same_store(reference, out)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_torchrun_two_ranks_store_the_same_traces(setup, reference):
    root, args = setup
    out = root / "torchrun"
    run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "tracelock", "collect", *args,
        "--out", str(out))
    assert {f["file"].split("-")[0] for f in load_index(out)["shards"]} == {"rank0", "rank1"}
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    _assert_same_store(reference, out)


def test_resume_with_other_settings_is_refused(setup, reference):
    _, args = setup
    opts = dict(zip(args[::2], args[1::2]))
    with pytest.raises(ValueError, match=r"other settings \(fraction.*same arguments or use a new --out"):
        collect(opts["--model"], opts["--prompts"], reference, gen_length=8, block=4, fraction=0.25,
                keep_confidence=True, filters=TraceFilterConfig(min_tokens=2))


def test_collect_testbed_code_runs_the_code_filters(tmp_path):
    with _one_thread():
        summary = collect("testbed", "testbed:code", tmp_path, num=3, gen_length=32, batch_size=3, seed=1)
    assert summary["decoded"] == 3 and summary["settings"]["block"] == 8
    assert summary["kept"] + sum(summary["filtered"].values()) == 3
    for t in iter_traces(tmp_path):
        assert t.meta["id"].startswith("code:train:1:") and t.meta["correct"] is True


def test_prompt_specs(tmp_path):
    items = load_items("testbed:math,code", 3, seed=2)
    assert [it.id for it in items] == [f"{t}:train:2:{i}" for t in ("math", "code") for i in range(3)]
    assert {it.meta["split"] for it in load_items("testbed:math@validation", 2)} == {"validation"}
    with pytest.raises(ValueError, match="--limit is required"):
        load_items("testbed:math", None)
    with pytest.raises(ValueError, match="unknown testbed task 'poetry'"):
        load_items("testbed:poetry", 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 needs the string field\(s\) 'prompt'"):
        load_items(str(bad), None)
    with pytest.raises(FileNotFoundError, match="neither testbed:TASKS nor an existing JSONL"):
        load_items(str(tmp_path / "missing.jsonl"), None)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"prompt": "a", "id": "q"}\n{"prompt": "b", "id": "q"}\n')
    with pytest.raises(ValueError, match="ids must be unique"):
        load_items(str(dup), None)


def test_text_filters_each_reason():
    cfg = TraceFilterConfig()
    good = [11, 12, 13, 14, 15, 16, 17, 18, 19, 11, 12]
    assert text_reason(good, cfg) is None
    assert text_reason([], cfg) == filters.EMPTY
    assert text_reason([5, 6], cfg) == filters.TOO_SHORT
    assert text_reason([7, 1, 7, 2, 7, 3, 7, 4, 7, 7], cfg) == filters.DOMINANT_TOKEN
    assert text_reason([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 8], cfg) == filters.REPEATED_NGRAM
    # three copies are not yet a loop
    assert text_reason([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 8, 10], cfg) is None
    assert text_reason([], TraceFilterConfig(enabled=False)) is None


def test_code_filters_parse_and_tests():
    tests = "def check(candidate):\n    assert candidate(2) == 4\n"
    programs = ["def f(x):\n    return x * 2\n", "def f(x):\n    return x + 3\n", "def f(x):\n    return (x *\n"]
    reasons = code_reasons(programs, [(tests, "f")] * 3, TraceFilterConfig())
    assert reasons == [None, filters.FAILS_TESTS, filters.DOES_NOT_PARSE]
    assert code_reasons(programs, [None] * 3, TraceFilterConfig()) == [None, None, filters.DOES_NOT_PARSE]
    with pytest.raises(ValueError, match="tests has 1 entries for 3 programs"):
        code_reasons(programs, [None], TraceFilterConfig())
