"""The server's decode path (`tracelock.serve.scheduler.Scheduler`, the engines it builds per served policy) with the
rules added last: Fast-dLLM++'s `frechet` and the end-of-text hold of each heuristic. Every request's answer and steps
are `fused_generate`'s on its prompt alone, while several requests share the batch."""

import queue

import pytest

import tracelock
from tracelock.eval.tasks import make_task
from tracelock.text import answer_ids, encode_prompt

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK, GEN = 16, 64
SERVED = "frechet:delta=0.0,frechet:delta=0.1:hold_end=true,factor:f=1.0:hold_end=true," \
         "confidence:per_step=2:hold_end=true,threshold:tau=0.9:hold_end=true"


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
