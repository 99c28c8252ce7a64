"""Soak test of `tracelock serve` under faults, on loopback: many clients, mixed traffic, dropped connections,
malformed bodies, a full batch.

    python bench/soak.py --requests 2000 --clients 32 --out bench/results/soak-<machine>-<date>.json

Starts the server (the bundled testbed model; three policies, TraceLock with its shipped controller among them) in
a child process and sends a planned mix of requests from ``--clients`` closed-loop clients (each sends its next
request when its last one is over), over raw HTTP (`http.client`, so a client can drop its connection at any point):

- valid requests: chat and completions, whole and streamed, ``max_tokens`` 8 to 32, each allowed policy, stop
  strings or none, unknown extra fields; a share sampled (``temperature`` 0.8) with a seed of their own;
- ``--drop`` of them: the client goes away right after sending, or mid-stream after the first piece of the answer;
- ``--malformed`` of them: bodies that are not JSON or not UTF-8, mistyped or missing fields, values out of range,
  prompts longer than the context, another model, an unknown policy, too many stop strings;
- the batch (``--max-batch``) plus its queue (``--max-waiting``) is smaller than the clients, so requests also meet
  a full server: a 429 with Retry-After, which the client honours and then sends the same request again.

Checks (any failure: exit 1): every valid answer equals offline decoding at the same settings (greedy rows:
`generate_many` of the prompt; sampled rows: `fused_generate` of the prompt alone with its seed, which is what the
server does for a request alone in its engine); every malformed request gets its 4xx naming the field; no 5xx, no
connection error, no request left without an answer, no response id seen twice; the server's /metrics add up
(requests in = answered + refused + cancelled, per outcome against what the clients saw; nothing running or
waiting at the end). Reported: requests/s and completion tokens/s, p50 / p99 latency (first send to last byte, retries
included), time to the first streamed token, 429s, and the server's resident memory (RSS) after a warm-up round of
the same mix, at its peak and at the end.
"""

import argparse
import http.client
import json
import math
import os
import platform
import random
import re
import shlex
import socket
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

POLICIES = ("threshold:tau=0.9", "confidence", "tracelock")
SERVER = ("--model testbed --policy threshold:tau=0.9,confidence,tracelock --controller testbed --block 16 "
          "--max-tokens 32 --default-max-tokens 16 --max-engines 16 --threads 1")
MAX_TOKENS = (8, 16, 24, 32)
STOPS = (None, ["\n"], ["####", " = "])
TIMEOUT = 600  # seconds a client waits on one response before it counts the request as lost


@dataclass
class Job:
    """One planned request and what happened to it."""

    id: int
    kind: str  # "valid", "drop", "malformed"
    path: str  # /v1/chat/completions or /v1/completions
    body: bytes
    stream: bool = False
    drop: str | None = None  # "sent": right after sending; "first": after the first piece of a streamed answer
    expect: tuple | None = None  # malformed: (status, param)
    setting: tuple | None = None  # valid: (prompt ids, policy, gen_length, temperature, seed, max_tokens, stops)
    # what happened
    status: int | None = None
    answer: dict | None = None  # text, token_ids, finish_reason, completion_tokens, id
    error: str | None = None
    refusals: int = 0
    seconds: float = 0.0
    first_token: float | None = None
    problems: list = field(default_factory=list)


# ---- the plan ---------------------------------------------------------------------------------------------------

