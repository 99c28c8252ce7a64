"""The server's memory: on glibc the mmap threshold is pinned and the arenas capped unless the user set them, and
trimming gives freed heap pages back to the system (measured in a fresh process, so other tests' heaps do not blur
the figure); decode engines are built per shape (sampled requests of other seeds reuse one, each drawing from its
own seed) and a dropped engine is freed at once. The effect on a long mixed load is bench/soak.py's to show
(docs/serving.md)."""

import gc
import os
import queue
import re
import subprocess
import sys
import urllib.request
import weakref

import pytest

from tracelock.serve import memory

glibc_only = pytest.mark.skipif(memory._glibc() is None, reason="glibc's malloc only (Linux with glibc)")

# many small blocks freed in an order that leaves the heap's top in use: glibc keeps the freed pages until trimmed
PROGRAM = """
import re, sys
from tracelock.serve.memory import release_free_memory
def rss():
    return int(re.search(r"^VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read(), re.M)[1])
blocks = [bytearray(4000) for _ in range(60000)]
keep = blocks[-1]
del blocks
before = rss()
release_free_memory()
print(before, rss())
"""


@glibc_only
def test_malloc_is_tuned_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert memory.tune_malloc() == ["MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX"]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert memory.tune_malloc() == ["MALLOC_ARENA_MAX"]


@glibc_only
def test_trimming_gives_freed_heap_pages_back():
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}  # no automatic trim: only ours returns them
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, env=env,
                         check=True).stdout.split()
    before, after = map(int, out)
    assert before - after > 100_000, (before, after)  # KiB: most of the 240 MB of freed blocks went back


# ---- engines: built per shape, freed when dropped ---------------------------------------------------------------

@pytest.fixture(scope="module")
def testbed():
    import tracelock

    return tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")


def test_sampled_requests_of_other_seeds_reuse_one_engine_and_draw_from_their_own_seed(testbed):
    """Sampled requests of one shape (policy, generation length, temperature, prompt bucket) and other seeds take
    the same engine in turn, restarted from each one's seed: each answer is `fused_generate` of its prompt alone
    with its seed, and the server built one engine for all of them (before: one each)."""
    openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install tracelock[serve])")
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install tracelock[serve])")
    import tracelock
    from tracelock.eval.tasks import make_task
    from tracelock.serve.process import serving
    from tracelock.text import answer_ids, encode_prompt

    model, tok = testbed
    prompt = make_task("testbed:math").items(1)[0].prompt
    ids = encode_prompt(tok, prompt)
    server = ["--model", "testbed", "--policies", "threshold:tau=0.9", "--block", "16", "--max-tokens", "32",
              "--max-batch", "2", "--max-engines", "2", "--threads", "1"]
    with serving(server) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        answers = {}
        for seed in (1, 2, 3, 1):
            reply = client.chat.completions.create(model="testbed", messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=16, temperature=1.5, seed=seed)
            tokens, _ = tracelock.fused_generate(model, [ids], policy="threshold", policy_args={"tau": 0.9},
                                                 gen_length=16, block=16, temperature=1.5, seed=seed, impl="torch")
            want = answer_ids(tokens[0, len(ids):].tolist(), model.spec.end_ids)
            assert reply.choices[0].model_extra["token_ids"] == want, f"seed {seed}"
            answers.setdefault(seed, []).append(want)
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=60) as r:
            text = r.read().decode()
    assert len({tuple(a[0]) for a in answers.values()}) > 1  # the seeds drew differently: the reseed mattered
    assert float(re.search(r"^tracelock_engines_built_total (\S+)$", text, re.M)[1]) == 1


def test_a_dropped_engine_is_freed_at_once(testbed):
    """An engine refers to itself through its step functions, so dropping its lane (``max_engines`` reached) left it
    to Python's cyclic collector, which ran about once per hundred thousand surviving objects: the soak's memory
    grew with dead engines. The scheduler collects a dropped engine at once (here with the automatic collector off)."""
    from tracelock.serve.config import DecodeSetting, parse_served_policies
    from tracelock.serve.metrics import Metrics
    from tracelock.serve.scheduler import Scheduler, Submission
    from tracelock.text import encode_text

    model, tok = testbed
    policy = parse_served_policies("threshold:tau=0.9", block=16, window=None, cache=None)[0]
    ids = encode_text(tok, "Question: 2 + 2 =\nAnswer:")
    metrics = Metrics(2)
    scheduler = Scheduler(model, tok, max_batch=2, metrics=metrics, max_engines=1)

    def decode(gen_length):
        done = queue.Queue()
        sub = Submission(prompt=ids, setting=DecodeSetting(policy.label, gen_length), policy=policy,
                         max_tokens=gen_length, stops=[], stream=False, emit=done.put)
        assert scheduler.submit(sub)
        kind, _ = done.get(timeout=300)
        assert kind == "done"
        return weakref.ref(sub.lane.engine)

    automatic = gc.isenabled()
    gc.disable()
    scheduler.start()
    try:
        first = decode(16)
        assert first() is not None  # kept for reuse while the engine count allows
        second = decode(32)  # another setting; one engine at most: the first lane is dropped
        assert first() is None and second() is not None
    finally:
        scheduler.stop()
        if automatic:
            gc.enable()
    assert metrics.get("engines_built_total") == 2
