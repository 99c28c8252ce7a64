"""Load test of `tracelock serve` on loopback: the same requests one at a time, then from concurrent clients.

    python bench/serve_load.py --requests 64 --clients 16 --out bench/results/serve-load-<machine>-<date>.json

Starts the server (the bundled testbed model, options from ``--server-args``) in a child process, decodes
every request offline first (`tracelock.generate_many`, whose rows do not depend on their batch), then sends the
requests (held-out testbed math and code items alternating, ``max_tokens`` cycling through ``--max-tokens``) with
the `openai` client: once from one client, one at a time, and once from ``--clients`` clients, each sending its next
request when its last one is answered. Every answer of both phases must equal its offline decode (else exit 1).
Reported per phase: generated tokens/s (completion tokens / wall time), request latency p50 / p99 (nearest rank),
and from the server's /metrics the mean rows and milliseconds per decode step, the share of the wall time the
decode thread spent stepping, and tokens per CPU-second of the decode thread's steps (on a shared machine the wall
clock also measures the other jobs; the thread's CPU time measures the decoding alone). The two phases run in one
invocation on one server, so their ratio is measured under the same conditions.
"""

import argparse
import math
import os
import platform
import re
import shlex
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

DEFAULT_SERVER = "--model testbed --policy threshold:tau=0.9 --block 16 --max-tokens 64 --max-batch 16 --threads 1"


