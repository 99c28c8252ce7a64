"""Smoke run of the soak test (`bench/soak.py`): a few dozen requests from 8 clients against a batch of 4 with a
queue of 2, with dropped clients and malformed bodies; every answer checked against offline decoding, the server's
counters against what the clients saw. ``TRACELOCK_SOAK_REQUESTS=N`` runs N requests instead; the measured run
(2,000 requests, 32 clients) is in docs/serving.md with its command."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the serve extra is not installed (pip install tracelock[serve])")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install tracelock[serve])")


def test_soak_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("soak", Path(__file__).with_name("soak.py"))
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    out = tmp_path / "soak.json"
    requests = int(os.environ.get("TRACELOCK_SOAK_REQUESTS", "40"))
    assert soak.main(["--requests", str(requests), "--warmup", "0", "--clients", "8", "--max-batch", "4",
                      "--max-waiting", "2", "--drop", "0.15", "--malformed", "0.15", "--sampled", "0.1",
                      "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    soak_round = result["rounds"]["soak"]
    assert soak_round["equal_to_offline"] == soak_round["kinds"]["valid"] > 0
    assert soak_round["kinds"]["drop"] > 0 and soak_round["kinds"]["malformed"] > 0
    assert result["exit_code"] == 0
