"""`tracelock serve` at its limits, on loopback with the bundled testbed model: a full server answers 429 with a
Retry-After that OpenAI's own client honours; SIGTERM lets the requests in the server finish, refuses new
connections and exits 0; a row whose decode raises is answered with an error while the rows that shared its batch
start again alone and still equal offline decoding."""

import http.client
import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install tracelock[serve])")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install tracelock[serve])")

import tracelock  # noqa: E402
from tracelock.eval.tasks import make_task  # noqa: E402
from tracelock.serve.process import server_process  # noqa: E402
from tracelock.text import answer_ids, encode_prompt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
# confidence commits one token per step: 64 steps per request, long enough to act while requests run
SERVER = ["--model", "testbed", "--policy", "confidence,threshold:tau=0.9", "--block", "16", "--max-tokens", "64",
          "--threads", "1"]


@pytest.fixture(scope="module")
def testbed():
    return tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")


@pytest.fixture(scope="module")
def prompts():
    return [it.prompt for it in make_task("testbed:math").items(6)]


def offline(testbed, prompt, gen_length=64) -> str:
    """The answer text of `fused_generate` (confidence, blocks of 16) on the chat prompt alone."""
    model, tok = testbed
    ids = encode_prompt(tok, prompt)
    tokens, _ = tracelock.fused_generate(model, [ids], policy="confidence", gen_length=gen_length, block=16,
                                         impl="torch")
    return tok.decode(answer_ids(tokens[0, len(ids):].tolist(), model.spec.end_ids), skip_special_tokens=True)


def metrics(base: str) -> str:
    conn = http.client.HTTPConnection(*_host_port(base), timeout=30)
    conn.request("GET", "/metrics")
    return conn.getresponse().read().decode()


def gauge(base: str, name: str) -> float:
    return float(re.search(rf"^tracelock_{name} (\S+)$", metrics(base), re.M)[1])


def counted(base: str, outcome: str) -> float:
    return sum(float(v) for v in re.findall(rf'outcome="{outcome}"\}} (\S+)', metrics(base)))


def _host_port(url: str) -> tuple:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def ask(base: str, prompt: str, *, stream: bool, policy="confidence", max_tokens=64) -> tuple:
    """(status, answer text or error body, headers) of one chat request over raw HTTP."""
    conn = http.client.HTTPConnection(*_host_port(base), timeout=300)
    body = dict(model="testbed", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                stream=stream, policy=policy)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    if response.status != 200 or not stream:
        answer = json.loads(response.read())
        text = answer["choices"][0]["message"]["content"] if response.status == 200 else answer
        return response.status, text, response.headers
    pieces = []
    for line in response:
        line = line.decode().strip()
        if line == "data: [DONE]":
            return 200, "".join(pieces), response.headers
        if line.startswith("data: "):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 500, chunk, response.headers
            pieces.append(chunk["choices"][0]["delta"].get("content") or "")
    return 200, "(no [DONE])" + "".join(pieces), response.headers


def wait_running(base: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while gauge(base, "requests_running") < n:
        assert time.monotonic() < deadline, f"never {n} requests running:\n{metrics(base)}"
        time.sleep(0.05)


def test_a_full_server_answers_429_with_a_retry_hint(testbed, prompts):
    with server_process([*SERVER, "--max-batch", "1", "--max-waiting", "0"]) as served:
        base = served.url.removesuffix("/v1")
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(ask, base, prompts[0], stream=True)
            wait_running(base, 1)
            status, error, headers = ask(base, prompts[1], stream=False)
            assert status == 429 and int(headers["retry-after"]) >= 1
            assert error["error"]["type"] == "rate_limit_error" and error["error"]["code"] == "server_full"
            assert "retry in" in error["error"]["message"]
            # OpenAI's client waits the Retry-After and sends again: answered once the slot is free
            client = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=8, timeout=300)
            reply = client.chat.completions.create(model="testbed", max_tokens=64, extra_body={"policy": "confidence"},
                                                   messages=[{"role": "user", "content": prompts[1]}])
            assert first.result()[:2] == (200, offline(testbed, prompts[0]))
        assert reply.choices[0].message.content == offline(testbed, prompts[1])
        assert counted(base, "refused") >= 2 and counted(base, "ok") == 2


