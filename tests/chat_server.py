"""A scripted OpenAI-compatible chat-completions server on loopback, for testing judges without a model.

Loaded once by tests/conftest.py as the module ``chat_server`` (tests/ is not on sys.path: the tests run with
``--import-mode=importlib``), so a test file's ``from chat_server import Sleep`` is the class the server checks for.

``with chat_server() as srv:`` serves ``POST /v1/chat/completions`` on 127.0.0.1 (a free port, ``srv.server_port``).
Append replies to ``srv.script``: a str is the assistant's content, a ``(status, body[, headers])`` tuple a raw HTTP
answer, a callable(request_body) returns an entry, a `Sleep` delays one; ``srv.requests`` records what arrived.
"""

import contextlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sleep:
    """Script entry: wait `seconds` before answering with `then` (to make the client time out)."""

    def __init__(self, seconds, then):
        self.seconds, self.then = seconds, then


class _ChatHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        srv.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
        if self.path != "/v1/chat/completions":
            return self._send(404, json.dumps({"error": f"no route {self.path}"}))
        entry = srv.script.pop(0) if srv.script else (500, "script exhausted")
        if callable(entry):
            entry = entry(body)
        if isinstance(entry, Sleep):
            time.sleep(entry.seconds)
            entry = entry.then
        if isinstance(entry, str):
            completion = {"id": f"cmpl-{len(srv.requests)}", "object": "chat.completion", "model": body["model"],
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": entry},
                                       "finish_reason": "stop"}]}
            return self._send(200, json.dumps(completion))
        status, payload, *headers = entry
        return self._send(status, payload, headers[0] if headers else {})

    def _send(self, status, payload, headers=None):
        data = payload.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # a client that timed out closed the socket before a Sleep entry answered: expected, not an error
        pass


@contextlib.contextmanager
def chat_server():
    """The scripted server (see the module docstring), shut down on exit."""
    srv = _Server(("127.0.0.1", 0), _ChatHandler)
    srv.script, srv.requests = [], []
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def ranking_candidates(body) -> dict[str, str]:
    """candidate id -> answer text, read back from a ranking request the server received."""
    user = body["messages"][1]["content"]
    shown = user.split("\nCandidates:\n", 1)[1]
    return dict(re.findall(r"\[(candidate_\d+)\]\n(.*?)(?=\n\n\[candidate_\d+\]\n|\Z)", shown, flags=re.S))
