"""The feature cache: round trips (fp16, int8), labels against the trace, mmap, checksums, resume, split."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tracelock
from tracelock import states
from tracelock.features import fit_encoder
from tracelock.traces.cache import (
    INDEX,
    CacheCorruptError,
    FeatureCache,
    cache_bytes_per_trace,
    featurize,
    quantise_int8,
)
from tracelock.traces.replay import replay

# the trace builder lives in test_features.py (tests run with --import-mode=importlib: no sibling imports)
_spec = importlib.util.spec_from_file_location("_features_tests", Path(__file__).with_name("test_features.py"))
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
# the whole-cache checksum check lives with the fault tests (tests/faults.py, loaded once by conftest.py)
import faults as _faults  # noqa: E402

record_traces, make_prompts = _helpers.record_traces, _helpers.make_prompts


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tracelock.write_tiny_checkpoint(tmp_path_factory.mktemp("llada"), family="llada")
    model = tracelock.load_model(path, dtype=torch.float32)
    traces = record_traces(model, make_prompts(2, 6), gen_length=16, block=8, record_every=2, id_prefix="a")
    traces += record_traces(model, make_prompts(2, 9, seed=1), gen_length=16, record_every=3, id_prefix="b")
    encoder = fit_encoder(model, traces, hidden_dim=16, delta_dim=4, max_positions=500)
    return model, traces, encoder


def _expected(model, encoder, trace, step):
    """Codes, labels, eot and confidence of one step, straight from replay and the trace."""
    _, taps, props, conf = next(replay(model, trace, steps=[step]))
    P = len(trace.prompt)
    state = trace.state_at(step)
    label = np.full(len(state), -1, np.int8)
    for g in range(trace.gen_length):
        if state[P + g] == states.ACTIVE:
            label[P + g] = int(props[g] == trace.final[g])
    eot = np.concatenate([np.zeros(P, bool), np.isin(trace.final, model.spec.end_ids)])
    return encoder.codes(*taps).numpy(), state, label, eot, np.concatenate([np.zeros(P), conf.numpy()])


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_cache_round_trip(setup, tmp_path, dtype):
    model, traces, encoder = setup
    summary = featurize(model, encoder, traces, tmp_path, dtype=dtype, shard_bytes=4000)
    assert summary["added"] == 4 and summary["shards"] >= 2
    cache = FeatureCache(tmp_path)
    assert len(cache) == sum(len(t.steps) for t in traces) == summary["items"]
    assert cache.code_dim == encoder.code_dim and cache.groups == {k: list(v) for k, v in encoder.groups.items()}
    by_id = {t.meta["id"]: t for t in traces}
    n_labels = 0
    for i in range(len(cache)):
        item = cache[i]
        trace = by_id[item["trace_id"]]
        assert item["step"] in trace.steps and item["prompt_len"] == len(trace.prompt)
        codes, state, label, eot, conf = _expected(model, encoder, trace, item["step"])
        assert item["codes"].dtype == np.float32 and item["codes"].shape == codes.shape
        if dtype == "fp16":
            np.testing.assert_allclose(item["codes"], codes, rtol=1e-3, atol=1e-3)
        else:
            _, scale = quantise_int8(codes)
            assert np.all(np.abs(item["codes"] - codes) <= scale[:, None] / 2 * (1 + 1e-5) + 1e-7)
        np.testing.assert_array_equal(item["state"], state)
        np.testing.assert_array_equal(item["label"], label)
        np.testing.assert_array_equal(item["eot"], eot)
        np.testing.assert_allclose(item["confidence"], conf, rtol=1e-3, atol=1e-4)
        n_labels += (label >= 0).sum()
    assert n_labels > 0
    # the labels of recorded proposals agree with the trace's own labels where the trace has a proposal
    trace = traces[0]
    rec = trace.labels()
    items = [cache[i] for i in range(len(cache)) if cache[i]["trace_id"] == trace.meta["id"]]
    for item in items:
        row = rec[list(trace.steps).index(item["step"])]
        has = row >= 0
        np.testing.assert_array_equal(item["label"][len(trace.prompt):][has], row[has])


def test_int8_quantisation_bound():
    codes = np.random.default_rng(0).normal(size=(50, 33)).astype(np.float32) * np.linspace(0.01, 30, 50)[:, None]
    codes[3] = 0
    q, scale = quantise_int8(codes)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale[3] == 0
    assert np.all(np.abs(q * scale[:, None] - codes) <= scale[:, None] / 2 * (1 + 1e-6))


def test_cache_files_are_mmapped_npy(setup, tmp_path):
    model, traces, encoder = setup
    featurize(model, encoder, traces[:2], tmp_path, dtype="int8")
    cache = FeatureCache(tmp_path)
    cache[0]
    arrays = cache._shards[0]
    assert all(isinstance(a, np.memmap) for a in arrays.values())
    assert arrays["codes"].dtype == np.int8 and arrays["scale"].dtype == np.float32
    index = json.loads((tmp_path / INDEX).read_text())
    shard = index["shards"][0]
    assert index["encoder"]["digest"] == encoder.digest() and index["dtype"] == "int8"
    for f in shard["files"].values():
        arr = np.load(tmp_path / f["file"], allow_pickle=False)
        assert list(arr.shape) == f["shape"] and arr.dtype.str == f["dtype"]
    assert not list(tmp_path.glob("*.tmp"))


def test_cache_checksum_corruption(setup, tmp_path):
    model, traces, encoder = setup
    featurize(model, encoder, traces[:2], tmp_path)
    path = next(tmp_path.glob("shard-00000.codes.npy"))
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    cache = FeatureCache(tmp_path)
    with pytest.raises(CacheCorruptError, match="codes.npy is corrupt"):
        cache[0]
    with pytest.raises(CacheCorruptError, match="missing or corrupt"):
        _faults.verify_cache(cache)
    # without verification the bytes are read as they are
    assert FeatureCache(tmp_path, verify=False)[0]["codes"].shape[1] == encoder.code_dim


def test_cache_resume_skips_done_traces(setup, tmp_path):
    model, traces, encoder = setup
    first = featurize(model, encoder, traces[:2], tmp_path)
    again = featurize(model, encoder, traces, tmp_path)
    assert (first["added"], again["added"], again["skipped"]) == (2, 2, 2)
    cache = FeatureCache(tmp_path)
    assert sorted(cache.trace_ids) == sorted(t.meta["id"] for t in traces)
    assert len(cache) == sum(len(t.steps) for t in traces)
    assert featurize(model, encoder, traces, tmp_path)["added"] == 0
    with pytest.raises(ValueError, match="dtype='fp16', not 'int8'"):
        featurize(model, encoder, traces, tmp_path, dtype="int8")
    other = fit_encoder(model, traces, hidden_dim=16, delta_dim=4, max_positions=500, seed=1)
    with pytest.raises(ValueError, match="another encoder"):
        featurize(model, other, traces, tmp_path)


def test_cache_split_by_trace(setup, tmp_path):
    model, traces, encoder = setup
    featurize(model, encoder, traces, tmp_path, steps="all")
    cache = FeatureCache(tmp_path)
    assert len(cache) == sum(t.num_steps for t in traces)
    train, val = cache.split(0.25, seed=0)
    assert len(train) + len(val) == len(cache) and len(val) > 0 and len(train) > 0
    ids = lambda idx: {cache[int(i)]["trace_id"] for i in idx}  # noqa: E731
    assert not ids(train) & ids(val) and len(ids(val)) == 1
    assert np.array_equal(cache.split(0.25, seed=0)[1], val)
    with pytest.raises(ValueError, match="fraction"):
        cache.split(1.0)


def test_cache_bytes_per_trace(setup, tmp_path):
    model, traces, encoder = setup
    featurize(model, encoder, traces, tmp_path / "fp16")
    featurize(model, encoder, traces, tmp_path / "int8", dtype="int8")
    rows = sum(len(t.steps) * (len(t.prompt) + t.gen_length) for t in traces)
    fp16, int8 = cache_bytes_per_trace(tmp_path / "fp16"), cache_bytes_per_trace(tmp_path / "int8")
    C = encoder.code_dim
    assert fp16 > rows * (2 * C + 5) / len(traces) and int8 > rows * (C + 9) / len(traces)
    assert int8 < fp16


def test_featurize_rejects_bad_input(setup, tmp_path):
    model, traces, encoder = setup
    with pytest.raises(ValueError, match="dtype='bf16'"):
        featurize(model, encoder, traces, tmp_path, dtype="bf16")
    with pytest.raises(ValueError, match="appears twice"):
        featurize(model, encoder, [traces[0], traces[0]], tmp_path)
    with pytest.raises(FileNotFoundError, match="tracelock featurize"):
        FeatureCache(tmp_path / "nothing")


def test_cli_fit_encoder_and_featurize(setup, tmp_path, capsys):
    from tracelock.traces.store import TraceWriter

    model, traces, _ = setup
    ckpt = tracelock.write_tiny_checkpoint(tmp_path / "ckpt", family="llada")
    with TraceWriter(tmp_path / "traces", shard_size=3) as writer:
        for t in traces:
            writer.add(t)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = lambda *a: subprocess.run([sys.executable, "-m", "tracelock", *a], capture_output=True, text=True,  # noqa: E731
                                    env=env, timeout=300)
    common = ["--traces", str(tmp_path / "traces"), "--model", str(ckpt)]
    res = run("fit-encoder", *common, "--out", str(tmp_path / "enc"), "--hidden-dim", "12", "--delta-dim", "3",
              "--max-positions", "300")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["code_dim"] == 42
    res = run("featurize", *common, "--encoder", str(tmp_path / "enc"), "--out", str(tmp_path / "cache"),
              "--dtype", "int8")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["added"] == 4 and summary["bytes_per_trace"] > 0
    cache = FeatureCache(tmp_path / "cache")
    assert len(cache) == sum(len(t.steps) for t in traces) and cache.code_dim == 42
    # resume and a bad width in-process (a subprocess costs ~7 s of imports on the test machine)
    from tracelock.cli import main

    assert main(["featurize", *common, "--encoder", str(tmp_path / "enc"), "--out", str(tmp_path / "cache"),
                 "--dtype", "int8"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["added"], again["skipped"]) == (0, 4)
    assert main(["fit-encoder", *common, "--out", str(tmp_path / "enc2"), "--hidden-dim", "65"]) == 2
    assert "hidden_dim=65" in capsys.readouterr().err