def _prompts(n: int) -> list:
    """User messages: held-out testbed math and code items alternating (mixed lengths)."""
    from tracelock.eval.tasks import make_task

    math_items, code_items = (make_task(f"testbed:{t}").items(-(-n // 2)) for t in ("math", "code"))
    return [it.prompt for pair in zip(math_items, code_items) for it in pair][:n]


def _malformed(rng: random.Random, prompt: str) -> tuple:
    """(path, raw body, expected status, expected param) of one bad request."""
    chat = dict(model="testbed", messages=[{"role": "user", "content": prompt}], max_tokens=16)
    cases = [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"\xff\xfe\x00garbage", 400, None),
        ("/v1/completions", b"[1, 2, 3]", 400, None),
        ("/v1/chat/completions", chat | {"max_tokens": "16"}, 400, "max_tokens"),
        ("/v1/chat/completions", chat | {"max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", chat | {"max_tokens": 10_000}, 400, "max_tokens"),
        ("/v1/chat/completions", chat | {"messages": [{"role": "user", "content": "apples " * 3000}]}, 400,
         "messages"),
        ("/v1/completions", dict(model="testbed", prompt="pears " * 3000, max_tokens=16), 400, "prompt"),
        ("/v1/completions", dict(model="testbed", max_tokens=16), 400, "prompt"),
        ("/v1/chat/completions", chat | {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", chat | {"messages": [{"role": "robot", "content": prompt}]}, 400,
         "messages[0].role"),
        ("/v1/chat/completions", chat | {"n": 3}, 400, "n"),
        ("/v1/chat/completions", chat | {"temperature": 5}, 400, "temperature"),
        ("/v1/chat/completions", chat | {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/chat/completions", chat | {"policy": "no-such-policy"}, 400, "policy"),
        ("/v1/chat/completions", chat | {"model": "gpt-4"}, 404, "model"),
    ]
    path, body, status, param = rng.choice(cases)
    return path, body if isinstance(body, bytes) else json.dumps(body).encode(), status, param


def build_plan(n: int, *, drop: float, malformed: float, sampled: float, seed: int, tokenizer) -> list:
    """``n`` jobs in a shuffled order: ``drop`` and ``malformed`` shares of them, the rest valid."""
    from tracelock.text import encode_prompt, encode_text

    rng = random.Random(seed)
    prompts = _prompts(48)
    kinds = ["drop"] * round(n * drop) + ["malformed"] * round(n * malformed)
    kinds += ["valid"] * (n - len(kinds))
    rng.shuffle(kinds)
    jobs = []
    for i, kind in enumerate(kinds):
        prompt = rng.choice(prompts)
        if kind == "malformed":
            path, body, status, param = _malformed(rng, prompt)
            jobs.append(Job(i, kind, path, body, expect=(status, param)))
            continue
        chat = rng.random() < 0.5
        stream = rng.random() < 0.5 if kind == "valid" else rng.random() < 0.7
        policy, max_tokens, stops = rng.choice(POLICIES), rng.choice(MAX_TOKENS), rng.choice(STOPS)
        temperature, draw = (0.8, 10_000 + i) if rng.random() < sampled else (0.0, 0)
        body = dict(model="testbed", max_tokens=max_tokens, policy=policy, stream=stream, user=f"soak-{i}")
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            ids = encode_prompt(tokenizer, prompt)
        else:  # a completion of plain text: the tokenizer's BOS and the text, no chat template
            body["prompt"] = f"Question: {prompt}\nAnswer:"
            ids = encode_text(tokenizer, body["prompt"])
        if stops:
            body["stop"] = stops
        if temperature:
            body.update(temperature=temperature, seed=draw)
        if rng.random() < 0.2:  # fields this server does not know are ignored, as OpenAI's SDK may send new ones
            body["x_trace_tag"] = {"soak": i, "note": "unknown field"}
        gen_length = -(-max_tokens // 16) * 16
        drop_at = None if kind == "valid" else "first" if stream and rng.random() < 0.6 else "sent"
        jobs.append(Job(i, kind, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode(),
                        stream=stream, drop=drop_at,
                        setting=(tuple(ids), policy, gen_length, temperature, draw, max_tokens, tuple(stops or ()))))
    return jobs


# ---- offline answers --------------------------------------------------------------------------------------------

def offline_answers(jobs: list, model, tokenizer) -> dict:
    """setting -> (text, token_ids, finish_reason) for every valid job, as the server must answer it."""
    import tracelock
    from tracelock.eval.runner import PolicySpec, build_policy
    from tracelock.serve.config import parse_served_policies
    from tracelock.serve.stream import TextStream
    from tracelock.text import answer_ids

    served = {p.label: p for p in parse_served_policies(",".join(POLICIES), block=16, window=None, cache=None)}
    settings = sorted({j.setting for j in jobs if j.kind == "valid"}, key=repr)
    generated = {}  # (ids, policy, gen_length, temperature, seed) -> generated ids
    decodes = {}
    for s in settings:
        decodes.setdefault(s[1:5], set()).add(s[0])
    for (label, gen_length, temperature, seed), prompts in sorted(decodes.items(), key=repr):
        p = served[label]
        policy = build_policy(PolicySpec(p.label, p.name, p.args), model, controller="testbed")
        prompts = sorted(prompts)
        if temperature:  # each alone with its own seed (its own engine on the server)
            for ids in prompts:
                tokens, _ = tracelock.fused_generate(model, [list(ids)], policy=policy, gen_length=gen_length,
                                                     temperature=temperature, seed=seed, impl="torch", **p.decode)
                generated[(ids, label, gen_length, temperature, seed)] = tokens[0, len(ids):].tolist()
            continue
        rows, _ = tracelock.generate_many(model, [list(ids) for ids in prompts], batch_size=16, policy=policy,
                                          gen_length=gen_length, impl="torch", **p.decode)
        for ids, (gen, _) in zip(prompts, rows):
            generated[(ids, label, gen_length, 0.0, 0)] = gen
    out = {}
    for s in settings:
        gen = generated[s[:5]]
        answer = answer_ids(gen, model.spec.end_ids)
        stream = TextStream(tokenizer, s[5], list(s[6]))
        stream.update(answer, complete=True, ended=len(answer) < len(gen))
        out[s] = (stream.answer.text, stream.answer.token_ids, stream.answer.finish_reason)
    return out


# ---- the clients ------------------------------------------------------------------------------------------------

class Client:
    """Sends a job over a fresh connection, honours 429 / 503 Retry-After, reads a whole or streamed answer."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    def run(self, job: Job) -> Job:
        start = time.perf_counter()
        try:
            while True:
                retry = self._attempt(job, start)
                if retry is None:
                    break
                job.refusals += 1
                time.sleep(retry)
        except (OSError, http.client.HTTPException) as err:  # lost: no answer at all
            job.error = f"{type(err).__name__}: {err}"
        job.seconds = time.perf_counter() - start
        return job

    def _attempt(self, job: Job, start: float):
        """One send; the seconds to wait when refused (429 / 503), else None."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)
        try:
            conn.request("POST", job.path, job.body, {"content-type": "application/json"})
            if job.drop == "sent":
                return self._drop(conn)
            response = conn.getresponse()
            job.status = response.status
            if response.status in (429, 503):
                response.read()
                return float(response.headers.get("retry-after", "1"))
            if not job.stream or response.status != 200:
                job.answer = json.loads(response.read() or b"null")
                return None
            return self._read_stream(conn, response, job, start)
        finally:
            conn.close()

    @staticmethod
    def _drop(conn):
        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away; conn.close() follows
        return None

    def _read_stream(self, conn, response, job: Job, start: float):
        text, finish, usage, ids = [], None, None, set()
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                job.answer = dict(text="".join(text), finish_reason=finish, usage=usage, ids=sorted(ids))
                return None
            chunk = json.loads(line[6:])
            if "error" in chunk:
                job.answer = chunk
                return None
            ids.add(chunk["id"])
            choice = chunk["choices"][0]
            piece = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
            if piece:
                if job.first_token is None:
                    job.first_token = time.perf_counter() - start
                text.append(piece)
                if job.drop == "first":
                    return self._drop(conn)
            finish, usage = choice.get("finish_reason") or finish, chunk.get("usage") or usage
        job.error = "the stream ended without [DONE]"
        return None


# ---- checks -----------------------------------------------------------------------------------------------------

def check(job: Job, expected: dict) -> None:
    """Fill ``job.problems`` with what is wrong about its answer."""
    if job.error:
        job.problems.append(f"no answer: {job.error}")
        return
    if job.status is not None and job.status >= 500:
        job.problems.append(f"HTTP {job.status}: {job.answer}")
        return
    if job.kind == "drop":
        return
    if job.kind == "malformed":
        status, param = job.expect
        err = (job.answer or {}).get("error") if isinstance(job.answer, dict) else None
        if job.status != status or not err or err.get("param") != param or not err.get("message"):
            job.problems.append(f"expected {status} naming {param!r}, got {job.status}: {job.answer}")
        return
    if job.status != 200 or not isinstance(job.answer, dict) or "error" in job.answer:
        job.problems.append(f"HTTP {job.status}: {job.answer}")
        return
    text, token_ids, finish = expected[job.setting]
    if job.stream:
        got = (job.answer["text"], job.answer["finish_reason"], (job.answer["usage"] or {}).get("completion_tokens"))
        want = (text, finish, len(token_ids))
    else:
        choice = job.answer["choices"][0]
        content = choice["text"] if "text" in choice else choice["message"]["content"]
        got = (content, choice["token_ids"], choice["finish_reason"])
        want = (text, token_ids, finish)
    if got != want:
        job.problems.append(f"answer {got!r} != offline {want!r}")


def response_ids(job: Job) -> list:
    if job.kind != "valid" or not isinstance(job.answer, dict) or job.problems:
        return []
    return job.answer["ids"] if job.stream else [job.answer["id"]]


def server_counters(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(tracelock_\S+) (\S+)$", text, re.M)}


def outcomes(counters: dict) -> Counter:
    out = Counter()
    for key, value in counters.items():
        m = re.match(r'tracelock_requests_total\{endpoint="\w+",outcome="(\w+)"\}', key)
        if m:
            out[m[1]] += value
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return 1024 * int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)[1])


def settle(base: str, timeout: float = 60) -> dict:
    """/metrics once nothing runs or waits (a dropped request leaves at the next step)."""
    deadline = time.monotonic() + timeout
    while True:
        counters = server_counters(base)
        if counters["tracelock_requests_running"] == counters["tracelock_requests_waiting"] == 0:
            return counters
        if time.monotonic() > deadline:
            return counters
        time.sleep(0.2)


def run_round(jobs: list, clients: int, client: Client, base: str, expected: dict, pid: int) -> dict:
    """Send every job from ``clients`` clients; check them and the server's counters; the figures."""
    before = server_counters(base)
    load_before = os.getloadavg()
    start = time.perf_counter()
    timeline, stop = [(0.0, rss_bytes(pid))], threading.Event()
    # the server's RSS by requests done: at every 40th of the round, and at its half (the second half's growth)
    by_requests, finished, lock = [(0, timeline[0][1])], [0], threading.Lock()
    every = max(1, len(jobs) // 40)

    def watch():  # the server's resident memory, twice a second
        while not stop.wait(0.5):
            timeline.append((time.perf_counter() - start, rss_bytes(pid)))

    def run(job):
        job = client.run(job)
        with lock:
            finished[0] += 1
            if finished[0] % every == 0 or finished[0] == len(jobs) // 2:
                by_requests.append((finished[0], rss_bytes(pid)))
        return job

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(clients) as pool:  # C threads pulling jobs: C closed-loop clients
        done = list(pool.map(run, jobs))
    wall = time.perf_counter() - start
    after = settle(base)
    stop.set()
    watcher.join()
    rss_end = rss_bytes(pid)
    for job in done:
        check(job, expected)
    seen = Counter(i for job in done for i in response_ids(job))
    duplicated = sum(c - 1 for c in seen.values() if c > 1)
    got = outcomes(after) - outcomes(before)
    kinds = Counter(j.kind for j in done)
    refused = sum(j.refusals for j in done)
    dropped = kinds["drop"]
    # a client that leaves right after sending never reads its answer: the server may have refused it (429)
    unseen_refusals = got["refused"] - refused
    counter_problems = []
    if sum(got.values()) != len(done) + refused:
        counter_problems.append(f"requests in {len(done) + refused} != counted {dict(got)}")
    if not 0 <= unseen_refusals <= sum(j.drop == "sent" for j in done):
        counter_problems.append(f"refused: server {got['refused']}, clients saw {refused}")
    if got["error"] != kinds["malformed"]:
        counter_problems.append(f"error: server {got['error']}, malformed {kinds['malformed']}")
    if got["ok"] + got["cancelled"] + unseen_refusals != kinds["valid"] + dropped or got["cancelled"] > dropped:
        counter_problems.append(f"ok {got['ok']} + cancelled {got['cancelled']} + refused unseen {unseen_refusals} "
                                f"!= valid {kinds['valid']} + dropped {dropped}")
    if after["tracelock_requests_running"] or after["tracelock_requests_waiting"]:
        counter_problems.append("requests still running or waiting after every client is done")
    valid = [j for j in done if j.kind == "valid" and not j.problems]
    latencies = [j.seconds for j in valid]
    ttft = [j.first_token for j in valid if j.stream and j.first_token is not None]
    tokens = sum(len(j.answer["choices"][0]["token_ids"]) if not j.stream else j.answer["usage"]["completion_tokens"]
                 for j in valid)
    return dict(
        requests=len(done), clients=clients, seconds=wall, kinds=dict(kinds),
        streamed=sum(j.stream for j in done if j.kind == "valid"),
        sampled=sum(1 for j in done if j.kind == "valid" and j.setting[3] > 0),
        refused_429_503=refused, cancelled=got["cancelled"], dropped_but_answered=dropped - got["cancelled"],
        server_outcomes=dict(got), lost=sum(1 for j in done if j.error), duplicated=duplicated,
        status_5xx=sum(1 for j in done if j.status is not None and j.status >= 500),
        wrong=[dict(id=j.id, kind=j.kind, problems=j.problems) for j in done if j.problems][:20],
        wrong_count=sum(1 for j in done if j.problems), counter_problems=counter_problems,
        equal_to_offline=len(valid), requests_per_second=len(done) / wall, completion_tokens=tokens,
        tokens_per_second=tokens / wall, latency_p50=percentile(latencies, 50), latency_p99=percentile(latencies, 99),
        ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
        rss_start=timeline[0][1], rss_peak=max(r for _, r in timeline), rss_end=rss_end,
        rss_half=dict(by_requests).get(len(jobs) // 2, rss_end),  # after half the round's requests were answered
        rss_timeline=timeline[::max(1, len(timeline) // 40)],  # about 40 (seconds, bytes) points
        rss_by_requests=sorted(by_requests),  # (requests answered, bytes)
        load_average=dict(start=load_before, end=os.getloadavg()),  # the machine's 1 / 5 / 15-minute load
        engines=(before["tracelock_engines"], after["tracelock_engines"]),
        engines_built=after.get("tracelock_engines_built_total", 0) - before.get("tracelock_engines_built_total", 0),
        decode_steps=after["tracelock_decode_steps_total"] - before["tracelock_decode_steps_total"],
        rows_per_step=(after["tracelock_row_steps_total"] - before["tracelock_row_steps_total"])
        / max(1, after["tracelock_decode_steps_total"] - before["tracelock_decode_steps_total"]))


def percentile(values: list, q: float) -> float | None:
    """Nearest-rank percentile (None of nothing)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def passed(figures: dict) -> bool:
    return not (figures["wrong_count"] or figures["counter_problems"] or figures["lost"] or figures["duplicated"]
                or figures["status_5xx"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="requests of the soak round (default 2000)")
    p.add_argument("--warmup", type=int, default=128,
                   help="requests of the warm-up round of the same mix, checked too, before the memory baseline "
                        "(default 128)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    p.add_argument("--drop", type=float, default=0.1, help="share of requests whose client goes away (default 0.1)")
    p.add_argument("--malformed", type=float, default=0.1, help="share of malformed requests (default 0.1)")
    p.add_argument("--sampled", type=float, default=0.05,
                   help="share of the other requests that sample, each with its own seed (default 0.05)")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    p.add_argument("--max-waiting", type=int, default=16,
                   help="the server's --max-waiting; batch + waiting below --clients meets a full server "
                        "(default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the plan (default 0)")
    p.add_argument("--max-rss-growth", type=float,
                   help="also fail when the server's RSS grows more than this share over the soak round, e.g. 0.05 "
                        "(default: report it only)")
    p.add_argument("--max-rss-growth-second-half", type=float,
                   help="also fail when the server's RSS grows more than this share over the second half of the soak "
                        "round's requests, e.g. 0.01: whether it levelled off (default: report it only)")
    p.add_argument("--server-args", default=SERVER, help=f"tracelock serve's other options (default: {SERVER})")
    p.add_argument("--out", help="JSON file for the figures (default: print only)")
    args = p.parse_args(argv)
    for name in ("requests", "clients", "max_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (0 <= args.drop and 0 <= args.malformed and args.drop + args.malformed <= 1 and 0 <= args.sampled <= 1):
        p.error("--drop and --malformed must be shares in [0, 1] whose sum is at most 1; --sampled in [0, 1]")

    import torch

    import tracelock
    from tracelock.serve.process import server_process

    model, tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    plan = dict(drop=args.drop, malformed=args.malformed, sampled=args.sampled, tokenizer=tok)
    warmup = build_plan(args.warmup, seed=args.seed + 1, **plan) if args.warmup else []
    jobs = build_plan(args.requests, seed=args.seed, **plan)
    start = time.perf_counter()
    expected = offline_answers(warmup + jobs, model, tok)
    offline_seconds = time.perf_counter() - start
    server_args = [*shlex.split(args.server_args), "--max-batch", str(args.max_batch), "--max-waiting",
                   str(args.max_waiting)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with server_process(server_args, env=env) as served:
        base = served.url.removesuffix("/v1")
        host, port = base.removeprefix("http://").rsplit(":", 1)
        client = Client(host, int(port))
        rss_cold = rss_bytes(served.proc.pid)
        rounds = {}
        if warmup:
            rounds["warm-up"] = run_round(warmup, args.clients, client, base, expected, served.proc.pid)
        rounds["soak"] = run_round(jobs, args.clients, client, base, expected, served.proc.pid)
        served.proc.terminate()
        exit_code = served.proc.wait(timeout=120)
    soak = rounds["soak"]
    growth = soak["rss_end"] / soak["rss_start"] - 1
    second_half = soak["rss_end"] / soak["rss_half"] - 1
    ok = all(passed(r) for r in rounds.values()) and exit_code == 0
    if args.max_rss_growth is not None and growth > args.max_rss_growth:
        print(f"the server's RSS grew {growth:.1%} over the soak, more than --max-rss-growth {args.max_rss_growth}",
              file=sys.stderr)
        ok = False
    if args.max_rss_growth_second_half is not None and second_half > args.max_rss_growth_second_half:
        print(f"the server's RSS grew {second_half:.1%} over the soak's second half, more than "
              f"--max-rss-growth-second-half {args.max_rss_growth_second_half}", file=sys.stderr)
        ok = False
    mib = 1 << 20
    print(f"tracelock serve {' '.join(server_args)}\n{platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}; offline answers {offline_seconds:.0f} s\n")
    print("| round | requests | clients | valid / dropped / malformed | 429s | lost | duplicated | 5xx | "
          "equal to offline | requests/s | tokens/s | p50 / p99 latency | p50 / p99 first token | RSS start / peak / "
          "end |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rounds.items():
        k = r["kinds"]
        valid = k.get("valid", 0)
        ttft = "n/a" if r["ttft_p50"] is None else f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} s"
        print(f"| {name} | {r['requests']} | {r['clients']} | {valid} / {k.get('drop', 0)} / "
              f"{k.get('malformed', 0)} | {r['refused_429_503']} | {r['lost']} | {r['duplicated']} | "
              f"{r['status_5xx']} | {r['equal_to_offline']} / {valid} | {r['requests_per_second']:.2f} | "
              f"{r['tokens_per_second']:.0f} | {r['latency_p50']:.2f} / {r['latency_p99']:.2f} s | {ttft} | "
              f"{r['rss_start'] / mib:.0f} / {r['rss_peak'] / mib:.0f} / {r['rss_end'] / mib:.0f} MiB |")
        for problem in r["counter_problems"] + [f"request {w['id']} ({w['kind']}): {w['problems'][0]}"
                                                for w in r["wrong"]]:
            print(f"  {name}: {problem}", file=sys.stderr)
    load = soak["load_average"]
    print(f"\nserver RSS: {rss_cold / mib:.0f} MiB after start, soak {growth:+.1%} from its start to its end, "
          f"{second_half:+.2%} over its second half ({soak['rss_half'] / mib:.1f} to {soak['rss_end'] / mib:.1f} MiB); "
          f"engines built in the soak: {soak['engines_built']:.0f}; load average {load['start'][0]:.1f} at its start, "
          f"{load['end'][0]:.1f} at its end; server exit status after SIGTERM: {exit_code}")
    if args.out:
        from tracelock.atomic import atomic_write_json

        atomic_write_json(Path(args.out), dict(
            command="python bench/soak.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            server_args=server_args, rounds=rounds, rss_cold=rss_cold, rss_growth=growth,
            rss_growth_second_half=second_half, exit_code=exit_code,
            offline_seconds=offline_seconds, passed=ok,
            machine=dict(processor=platform.processor(), cores=os.cpu_count(), torch=torch.__version__,
                         python=platform.python_version()),
            date=time.strftime("%Y-%m-%d")))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
