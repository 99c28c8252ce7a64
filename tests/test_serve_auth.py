"""`tracelock serve --api-key` and `--served-model-name` on loopback, driven by the real `openai` client, and the
README's CPU serve command with the client snippet beside it, run as written."""

import json
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install tracelock[serve])")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install tracelock[serve])")

from tracelock.serve.process import serving  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-4b1d"
SERVER = ["--model", "testbed", "--block", "16", "--max-tokens", "32", "--max-batch", "2", "--threads", "1",
          "--served-model-name", "llada-mini", "--api-key", KEY]
ASK = [{"role": "user", "content": "Zoe has 9 books. She finds 4 more books. How many books does Zoe have now?"}]


@pytest.fixture(scope="module")
def base_url():
    with serving(SERVER) as url:
        yield url


def client(base_url, key):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


def test_a_request_with_a_wrong_key_gets_401_with_an_openai_error_body(base_url):
    with pytest.raises(openai.AuthenticationError) as err:
        client(base_url, "wrong-key").chat.completions.create(model="llada-mini", messages=ASK, max_tokens=16)
    assert err.value.status_code == 401
    body = err.value.response.json()["error"]
    assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error"
    assert "not this server's" in body["message"] and "--api-key" in body["message"]
    with pytest.raises(openai.AuthenticationError):
        client(base_url, "wrong-key").models.list()


def _errors(root: str, endpoint: str) -> float:
    """tracelock_requests_total{endpoint, outcome="error"} as /metrics reads now (0 before the first)."""
    with urllib.request.urlopen(root + "/metrics", timeout=30) as r:
        text = r.read().decode()
    line = f'tracelock_requests_total{{endpoint="{endpoint}",outcome="error"}} '
    found = re.search(re.escape(line) + r"(\S+)", text)
    return float(found.group(1)) if found else 0.0


def test_a_refused_key_counts_as_an_error_in_metrics(base_url):
    root = base_url.removesuffix("/v1")
    before = _errors(root, "chat"), _errors(root, "completions")
    with pytest.raises(openai.AuthenticationError):
        client(base_url, "wrong-key").chat.completions.create(model="llada-mini", messages=ASK, max_tokens=16)
    with pytest.raises(openai.AuthenticationError):
        client(base_url, "wrong-key").completions.create(model="llada-mini", prompt="2 + 2 =", max_tokens=16)
    assert (_errors(root, "chat"), _errors(root, "completions")) == (before[0] + 1, before[1] + 1)


def test_health_and_metrics_stay_open(base_url):
    root = base_url.removesuffix("/v1")
    for path in ("/health", "/metrics"):
        with urllib.request.urlopen(root + path, timeout=30) as r:
            assert r.status == 200
    request = urllib.request.Request(base_url + "/models")  # no Authorization header at all
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    body = json.load(err.value)["error"]
    assert err.value.code == 401 and body["code"] == "invalid_api_key" and "no API key was sent" in body["message"]


def test_the_key_and_the_served_name_answer_plainly_and_streamed(base_url):
    c = client(base_url, KEY)
    assert [m.id for m in c.models.list().data] == ["llada-mini"]
    reply = c.chat.completions.create(model="llada-mini", messages=ASK, max_tokens=32)
    assert reply.model == "llada-mini" and reply.choices[0].message.content.strip().endswith("#### 13")
    chunks = list(c.chat.completions.create(model="llada-mini", messages=ASK, max_tokens=32, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == reply.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as err:  # the folder's name is not served under another name
        c.chat.completions.create(model="testbed", messages=ASK, max_tokens=16)
    assert "'llada-mini'" in err.value.response.json()["error"]["message"]


def test_an_empty_api_key_is_refused_before_the_model_loads():
    done = subprocess.run([sys.executable, "-m", "tracelock", "serve", "--model", "testbed", "--api-key", " ",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--api-key must be a non-empty key" in done.stderr


def _readme_blocks():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Serve it"):]
    command = re.search(r"```bash\n(tracelock serve --model testbed[^\n]*)\n```", section).group(1)
    snippet = re.search(r"```python\n(from openai import OpenAI.*?)```", section, re.S).group(1)
    return command, snippet


def test_the_readme_cpu_serve_command_and_its_client_snippet_work_together(tmp_path):
    command, snippet = _readme_blocks()
    args = shlex.split(command)[2:]
    assert "--api-key" in args and "--port" in args
    with serving(args + ["--port", "0", "--threads", "1"]) as url:  # the last --port wins: any free one
        script = tmp_path / "client.py"
        script.write_text(snippet.replace("http://127.0.0.1:8000/v1", url))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "#### 13" in done.stdout
