"""``tracelock serve`` in a child process on loopback, for tests and the load benchmarks: `serving(args)` starts it
on a free port, waits until ``/health`` answers, yields the base URL (``http://127.0.0.1:PORT/v1``) and stops it;
`server_process(args)` yields a `Served` (the URL, the process and its output so far) for tests that signal it or
read its memory."""

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

_LISTENING = re.compile(r"on (http://\S+/v1)")


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT/v1
    proc: subprocess.Popen
    lines: list  # the server's output lines so far (stdout and stderr)


@contextlib.contextmanager
def serving(args: list, *, env: dict | None = None, timeout: float = 300.0):
    """Run ``tracelock serve --host 127.0.0.1 --port 0 *args``; yields its base URL. Raises RuntimeError with the
    server's output when it exits or does not answer within ``timeout`` seconds."""
    with server_process(args, env=env, timeout=timeout) as served:
        yield served.url


@contextlib.contextmanager
def server_process(args: list, *, env: dict | None = None, timeout: float = 300.0):
    """`serving`, yielding a `Served`; on exit a server still running is sent SIGTERM (SIGKILL after 30 s)."""
    cmd = [sys.executable, "-m", "tracelock", "serve", "--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ if env is None else env))
    lines, found = [], threading.Event()
    url = []

    def read():  # keep draining the pipe, or a chatty server would block on a full one
        for line in proc.stdout:
            lines.append(line)
            m = _LISTENING.search(line)
            if m and not url:
                url.append(m.group(1))
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while not found.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tracelock serve did not start: {' '.join(cmd)}\n{''.join(lines)[-4000:]}")
        base = url[0]
        while True:
            try:
                with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=5) as r:
                    if json.load(r).get("status") == "ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tracelock serve is not healthy at {base}\n{''.join(lines)[-4000:]}")
            time.sleep(0.2)
        yield Served(base, proc, lines)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
