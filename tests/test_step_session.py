"""The fused-step GPU session (bench/studies/gpu_step_session.sh, bench/studies/step_session.py) run whole on the CPU
at tiny shapes, as the device would run it: its stage budgets fit the device's 600 s command; what comes back
under the device's rules (at most 8 files, at most two folders down, 16 MiB each, plain names) holds every figure;
and a kill at a random stage keeps what the stages before it measured."""

import json
import os
import random
import re
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "studies"
ROOT = BENCH.parents[1]
DEVICE_LIMIT, SESSION_LIMIT = 600, 480
STAGES = ["install", "machine", "kernel-tests", "backbone", "race", "gemm"]


def _session_module(study_script):
    return study_script("step_session")


def come_back(out: Path) -> list:
    """The files the device would return from ``out``: its rules asserted, their names returned."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3 and p.stat().st_size <= 16 * 2**20, rel
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
    return sorted(str(p.relative_to(out)) for p in files)


def archive(out: Path) -> dict:
    """{name: bytes} of the session's archive."""
    with tarfile.open(out / "session.tar.gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def start(tmp_path) -> subprocess.Popen:
    env = dict(os.environ, OUT=str(tmp_path / "out"), DRY_RUN="1", OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    return subprocess.Popen(["bash", str(BENCH / "gpu_step_session.sh")], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_session_budgets_fit_the_device(study_script):
    session = _session_module(study_script)
    assert [name for name, _, _ in session.STAGES] == STAGES
    total = sum(budget for _, budget, _ in session.STAGES)
    assert total <= session.BUDGET == SESSION_LIMIT < DEVICE_LIMIT, total
    assert all(least < budget for _, budget, least in session.STAGES)


@pytest.mark.slow
def test_whole_session_comes_back(tmp_path):
    proc = start(tmp_path)
    assert proc.wait(timeout=DEVICE_LIMIT) == 0  # the simulated device limit
    out = tmp_path / "out"
    assert come_back(out) == ["session.json", "session.log", "session.tar.gz"]
    files = archive(out)
    record = json.loads(files["session.json"])
    assert list(record["stages"]) == STAGES and record["dry_run"]
    for name in STAGES[1:]:
        stage = record["stages"][name]
        runs = stage["files"].values() if name == "kernel-tests" else [stage] if "rc" in stage else stage.values()
        assert all(r["rc"] == 0 and not r["timed_out"] for r in runs if isinstance(r, dict) and "rc" in r), stage
    reports = [n for n in files if n.startswith("kernel-tests/") and n.endswith(".xml")]
    assert len(reports) == 2 and all(b'failures="0"' in files[n] for n in reports)
    assert b"op silu_mul: triton (self-check passed" in files["machine/tracelock-env.txt"]
    backbone = json.loads(files["backbone/gpu-backbone-llada-8b-dry-run.json"])
    assert backbone["choice"]["B1"]["fastest"] and all(v["check"]["tokens_equal"] for v in backbone["variants"]
                                                       .values())
    race = json.loads(files["race/gpu-race-llada-8b-dry-run.json"])
    assert race["cells"]["k2-B1-eager-loop"]["forwards"] > 0 and "summary" in race
    assert "llada-8b" in json.loads(files["gemm/gpu-gemm-dry-run.json"])
    assert not any("micro-" in n for n in files)  # the dry run's checkpoints are inputs, not results


@pytest.mark.slow
def test_a_kill_at_a_random_stage_keeps_what_came_before(tmp_path):
    seed = time.time_ns() % 10**6
    victim = random.Random(seed).choice(STAGES[2:])
    proc = start(tmp_path)
    log = tmp_path / "out" / "session.log"
    deadline = time.monotonic() + DEVICE_LIMIT
    while not (log.exists() and f"=== {victim} " in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, (seed, victim)
        time.sleep(0.2)
    time.sleep(random.Random(seed).uniform(0, 4))  # somewhere inside the stage
    os.killpg(proc.pid, signal.SIGKILL)  # as the device's limit kills the command and everything it started
    proc.wait()
    out = tmp_path / "out"
    assert set(come_back(out)) <= {"session.json", "session.log", "session.tar.gz"}, (seed, victim)
    files = archive(out)
    record = json.loads(files["session.json"])
    before = STAGES[:STAGES.index(victim)]
    assert all(name in record["stages"] for name in before), (seed, victim, record)
    wanted = {"kernel-tests": "kernel-tests/test_kernel_", "backbone": "backbone/gpu-backbone-llada-8b-dry-run.json",
              "race": "race/gpu-race-llada-8b-dry-run.json"}
    for name in before:
        if name in wanted:
            assert any(n.startswith(wanted[name]) for n in files), (seed, victim, name, sorted(files))
