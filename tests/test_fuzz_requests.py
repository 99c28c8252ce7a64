"""Property-based fuzzing of request bodies against `tracelock serve` (the bundled testbed model, a real server
process on loopback, raw HTTP): every field OpenAI defines and this server's extensions, with values of every JSON
type, unknown fields, wrong shapes, and bodies that are not JSON at all. Every request is answered 200 (whole or a
stream ending in ``[DONE]``) or 4xx with OpenAI's error object whose ``param`` names the field at fault (a field of
the body, or the missing required one) and whose message says it; never a 5xx, a dropped connection or a hang. The
server keeps serving throughout."""

import http.client
import importlib.util
import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install tracelock[serve])")

from tracelock.serve.process import server_process  # noqa: E402

_spec = importlib.util.spec_from_file_location("fuzzing", Path(__file__).with_name("fuzzing.py"))
fuzzing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzzing)

# short answers, so the bodies that are valid decode quickly
SERVER = ["--model", "testbed", "--policy", "threshold:tau=0.9,confidence", "--block", "8", "--max-tokens", "16",
          "--default-max-tokens", "8", "--max-batch", "4", "--threads", "1"]
REQUIRED = {"/v1/chat/completions": ("model", "messages"), "/v1/completions": ("model", "prompt")}

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2 ** 66), 2 ** 66) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                max_size=3),
                    max_leaves=6)


def plausible(field: str):
    """Values a client might send for ``field``: right ones, near misses, and any JSON."""
    good = {
        "model": st.sampled_from(["testbed", "testbed", "gpt-4", ""]),
        "messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "user", "system", "assistant", "tool", "robot"])},
            optional={"content": st.one_of(st.text(max_size=40), st.lists(st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2))}),
            max_size=3),
        "prompt": st.one_of(st.text(max_size=60), st.just("apples " * 400), st.lists(st.text(max_size=5), max_size=2)),
        "max_tokens": st.integers(-2, 20),
        "max_completion_tokens": st.integers(-2, 20),
        "temperature": st.floats(-1, 3),
        "top_p": st.floats(-0.5, 1.5),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6)),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "n": st.integers(-1, 3),
        "seed": st.integers(-(2 ** 64), 2 ** 64),
        "logprobs": st.one_of(st.booleans(), st.integers(0, 5)),
        "echo": st.booleans(),
        "suffix": st.text(max_size=5),
        "best_of": st.integers(0, 3),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "user": st.text(max_size=8),
        "policy": st.sampled_from(["threshold:tau=0.9", "confidence", "threshold", "tracelock", "nope", ""]),
    }[field]
    return st.one_of(good, good, good, JSON)


@st.composite
def request(draw):
    """(path, raw body)."""
    path = draw(st.sampled_from(sorted(REQUIRED)))
    if draw(st.integers(0, 9)) == 0:  # not a JSON object at all
        raw = draw(st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode),
                             JSON.map(lambda v: json.dumps(v).encode())))
        return path, raw
    fields = ["model", "max_tokens", "temperature", "top_p", "stop", "stream", "stream_options", "n", "seed",
              "logprobs", "presence_penalty", "frequency_penalty", "user", "policy"]
    fields += (["messages", "max_completion_tokens"] if path == "/v1/chat/completions" else
               ["prompt", "echo", "suffix", "best_of"])
    body = {}
    for name in fields:
        # the required fields are there most of the time, the others now and then
        if draw(st.floats(0, 1)) < (0.9 if name in REQUIRED[path] else 0.25):
            body[name] = draw(plausible(name))
    body.update(draw(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in fields), JSON,
                                     max_size=2)))
    return path, json.dumps(body).encode()


@pytest.fixture(scope="module")
def server():
    with server_process(SERVER) as served:
        parts = urlsplit(served.url)
        yield parts.hostname, parts.port, served


def send(host: str, port: int, path: str, raw: bytes) -> tuple:
    """(status, parsed JSON or the stream's events) of one POST."""
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", path, raw, {"content-type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return response.status, [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
        return response.status, json.loads(data)
    finally:
        conn.close()


@fuzzing.fuzz_settings(ci=100)
@given(req=request())
def test_every_body_is_answered_or_refused_naming_the_field(server, req):
    host, port, served = server
    path, raw = req
    with fuzzing.time_limit(300, f"POST {path}"):
        status, answer = send(host, port, path, raw)
    assert served.proc.poll() is None, "the server exited"
    assert status == 200 or 400 <= status < 500, f"HTTP {status}: {answer}"
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if status == 200:
        if isinstance(answer, list):  # a stream: chunks, then [DONE]; an error inside a stream is a failure
            assert answer[-1] == "[DONE]" and all("error" not in json.loads(a) for a in answer[:-1]), answer
        else:
            assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
        return
    error = answer["error"]
    assert error["message"] and error["type"] == "invalid_request_error", answer
    if isinstance(body, dict):  # a JSON object: the error names its field
        param = error["param"]
        assert param, f"no param for {body}: {answer}"
        root = param.split("[")[0].split(".")[0]
        assert root in body or root in REQUIRED[path], f"param {param!r} is not a field of {body}"
        assert root in error["message"], f"the message does not name {root!r}: {error['message']}"
