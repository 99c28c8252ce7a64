"""The server's resident memory per request, one kind of request at a time (where the soak's growth is not).

Starts `tracelock serve` with the bundled model, sends 200 requests of one kind to warm it, reads its RSS, sends N more
from 4 client threads, and reads it again. Kinds: ``malformed`` (a body that is not JSON), ``refused`` (a full
server: most answered 429), ``greedy`` (plain completions), ``sampled`` (a seed each: every one its own engine),
``dropped`` (streamed, the client closes after the first piece), ``mixed`` (streamed chat, two policies, max_tokens
8 to 32: engines built and evicted). RSS is read in MiB, so small figures are at that resolution.

    python bench/studies/rss_by_request.py dropped 600
"""

import argparse
import http.client
import json
import re
import threading
import time

from tracelock.serve.process import server_process

KINDS = ("malformed", "refused", "greedy", "sampled", "dropped", "mixed")


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)[1]) // 1024


def request(kind: str, i: int) -> tuple:
    """(path, body bytes, read the whole answer?) of the i-th request of a kind."""
    base = {"model": "testbed", "prompt": "1 + 1 =", "max_tokens": 16}
    if kind == "malformed":
        return "/v1/completions", b"{not json", True
    if kind == "sampled":
        return "/v1/completions", json.dumps(base | {"temperature": 0.8, "seed": i}).encode(), True
    if kind == "dropped":
        return "/v1/completions", json.dumps(base | {"max_tokens": 32, "stream": True}).encode(), False
    if kind == "mixed":
        body = {"model": "testbed", "messages": [{"role": "user", "content": "1 + 1 ="}], "max_tokens": 8 + i % 25,
                "stream": True, "policy": ("threshold:tau=0.9", "tracelock")[i % 2]}
        return "/v1/chat/completions", json.dumps(body).encode(), True
    return "/v1/completions", json.dumps(base | ({"max_tokens": 32} if kind == "refused" else {})).encode(), True


def send(host: str, port: int, kind: str, first: int, count: int) -> None:
    for i in range(first, first + count):
        path, body, whole = request(kind, i)
        conn = http.client.HTTPConnection(host, port, timeout=120)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if whole:
            response.read()
        else:
            response.fp.readline()  # the first piece, then the client goes
            conn.sock.close()
        conn.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=KINDS)
    p.add_argument("n", type=int, help="requests measured (after 200 to warm up)")
    args = p.parse_args(argv)
    full = args.kind == "refused"  # two places and no queue: most requests of 4 clients are refused
    server = ["--model", "testbed", "--threads", "1", "--max-batch", "2" if full else "8", "--max-waiting",
              "0" if full else "64", "--policy", "threshold:tau=0.9,tracelock", "--controller", "testbed",
              "--max-engines", "16"]
    with server_process(server) as served:
        host, port = served.url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
        send(host, int(port), args.kind, 0, 200)
        time.sleep(1)
        before, start = rss_mib(served.proc.pid), time.perf_counter()
        clients = [threading.Thread(target=send, args=(host, int(port), args.kind, 10_000 * (k + 1), args.n // 4))
                   for k in range(4)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        time.sleep(2)
        after = rss_mib(served.proc.pid)
    print(f"{args.kind}: {args.n} requests in {time.perf_counter() - start:.0f} s, server RSS {before} -> {after} MiB, "
          f"{(after - before) * 1024 / args.n:.1f} KiB per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
