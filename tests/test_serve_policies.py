"""The server's decode path (`tracelock.serve.scheduler.Scheduler`, the engines it builds per served policy) with the
rules added last: Fast-dLLM++'s `frechet`, the end-of-text hold of each heuristic, and the fitted gate over a stateful
rule. Every request's answer and steps are `fused_generate`'s on its prompt alone, while several requests share the
batch."""

import queue

import pytest

import tracelock
from tracelock.eval.tasks import make_task
from tracelock.text import answer_ids, encode_prompt

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK, GEN = 16, 64
SERVED = "frechet:delta=0.0,frechet:delta=0.1:hold_end=true,factor:f=1.0:hold_end=true," \
         "confidence:per_step=2:hold_end=true,threshold:tau=0.9:hold_end=true," \
         "gate:controller=testbed:base=credit:base_tau=0.7:veto=0.5:accept=0.95"


def test_served_rules_equal_fused_generate():
    from tracelock.serve.config import DecodeSetting, parse_served_policies
    from tracelock.serve.metrics import Metrics
    from tracelock.serve.scheduler import Scheduler, Submission

    model, tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    prompts = [encode_prompt(tok, it.prompt) for it in make_task("testbed:math@validation").items(3)]
    policies = parse_served_policies(SERVED, block=BLOCK, window=None, cache=None)
    scheduler = Scheduler(model, tok, max_batch=4, metrics=Metrics(4))
    done, subs = queue.Queue(), []
    for policy in policies:
        for i, ids in enumerate(prompts):
            sub = Submission(prompt=ids, setting=DecodeSetting(policy.label, GEN), policy=policy, max_tokens=GEN,
                             stops=[], stream=False, emit=lambda msg, key=(policy.label, i): done.put((key, msg)))
            subs.append(sub)
    scheduler.start()
    try:
        for sub in subs:
            assert scheduler.submit(sub)
        results = {}
        for _ in subs:
            key, (kind, result) = done.get(timeout=600)
            assert kind == "done", result
            results[key] = result
    finally:
        scheduler.stop()
    for policy in policies:
        for i, ids in enumerate(prompts):
            tokens, stats = tracelock.fused_generate(model, [ids], policy=policy.name, policy_args=policy.args,
                                                     gen_length=GEN, **policy.decode)
            got = results[(policy.label, i)]
            assert got.answer.token_ids == answer_ids(tokens[0, len(ids):].tolist(), model.spec.end_ids)[:GEN], \
                (policy.label, i)
            assert got.steps == stats.steps[0], (policy.label, i)


# the rules published since Fast-dLLM; three keep a memory per slot (credit, klass, less), carried by the engine's slots
SINCE = "klass:tau=0.9,credit:tau=0.9,less,hierarchy:low=0.3,eb:gamma=0.01,pc:background=testbed:per_step=2"


def test_the_rules_since_fastdllm_over_http_equal_fused_generate():
    """`tracelock serve` on loopback with the real openai client: requests of every rule at once, several rows of one
    engine each, answer and steps as `fused_generate` on the prompt alone; a request that asks a memory rule to sample
    and one that names a spec the server does not allow are 400s naming the field."""
    openai = pytest.importorskip("openai", reason="the serve extra is not installed (pip install tracelock[serve])")
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install tracelock[serve])")
    from concurrent.futures import ThreadPoolExecutor

    from tracelock.serve.config import parse_served_policies
    from tracelock.serve.process import serving
    from tracelock.text import encode_text

    model, tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    items = make_task("testbed:math@validation").items(2)
    texts = [tok.apply_chat_template([{"role": "user", "content": it.prompt}], tokenize=False,
                                     add_generation_prompt=True) for it in items]
    policies = parse_served_policies(SINCE, block=BLOCK, window=None, cache=None)
    jobs = [(p, text) for p in policies for text in texts]
    args = ["--model", "testbed", "--policies", SINCE, "--block", str(BLOCK), "--max-tokens", str(GEN),
            "--max-batch", "4", "--threads", "1"]
    with serving(args) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)

        def ask(job):
            policy, text = job
            return client.completions.create(model="testbed", prompt=text, max_tokens=GEN,
                                             extra_body={"policy": policy.label})

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, jobs))
        assert client.models.list().data[0].model_extra["policies"] == [p.label for p in policies]
        for bad, param, says in ((dict(temperature=0.5, extra_body={"policy": "klass"}), "temperature",
                                  "keeps a memory per slot and decodes greedily; send temperature 0"),
                                 (dict(temperature=0.7, extra_body={"policy": "credit:tau=0.9"}), "temperature",
                                  "send temperature 0"),
                                 (dict(extra_body={"policy": "klass:tau=2"}), "policy", "is not allowed on this "
                                                                                        "server; allowed: klass")):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="testbed", prompt=texts[0], max_tokens=16, **bad)
            body = err.value.body if isinstance(err.value.body, dict) else {}
            assert body.get("param") == param and says in body.get("message", ""), body
        # a rule without memory samples as before
        assert client.completions.create(model="testbed", prompt=texts[0], max_tokens=16, temperature=0.5, seed=1,
                                         extra_body={"policy": "hierarchy"}).choices[0].text is not None
    for (policy, text), reply in zip(jobs, replies):
        ids = encode_text(tok, text)
        # the server runs the C++ ops, which decide as torch's; the tests' Triton interpreter (the default impl under
        # pytest) may break a tie another way
        tokens, stats = tracelock.fused_generate(model, [ids], policy=policy.name, policy_args=policy.args,
                                                 gen_length=GEN, impl="torch", **policy.decode)
        usage = reply.usage.model_extra
        assert reply.choices[0].model_extra["token_ids"] == answer_ids(tokens[0, len(ids):].tolist(),
                                                                       model.spec.end_ids), policy.label
        assert (usage["steps"], usage["policy"]) == (stats.steps[0], policy.label), (policy.label, len(ids))


@pytest.mark.parametrize("policies, more, says", [
    ("klass:tau=2", [], "--policies klass:tau=2: policy 'klass': tau=2 must lie in (0, 1]"),
    ("threshold,credit:alpah=0.5", [], "--policies credit:alpah=0.5: policy 'credit' takes no argument alpah; its "
                                      "arguments are: tau, alpha, gamma, beta, first_token, hold_end; did you mean "
                                      "'alpha'?"),
    ("pc", [], "--policies pc: policy 'pc' needs background"),
    ("less:drift=-0.1", [], "--policies less:drift=-0.1: policy 'less': drift=-0.1 must lie in [0, ln 2"),
    ("credit", ["--window", "16"], "--policies credit: credit keeps a memory per slot of a block, which a sliding "
                                   "window moves: serve it in blocks (--block N, or block=N in its spec), not in a "
                                   "window of 16"),
    ("threshold,klass:window=16", [], "--policies klass:window=16: klass keeps a memory per slot"),
])
def test_bad_knobs_of_the_rules_since_fastdllm_fail_before_the_model_loads(policies, more, says):
    from tracelock import cli
    from tracelock.serve.cli import serve_config

    args = cli.build_parser().parse_args(["serve", "--model", "testbed", "--policies", policies, *more])
    with pytest.raises(ValueError) as err:
        serve_config(args, 512)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_serve_with_a_bad_knob_is_one_error_line():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tracelock", "serve", "--model", "testbed", "--port", "0",
                           "--policies", "hierarchy:tau=none,klass:kl=-1", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "tracelock serve: error: --policies klass:kl=-1: policy 'klass': kl=-1 must be a finite number > 0 (KLASS's "
        "kl_threshold; its scripts use 0.001-0.015)")
