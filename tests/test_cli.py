"""`tracelock tiny-checkpoint` and `tracelock generate`, end to end in subprocesses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLI = str(Path(sys.executable).parent / "tracelock")


def run(*args, check=True):
    proc = subprocess.run([*args], capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "llada-tiny"
    proc = run(CLI, "tiny-checkpoint", "--family", "llada", "--out", str(path))
    assert "wrote a tiny random llada checkpoint" in proc.stdout
    return path


def test_generate_jsonl(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["What is 2 + 3 ?", "add 4 and 5", "x"]) + "\n")
    out = tmp_path / "out.jsonl"
    run(sys.executable, "-m", "tracelock", "generate", "--model", str(tiny), "--prompts", str(prompts),
        "--policy", "threshold", "--policy-arg", "tau=0.9", "--gen-length", "16", "--block", "8",
        "--batch-size", "2", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["What is 2 + 3 ?", "add 4 and 5", "x"]
    for r in rows:
        assert len(r["token_ids"]) <= 16 and isinstance(r["text"], str)  # cut before an end token
        assert 1 <= r["steps"] <= 16 and r["seconds"] > 0
        assert r["settings"]["policy_args"] == {"tau": 0.9} and r["settings"]["block"] == 8


def test_generate_single_prompt_to_stdout(tiny):
    proc = run(CLI, "generate", "--model", str(tiny), "--prompt", "What is 2 + 3 ?", "--policy", "confidence",
               "--gen-length", "8", "--window", "4")
    record = json.loads(proc.stdout)
    assert record["steps"] == 8
    cached = run(CLI, "generate", "--model", str(tiny), "--prompt", "What is 2 + 3 ?", "--policy", "confidence",
                 "--gen-length", "8", "--window", "4", "--cache", "dual", "--refresh-shift", "2")
    record = json.loads(cached.stdout)
    assert record["steps"] == 8 and record["settings"]["cache"] == "dual" and record["settings"]["refresh_shift"] == 2


def test_generate_bad_input_is_one_clear_line(tiny):
    proc = run(CLI, "generate", "--model", str(tiny), "--prompt", "hi", "--policy", "beam", "--gen-length", "8",
               check=False)
    assert proc.returncode == 2
    assert "unknown policy 'beam'" in proc.stderr and "Traceback" not in proc.stderr
    proc = run(CLI, "generate", "--model", str(tiny), "--prompt", "hi", "--policy", "confidence",
               "--gen-length", "8", "--block", "3", check=False)
    assert proc.returncode == 2 and "--block 3 does not divide --gen-length 8" in proc.stderr


def test_generate_reads_a_learned_policy_once_not_per_batch(tmp_path, monkeypatch, capsys):
    """The controller is read from disk when the options are checked and once for the run, never per batch."""
    from tracelock.cli import main
    from tracelock.policies import tracelock as tracelock_policy

    reads = []
    real = tracelock_policy._load
    monkeypatch.setattr(tracelock_policy, "_load", lambda *a, **k: reads.append(1) or real(*a, **k))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + 3 ?"}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", "testbed", "--prompts", str(prompts), "--policy",
                 "tracelock:controller=testbed", "--gen-length", "16", "--window", "8", "--batch-size", "1",
                 "--threads", "1", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3 and len(reads) == 2  # the check, then the run's one policy


@pytest.mark.parametrize("argv, option", [
    (["train-l2p", "--traces", "", "--model", "testbed", "--block", "1", "--out", "o"], "--traces"),
    (["fit-encoder", "--traces", "", "--model", "testbed", "--out", "o"], "--traces"),
    (["featurize", "--traces", "t", "--model", "testbed", "--encoder", "", "--out", "o"], "--encoder"),
    (["train", "--cache", "", "--out", "o"], "--cache"),
    (["self-train", "--model", "testbed", "--controller", "c", "--cache", "", "--prompts", "testbed:math", "--out",
      "o"], "--cache"),
    (["self-train", "--model", "testbed", "--controller", "", "--cache", "c", "--prompts", "testbed:math", "--out",
      "o"], "--controller"),
    (["rl", "--model", "testbed", "--controller", "", "--prompts", "testbed:math", "--out", "o"], "--controller"),
])
def test_an_empty_input_folder_is_named_with_its_option(argv, option, capsys):
    # an empty path read as the working directory: the error named a missing index.json, not the option
    from tracelock.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert f"argument {option}: an empty path; pass a" in capsys.readouterr().err
