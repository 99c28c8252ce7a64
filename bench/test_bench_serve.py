"""Smoke run of the serving load test (`bench/serve_load.py`): a handful of requests, one at a time and from two
clients, every answer checked against offline decoding. The measured run (64 requests, 16 clients) is in
docs/serving.md with its command."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the serve extra is not installed (pip install tracelock[serve])")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install tracelock[serve])")


def test_serve_load_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).with_name("serve_load.py"))
    serve_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_load)
    out = tmp_path / "load.json"
    assert serve_load.main(["--requests", "4", "--clients", "2", "--max-tokens", "32,16", "--out", str(out),
                            "--server-args", "--model testbed --block 16 --max-tokens 32 --max-batch 2 "
                                             "--threads 1"]) == 0
    result = json.loads(out.read_text())
    assert all(p["equal_to_offline"] == 4 for p in result["phases"].values())