def build_requests(n: int, max_tokens: list) -> list:
    """(user message, max_tokens) pairs: held-out testbed math and code items alternating (mixed prompt lengths),
    max_tokens cycling through ``max_tokens`` (mixed generation lengths)."""
    from tracelock.eval.tasks import make_task

    math_items, code_items = (make_task(f"testbed:{t}").items(-(-n // 2)) for t in ("math", "code"))
    prompts = [it.prompt for pair in zip(math_items, code_items) for it in pair][:n]
    return [(p, max_tokens[i % len(max_tokens)]) for i, p in enumerate(prompts)]


def offline_answers(requests: list, config, policy) -> list:
    """(text, token ids) per request, as the server cuts them: `generate_many` per generation length."""
    import tracelock
    from tracelock.text import answer_ids, encode_prompt

    model, tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    out = [None] * len(requests)
    lengths = [config.gen_length(policy, m)[1] for _, m in requests]
    for gen_length in sorted(set(lengths)):
        idx = [i for i, g in enumerate(lengths) if g == gen_length]
        prompts = [encode_prompt(tok, requests[i][0]) for i in idx]
        rows, _ = tracelock.generate_many(model, prompts, batch_size=16, policy=policy.name, policy_args=policy.args,
                                          gen_length=gen_length, impl="torch", **policy.decode)
        for i, (generated, _) in zip(idx, rows):
            answer = answer_ids(generated, model.spec.end_ids)[:requests[i][1]]
            out[i] = (tok.decode(answer, skip_special_tokens=True), answer)
    return out


def percentile(values: list, q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def server_counters(base_url: str) -> dict:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics") as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(tracelock_[a-z_]+) (\S+)$", text, re.M)}


def run_phase(client, requests: list, clients: int, base_url: str) -> dict:
    """Send every request from ``clients`` closed-loop clients; (answers, figures)."""
    before = server_counters(base_url)

    def ask(i):
        prompt, max_tokens = requests[i]
        start = time.perf_counter()
        reply = client.chat.completions.create(model="testbed", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens)
        return i, reply, time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:  # a pool of C threads is C clients, each sending its next request
        results = list(pool.map(ask, range(len(requests))))
    wall = time.perf_counter() - start
    after = server_counters(base_url)
    answers = [None] * len(requests)
    latencies, tokens = [], 0
    for i, reply, seconds in results:
        answers[i] = (reply.choices[0].message.content, reply.choices[0].model_extra["token_ids"])
        latencies.append(seconds)
        tokens += reply.usage.completion_tokens
    steps, rows, busy, cpu = (after[f"tracelock_{k}"] - before[f"tracelock_{k}"] for k in (
        "decode_steps_total", "row_steps_total", "step_seconds_sum", "step_cpu_seconds_total"))
    return answers, dict(clients=clients, requests=len(requests), seconds=wall, completion_tokens=tokens,
                         tokens_per_second=tokens / wall, latency_p50=percentile(latencies, 50),
                         latency_p99=percentile(latencies, 99), decode_steps=steps, rows_per_step=rows / steps,
                         step_seconds=busy, ms_per_step=1000 * busy / steps, step_cpu_seconds=cpu,
                         tokens_per_step_cpu_second=tokens / cpu)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64, help="requests per phase (default 64)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients of the second phase (default 16)")
    p.add_argument("--max-tokens", default="64,32", help="max_tokens values, cycled over the requests (default 64,32)")
    p.add_argument("--server-args", default=DEFAULT_SERVER,
                   help=f"tracelock serve's options (default: {DEFAULT_SERVER})")
    p.add_argument("--out", help="JSON file for the figures (default: print only)")
    args = p.parse_args(argv)
    import openai

    from tracelock.cli import build_parser
    from tracelock.serve.cli import serve_config
    from tracelock.serve.process import serving

    server_args = shlex.split(args.server_args)
    config = serve_config(build_parser().parse_args(["serve", *server_args]), max_positions=512)
    if config.model_name != "testbed":
        raise SystemExit("serve_load.py checks answers against the bundled testbed model: --model testbed")
    requests = build_requests(args.requests, [int(m) for m in args.max_tokens.split(",")])
    start = time.perf_counter()
    expected = offline_answers(requests, config, config.policies[0])
    offline_seconds = time.perf_counter() - start
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with serving(server_args, env=env) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        client.chat.completions.create(model="testbed", messages=[{"role": "user", "content": "warm up"}],
                                       max_tokens=16)
        phases = {}
        for name, clients in (("one at a time", 1), (f"{args.clients} clients", args.clients)):
            answers, phases[name] = run_phase(client, requests, clients, base_url)
            wrong = [i for i, (a, e) in enumerate(zip(answers, expected)) if a[0] != e[0] or a[1] != e[1]]
            phases[name]["equal_to_offline"] = len(requests) - len(wrong)
            if wrong:
                print(f"{name}: {len(wrong)} answers differ from offline decoding, e.g. request {wrong[0]}: "
                      f"{answers[wrong[0]]!r} != {expected[wrong[0]]!r}", file=sys.stderr)
    one, many = phases.values()
    ratio = many["tokens_per_second"] / one["tokens_per_second"]
    print(f"tracelock serve {args.server_args}\n{args.requests} requests, max_tokens {args.max_tokens}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          "server decode thread 1 torch thread\n")
    print("| phase | tokens/s | p50 latency | p99 latency | rows per step | ms per step | decode thread busy | "
          "tokens per decode CPU-second | answers equal to offline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, f in phases.items():
        print(f"| {name} | {f['tokens_per_second']:.0f} | {f['latency_p50'] * 1000:.0f} ms | "
              f"{f['latency_p99'] * 1000:.0f} ms | {f['rows_per_step']:.2f} | {f['ms_per_step']:.1f} | "
              f"{100 * f['step_seconds'] / f['seconds']:.0f}% | {f['tokens_per_step_cpu_second']:.0f} | "
              f"{f['equal_to_offline']}/{f['requests']} |")
    cpu_ratio = many["tokens_per_step_cpu_second"] / one["tokens_per_step_cpu_second"]
    print(f"\nthroughput {args.clients} clients / one at a time: {ratio:.2f}x (per decode CPU-second: "
          f"{cpu_ratio:.2f}x)")
    if args.out:
        from tracelock.atomic import atomic_write_json

        atomic_write_json(Path(args.out), dict(
            command="python bench/serve_load.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            server_args=args.server_args, requests=args.requests, max_tokens=args.max_tokens,
            offline_seconds=offline_seconds, phases=phases, throughput_ratio=ratio, cpu_throughput_ratio=cpu_ratio,
            machine=dict(processor=platform.processor(), cores=os.cpu_count(), torch=torch.__version__,
                         python=platform.python_version()),
            date=time.strftime("%Y-%m-%d")))
    return 0 if all(f["equal_to_offline"] == f["requests"] for f in phases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
