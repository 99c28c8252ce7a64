"""`load_model` / `load_tokenizer` / the CLI with a Hugging Face Hub id, resolved offline through huggingface_hub's
cache: a cache laid out as huggingface_hub writes it (blobs, a snapshot of links, refs/main) in a temporary HF_HOME,
holding the bundled testbed model's files. Nothing is downloaded (HF_HUB_OFFLINE=1)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tracelock
from tracelock.models.loading import BUNDLED, is_hub_id

CLI = str(Path(sys.executable).parent / "tracelock")
REPO = "tracelock-tests/testbed-mirror"
# the bundled model's files a Hub repository of it would hold (the eval tables beside them are not needed)
FILES = ("config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json", "testbed.json",
         "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """$HF_HOME with ``REPO`` cached at one commit, as `snapshot_download` leaves it."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    commit = hashlib.sha1(b"tracelock test snapshot").hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in FILES:
        data = (BUNDLED["testbed"] / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return home


def run_python(code: str, hf_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_hub_ids_and_paths_are_told_apart():
    assert is_hub_id("GSAI-ML/LLaDA-8B-Instruct") and is_hub_id("Dream-org/Dream-v0-Instruct-7B")
    for path in ("./ckpt", "/models/llada", "testbed", "~/x/y", "a/b/c", "../x"):
        assert not is_hub_id(path), path


def test_a_hub_id_loads_from_the_cache_offline_as_the_same_model(hf_home):
    code = f"""
import json, torch, tracelock
model, tok = tracelock.load_model({REPO!r}), tracelock.load_tokenizer({REPO!r})
ids = tok.apply_chat_template([{{"role": "user", "content": "Zoe has 9 books. She finds 4 more books. How many?"}}],
                              tokenize=False, add_generation_prompt=True)
ids = tok(ids, add_special_tokens=False)["input_ids"]
tokens, stats = tracelock.fused_generate(model, [ids], policy="threshold", gen_length=32, block=16)
print(json.dumps(dict(tokens=tokens[0].tolist(), steps=stats.steps)))
"""
    done = run_python(code, hf_home)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    model, tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    text = tok.apply_chat_template([{"role": "user", "content": "Zoe has 9 books. She finds 4 more books. How many?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    tokens, stats = tracelock.fused_generate(model, [ids], policy="threshold", gen_length=32, block=16)
    assert got["tokens"] == tokens[0].tolist() and got["steps"] == stats.steps


def test_the_cli_takes_a_hub_id(hf_home):
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([CLI, "generate", "--model", REPO, "--prompt", "What is 2 + 3?", "--policy", "threshold",
                           "--gen-length", "16", "--block", "16"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["settings"]["model"] == REPO


def test_a_hub_id_missing_from_the_cache_offline_is_one_line_with_the_fix(hf_home):
    done = run_python("import tracelock; tracelock.load_model('tracelock-tests/not-cached')", hf_home)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "CheckpointError: model 'tracelock-tests/not-cached' is not a folder here and not in the Hugging Face " \
           "cache" in last and "HF_HUB_OFFLINE=1 forbids downloading it" in last and "hf download" in last
