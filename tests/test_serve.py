"""`tracelock serve` on loopback with the bundled testbed model, driven by the real `openai` client: completions and
chat completions (whole and streamed) equal `fused_generate` token for token, also while other requests share the
batch; bad requests get OpenAI-style 4xx errors naming the field and the server keeps serving; a client that drops
frees its slot, and one gone before its whole body is counted cancelled (seen in /metrics)."""

import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install tracelock[serve])")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install tracelock[serve])")

import tracelock  # noqa: E402
from tracelock.eval.tasks import make_task  # noqa: E402
from tracelock.serve.process import serving  # noqa: E402
from tracelock.text import answer_ids, encode_prompt, encode_text  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK, MAX_BATCH = 16, 4
SERVER = ["--model", "testbed", "--policy", "threshold:tau=0.9,confidence,confidence:per_step=2", "--block", str(BLOCK),
          "--max-tokens", "64", "--default-max-tokens", "32", "--max-batch", str(MAX_BATCH), "--threads", "1"]
SETTINGS = {"threshold:tau=0.9": dict(policy="threshold", policy_args={"tau": 0.9}),
            "confidence": dict(policy="confidence"),
            "confidence:per_step=2": dict(policy="confidence", policy_args={"per_step": 2})}


@pytest.fixture(scope="module")
def base_url():
    with serving(SERVER) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def testbed():
    return tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")


@pytest.fixture(scope="module")
def prompts():
    return [it.prompt for it in make_task("testbed:math").items(6)]


def offline(testbed, ids, gen_length, policy="threshold:tau=0.9", max_tokens=None):
    """(text, token ids) of `fused_generate` on the prompt alone, as the server cuts its answer."""
    model, tok = testbed
    tokens, _ = tracelock.fused_generate(model, [ids], gen_length=gen_length, block=BLOCK, impl="torch",
                                         **SETTINGS[policy])
    answer = answer_ids(tokens[0, len(ids):].tolist(), model.spec.end_ids)[:max_tokens or gen_length]
    return tok.decode(answer, skip_special_tokens=True), answer


def get(url: str):
    """(status, body text) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def post(url: str, body, timeout=60):
    """(status, JSON answer) of a POST of raw bytes or a JSON-able body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def metrics(base_url) -> dict:
    text = get(base_url.removesuffix("/v1") + "/metrics")[1]
    return {m[1]: float(m[2]) for m in re.finditer(r"^(tracelock_\S+) (\S+)$", text, re.M)} | {
        "text": text}


def chat(client, prompt, **kw):
    return client.chat.completions.create(model="testbed", messages=[{"role": "user", "content": prompt}], **kw)