def test_sigterm_drains_the_requests_in_the_server_then_exits_0(testbed, prompts):
    with server_process([*SERVER, "--max-batch", "2"]) as served:
        base = served.url.removesuffix("/v1")
        jobs = [(prompts[0], True), (prompts[1], False), (prompts[2], True)]  # the third waits for a slot
        with ThreadPoolExecutor(len(jobs)) as pool:
            replies = [pool.submit(ask, base, prompt, stream=stream) for prompt, stream in jobs]
            wait_running(base, 2)
            served.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while True:  # the listening socket closes: new clients are refused at once, not left hanging
                try:
                    socket.create_connection(_host_port(base), timeout=5).close()
                except ConnectionRefusedError:
                    break
                assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
                time.sleep(0.1)
            got = [r.result(timeout=300) for r in replies]
        assert served.proc.wait(timeout=120) == 0
        for (prompt, _), (status, text, _) in zip(jobs, got):
            assert (status, text) == (200, offline(testbed, prompt))
        output = "".join(served.lines)
        assert "SIGTERM: finishing the requests in the server" in output and "tracelock serve: stopped" in output
        assert "Traceback" not in output


@pytest.fixture
def in_process_server():
    """`tracelock serve` in this process (uvicorn in a thread, real HTTP on loopback), so a test can inject a fault
    into its decode engines; yields the base URL."""
    from tracelock.cli import build_parser
    from tracelock.serve.app import create_app
    from tracelock.serve.cli import _listening_socket, build_state

    args = build_parser().parse_args(["serve", *SERVER, "--max-batch", "5", "--port", "0"])
    sock = _listening_socket("127.0.0.1", 0)
    state = build_state(args)
    state.scheduler.start()
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        state.scheduler.stop()


def test_a_row_whose_decode_raises_fails_alone(in_process_server, testbed, prompts, monkeypatch):
    from tracelock.decode.engine import DecodeEngine

    base = in_process_server
    _, tok = testbed
    poison = encode_prompt(tok, prompts[3])
    real_step = DecodeEngine.step

    def step(engine):  # the injected fault: any step with the poisoned row in its batch raises
        if any(p is not None and p.tolist() == poison for p in engine._prompts):
            raise RuntimeError("injected fault: this row cannot be decoded")
        return real_step(engine)

    monkeypatch.setattr(DecodeEngine, "step", step)
    # three rows decode in one engine (streamed and whole), a fourth in another engine (generation length 48)
    jobs = [(prompts[0], True, 64), (prompts[1], False, 64), (prompts[2], True, 64), (prompts[4], False, 48)]
    with ThreadPoolExecutor(len(jobs) + 1) as pool:
        replies = [pool.submit(ask, base, prompt, stream=stream, max_tokens=n) for prompt, stream, n in jobs]
        wait_running(base, len(jobs))
        failed = pool.submit(ask, base, prompts[3], stream=False)  # joins the first engine's batch
        status, error, _ = failed.result(timeout=300)
        got = [r.result(timeout=300) for r in replies]
    assert status == 500 and error["error"]["type"] == "server_error"
    assert "injected fault" in error["error"]["message"]
    for (prompt, _, n), (status, text, _) in zip(jobs, got):
        assert (status, text) == (200, offline(testbed, prompt, gen_length=n))
    # the shared batch failed once, the poisoned row once more alone; the server goes on serving
    assert gauge(base, "step_failures_total") == 2
    assert ask(base, prompts[5], stream=False, max_tokens=16)[:2] == (200, offline(testbed, prompts[5], gen_length=16))