def test_models_health_and_metrics(base_url, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["testbed"]
    assert models[0].model_extra["policies"] == ["threshold:tau=0.9", "confidence", "confidence:per_step=2"]
    assert get(base_url.removesuffix("/v1") + "/health") == (200, '{"status":"ok"}')
    text = metrics(base_url)["text"]
    for name in ("requests_total", "generated_tokens_total", "decode_steps_total", "batch_occupancy",
                 "step_seconds_bucket"):
        assert f"tracelock_{name}" in text
    assert "# TYPE tracelock_step_seconds histogram" in text


def test_completion_equals_fused_generate(client, testbed, prompts):
    _, tok = testbed
    prompt = tok.apply_chat_template([{"role": "user", "content": prompts[0]}], tokenize=False,
                                     add_generation_prompt=True)
    got = client.completions.create(model="testbed", prompt=prompt, max_tokens=64)
    text, ids = offline(testbed, encode_text(tok, prompt), 64)
    assert got.choices[0].text == text and got.choices[0].model_extra["token_ids"] == ids
    assert got.choices[0].finish_reason == "stop" and "####" in text
    usage = got.usage.model_extra
    assert got.usage.completion_tokens == len(ids) and usage["gen_length"] == 64 and usage["steps"] > 0


def test_chat_whole_and_streamed_equal_fused_generate(client, testbed, prompts):
    _, tok = testbed
    text, ids = offline(testbed, encode_prompt(tok, prompts[1]), 64)
    whole = chat(client, prompts[1], max_tokens=64)
    assert whole.choices[0].message.content == text and whole.choices[0].model_extra["token_ids"] == ids
    chunks = list(chat(client, prompts[1], max_tokens=64, stream=True))
    deltas = [c.choices[0].delta.content for c in chunks[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len([d for d in deltas if d]) > 1  # the prefix arrived as it grew, not in one piece
    assert "".join(d or "" for d in deltas) == text
    last = chunks[-1]
    assert last.choices[0].finish_reason == "stop" and last.usage.completion_tokens == len(ids)
    assert last.usage.model_extra["gen_length"] == 64


def test_max_tokens_maps_to_the_block_multiple_and_stop_cuts(client, testbed, prompts):
    _, tok = testbed
    ids = encode_prompt(tok, prompts[2])
    got = chat(client, prompts[2], max_tokens=20)  # rounded up to 32 = 2 blocks of 16
    text, answer = offline(testbed, ids, 32, max_tokens=20)
    assert got.usage.model_extra["gen_length"] == 32 and got.choices[0].model_extra["token_ids"] == answer
    assert got.choices[0].message.content == text and got.choices[0].finish_reason == "length"
    full, _ = offline(testbed, ids, 64)
    for stream in (False, True):
        reply = chat(client, prompts[2], max_tokens=64, stop=["\n"], stream=stream)
        if stream:
            reply = list(reply)
            content = "".join(c.choices[0].delta.content or "" for c in reply)
            reason = reply[-1].choices[0].finish_reason
        else:
            content, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert content == full.split("\n")[0] and reason == "stop"


def test_tokens_per_step_follow_the_generation_length(client, testbed, prompts):
    """``per_step=2``: two tokens a step at whatever generation length a request's max_tokens maps to."""
    _, tok = testbed
    ids = encode_prompt(tok, prompts[3])
    for max_tokens, gen_length in ((64, 64), (20, 32)):
        got = chat(client, prompts[3], max_tokens=max_tokens, extra_body={"policy": "confidence:per_step=2"})
        text, answer = offline(testbed, ids, gen_length, "confidence:per_step=2", max_tokens)
        assert got.choices[0].model_extra["token_ids"] == answer and got.choices[0].message.content == text
        steps = got.usage.model_extra["steps"]
        assert got.usage.model_extra["gen_length"] == gen_length
        # a row cut at max_tokens leaves once its first max_tokens tokens are fixed, before the last step
        assert steps == gen_length // 2 if max_tokens == gen_length else steps < gen_length // 2


def test_batch_invariance_under_continuous_batching(base_url, client, testbed, prompts):
    """Twice as many requests as slots, of two policies, lengths and streaming modes, all at once: rows join the
    running batch as others leave, and every answer equals decoding its prompt alone."""
    _, tok = testbed
    before = metrics(base_url)
    # six rows of one setting (generation length 64; answers cut at various max_tokens) share an engine's slots,
    # two more run in engines of their own
    jobs = [(p, "threshold:tau=0.9", max_tokens, stream) for p, max_tokens, stream in zip(
        prompts, [64, 50, 64, 60, 64, 64], [False, True] * 3)]
    jobs += [(prompts[0], "confidence", 32, True), (prompts[1], "threshold:tau=0.9", 16, False)]

    def ask(job):
        prompt, policy, max_tokens, stream = job
        reply = chat(client, prompt, max_tokens=max_tokens, stream=stream, extra_body={"policy": policy})
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in reply)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(ask, jobs))
    for (prompt, policy, max_tokens, _), text in zip(jobs, got):
        gen_length = -(-max_tokens // BLOCK) * BLOCK
        assert text == offline(testbed, encode_prompt(tok, prompt), gen_length, policy, max_tokens)[0]
    after = metrics(base_url)
    steps = after["tracelock_decode_steps_total"] - before["tracelock_decode_steps_total"]
    rows = after["tracelock_row_steps_total"] - before["tracelock_row_steps_total"]
    assert rows > steps  # rows shared steps
    assert after["tracelock_requests_running"] == after["tracelock_requests_waiting"] == 0


def test_sampling(client, prompts):
    """temperature > 0 samples (its own engine, seeded by the request's seed); alone, the same request draws the
    same answer again."""
    replies = [chat(client, prompts[3], max_tokens=32, temperature=1.5, seed=7) for _ in range(2)]
    greedy = chat(client, prompts[3], max_tokens=32)
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].choices[0].message.content != greedy.choices[0].message.content


def test_n_choices_top_p_and_top_k(client, testbed, prompts):
    """``n`` choices sample with seeds seed, seed + 1, ... (choice 0 is the n=1 request's); greedy choices are all the
    offline answer; ``top_p`` and ``top_k`` are `fused_generate`'s."""
    model, tok = testbed
    several = chat(client, prompts[3], max_tokens=32, temperature=1.5, seed=7, n=3)
    one = chat(client, prompts[3], max_tokens=32, temperature=1.5, seed=7)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.choices[0].message.content == one.choices[0].message.content
    assert several.usage.completion_tokens == sum(len(c.token_ids) for c in several.choices)
    greedy = chat(client, prompts[2], max_tokens=32, n=2, top_p=0.5, extra_body={"top_k": 3})
    ids = encode_prompt(tok, prompts[2])
    tokens, _ = tracelock.fused_generate(model, [ids], gen_length=32, block=BLOCK, top_p=0.5, top_k=3,
                                         **SETTINGS["threshold:tau=0.9"])
    want = tok.decode(answer_ids(tokens[0, len(ids):].tolist(), model.spec.end_ids), skip_special_tokens=True)
    assert [c.message.content for c in greedy.choices] == [want, want]


def _error(exc) -> dict:
    return exc.value.body if isinstance(exc.value.body, dict) else json.loads(exc.value.body)


@pytest.mark.parametrize("kwargs, status, param", [
    (dict(max_tokens="5"), 400, "max_tokens"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(max_tokens=1000), 400, "max_tokens"),
    (dict(temperature="hot"), 400, "temperature"),
    (dict(prompt="apples " * 600), 400, "prompt"),
    (dict(extra_body={"policy": "nope"}), 400, "policy"),
    (dict(extra_body={"policy": "random"}), 400, "policy"),  # a real policy this server does not allow
    (dict(n=2, stream=True), 400, "n"),
    (dict(n=0), 400, "n"),
    (dict(logprobs=2), 400, "logprobs"),
    (dict(extra_body={"top_k": -5}), 400, "top_k"),
    (dict(model="gpt-4"), 404, "model"),
], ids=["mistyped", "max_tokens-0", "max_tokens-too-large", "temperature-mistyped", "prompt-too-long",
        "unknown-policy", "disallowed-policy", "n-streamed", "n-0", "logprobs", "top_k", "unknown-model"])
def test_bad_requests_name_the_field(client, kwargs, status, param):
    args = dict(model="testbed", prompt="Mia has 3 apples.", max_tokens=16) | kwargs
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(**args)
    assert exc.value.status_code == status
    err = _error(exc)
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def test_malformed_bodies_and_unknown_routes(base_url, client):
    for body in (b"{not json", b"[1, 2]", b""):
        status, answer = post(base_url + "/chat/completions", body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    status, answer = post(base_url + "/chat/completions", {"model": "testbed", "messages": [{"role": "user"}]})
    assert status == 400 and answer["error"]["param"] == "messages[0].content"
    status, answer = post(base_url + "/completions", {"model": "testbed", "max_tokens": 16})
    assert status == 400 and answer["error"]["param"] == "prompt"
    status, text = get(base_url + "/nowhere")
    assert status == 404 and "error" in json.loads(text)
    # and the server still answers
    assert chat(client, "Mia has 3 apples. How many apples does Mia have?", max_tokens=16).choices[0].message


def _wait_idle(base_url, cancelled_before, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(base_url)
        cancelled = sum(v for k, v in m.items() if k.startswith("tracelock_requests_total") and "cancelled" in k)
        if m["tracelock_requests_running"] == 0 and cancelled > cancelled_before:
            return m
        time.sleep(0.1)
    raise AssertionError(f"the dropped request still holds its slot:\n{metrics(base_url)['text']}")


def _cancelled(base_url) -> float:
    text = metrics(base_url)["text"]
    return sum(float(v) for v in re.findall(r'outcome="cancelled"\} (\S+)', text))


def test_a_dropped_client_frees_its_slot(base_url):
    # confidence commits one token per step: 64 steps, long enough to drop the client in the middle
    body = dict(model="testbed", messages=[{"role": "user", "content": "Leo has 4 books. How many books?"}],
                max_tokens=64, stream=True, policy="confidence")
    before = _cancelled(base_url)
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", url.path + "/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    while True:  # until the first piece of the answer: the row is decoding
        line = response.readline().decode()
        if '"content": "' in line and '"role"' not in line:
            break
    deadline = time.monotonic() + 30
    while metrics(base_url)["tracelock_requests_running"] != 1:
        assert time.monotonic() < deadline, "the streamed request never showed as running"
        time.sleep(0.05)
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    conn.close()
    m = _wait_idle(base_url, before)
    assert _cancelled(base_url) == before + 1 and m["tracelock_batch_occupancy"] == 0
    # a whole (non-streamed) request whose client goes away while it waits is dropped too; the client leaves right
    # after sending, not after a timeout, which a fast machine can beat with the whole answer
    body["stream"] = False
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", url.path + "/chat/completions", json.dumps(body), {"content-type": "application/json"})
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    _wait_idle(base_url, before + 1)
    assert _cancelled(base_url) == before + 2


def test_a_client_gone_before_its_body_counts_as_cancelled(base_url, client):
    # the headers promise 1000 bytes, half come, then the client leaves: the body read sees the disconnect
    before = _cancelled(base_url)
    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(f"POST {url.path}/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"model": ')
        time.sleep(0.5)  # the handler is waiting on the rest of the body
        sock.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + 30
    while _cancelled(base_url) != before + 1:
        assert time.monotonic() < deadline, "a client gone mid-body was not counted as cancelled"
        time.sleep(0.05)
    assert metrics(base_url)["tracelock_requests_running"] == 0
    assert client.completions.create(model="testbed", prompt="Mia has 3 apples.", max_tokens=8).choices[0].text \
        is not None  # and the server still answers
