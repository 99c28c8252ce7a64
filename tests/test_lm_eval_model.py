"""The lm-eval model ``tracelock``: lm-eval's own command line, offline, on a local task file of testbed math items
gives the same answers and accuracy as `tracelock eval`; generate_until honours stop strings and equals
`fused_generate`; the Monte-Carlo log-likelihood is exact where it must be, and deterministic."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install tracelock[lm-eval])")

import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

import tracelock  # noqa: E402
from tracelock.eval.lm_eval_model import TraceLockLM  # noqa: E402
from tracelock.eval.runner import parse_policies, parse_settings, read_items, run_eval  # noqa: E402
from tracelock.eval.tasks import make_task  # noqa: E402
from tracelock.text import cut_at_stop, decode_answer, encode_prompt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
N = 8
TASK_YAML = """\
task: testbed_math_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
process_results: !function scoring.process_results
generation_kwargs:
  until: []
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
# the testbed's own scoring (tracelock.tasks.gsm8k.is_correct), so the two runs grade alike
SCORING = """\
from tracelock.tasks.gsm8k import is_correct


def process_results(doc, results):
    return {"exact_match": float(is_correct(results[0], doc["target"]))}
"""


@pytest.fixture(scope="module")
def lm():
    return TraceLockLM(pretrained="testbed", policy="threshold", tau=0.9, gen_length=64, block=16, batch_size=4)


def _request(context, **gen_kwargs):
    return Instance(request_type="generate_until", doc={}, arguments=(context, gen_kwargs), idx=0)


def test_lm_eval_cli_matches_tracelock_eval(tmp_path):
    items = make_task("testbed:math").items(N)
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(dict(id=it.id, prompt=it.prompt, target=it.reference.target)) + "\n"
                            for it in items))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "testbed_math_local.yaml").write_text(TASK_YAML.format(data=data))
    (tasks / "scoring.py").write_text(SCORING)
    out = tmp_path / "lm-eval"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tracelock", "lm-eval", "run", "--model", "tracelock", "--model_args",
         "pretrained=testbed,policy=threshold,tau=0.9,gen_length=64,block=16", "--tasks", "testbed_math_local",
         "--include_path", str(tasks), "--apply_chat_template", "--batch_size", "4", "--log_samples",
         "--output_path", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["testbed_math_local"]
    samples = [json.loads(line) for line in next(out.rglob("samples_testbed_math_local_*.jsonl")).open()]
    assert len(samples) == N

    rows = run_eval("testbed", "testbed:math", parse_policies("threshold:tau=0.9"), parse_settings("64/16"),
                    tmp_path / "eval", n=N, batch_size=4, workers=1)
    assert results["exact_match,none"] == rows[0]["metric"]
    # and item by item: the same completion for the same prompt
    completions = {r["id"]: r["completion"] for r in read_items(tmp_path / "eval" / "runs" / "64-16" /
                                                                 "threshold-tau-0.9" / "items-rank0.jsonl").values()}
    assert {s["doc"]["id"]: s["resps"][0][0] for s in samples} == completions


def test_generate_until_equals_fused_generate_and_honours_stop(lm):
    model, tok = lm.model, lm.tokenizer
    prompts = [it.prompt for it in make_task("testbed:math").items(3)]
    contexts = [lm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    until = ["\n"]
    got = lm.generate_until([_request(c, until=until) for c in contexts])
    for prompt, text in zip(prompts, got):
        tokens, _ = tracelock.fused_generate(model, [encode_prompt(tok, prompt)], policy="threshold",
                                             policy_args={"tau": 0.9}, gen_length=64, block=16)
        full = decode_answer(tok, tokens[0, -64:].tolist(), model.spec.end_ids)
        assert "\n" in full  # the stop string cuts something
        assert text == cut_at_stop(full, until)[0] == full.split("\n")[0]
    # a request's answer does not depend on the other requests of the call
    assert lm.generate_until([_request(contexts[1], until=until)]) == [got[1]]


@pytest.mark.parametrize("policy, args", [
    ("credit", dict(tau=0.9, alpha=0.7, gamma=0.2, beta=0.8)),
    ("klass", dict(tau=0.9, kl=0.01, history=2, per_step=1)),
], ids=["credit", "klass"])
def test_a_rule_since_fastdllm_is_named_in_model_args_and_equals_fused_generate(policy, args):
    """``--model_args pretrained=testbed,policy=credit,tau=0.9,...``: the rules published since Fast-dLLM by name, with
    their knobs as lm-eval passes them (numbers; ``per_step`` resolved against gen_length)."""
    lm = TraceLockLM(pretrained="testbed", policy=policy, gen_length=32, block=16, batch_size=2, **args)
    model, tok = lm.model, lm.tokenizer
    prompts = [it.prompt for it in make_task("testbed:math").items(2)]
    contexts = [lm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    got = lm.generate_until([_request(c, until=[]) for c in contexts])
    own = {k: v for k, v in args.items() if k != "per_step"} | ({"steps": 32} if "per_step" in args else {})
    for prompt, text in zip(prompts, got):
        tokens, _ = tracelock.fused_generate(model, [encode_prompt(tok, prompt)], policy=policy, policy_args=own,
                                             gen_length=32, block=16)
        assert text == decode_answer(tok, tokens[0, -32:].tolist(), model.spec.end_ids)
    # a memory rule decodes greedily: a task that samples is refused with the fix
    with pytest.raises(ValueError, match=rf"policy '{policy}' decodes greedily, but this task samples \(do_sample "
                                         r"with temperature=0.5\); run it greedy with --gen_kwargs do_sample=false"):
        lm.generate_until([_request(contexts[0], until=[], do_sample=True, temperature=0.5)])


def test_loglikelihood_of_one_token_is_exact(lm):
    model = lm.model
    context = lm.apply_chat_template([{"role": "user", "content": "Mia has 3 apples. How many apples?"}])
    prefix, target = lm._pair(context, "3")
    assert len(target) == 1
    (ll, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (context, "3"), 0)])
    # one target token is always the one masked token: the estimate is its log-probability
    x = torch.tensor([prefix + [model.spec.mask_id]])
    logits = model.predict(x, torch.tensor([[len(prefix)]])).logits[0, 0]
    assert ll == pytest.approx(float(torch.log_softmax(logits.float(), -1)[target[0]]), abs=1e-5)
    assert greedy is False  # check_greedy is off by default, as in LLaDA's script


def test_loglikelihood_is_deterministic_and_request_independent(lm):
    context = lm.apply_chat_template([{"role": "user", "content": "Leo has 4 books. He buys 2 more books. "
                                                                  "How many books does Leo have now?"}])
    right = Instance("loglikelihood", {}, (context, "Leo has 4 + 2 = 6 books.\n#### 6"), 0)
    wrong = Instance("loglikelihood", {}, (context, "Leo has 4 - 2 = 9 books.\n#### 9"), 1)
    both = lm.loglikelihood([right, wrong])
    assert lm.loglikelihood([right]) == both[:1]
    assert both[0][0] > both[1][0]  # the right worked answer is far likelier than a wrong one


def test_rolling_loglikelihood_says_why_not(lm):
    with pytest.raises(NotImplementedError, match="no left-to-right likelihood"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("text",), 0)])


def test_bad_model_args_are_named():
    with pytest.raises(ValueError, match="block=24 does not divide gen_length=64"):
        TraceLockLM(pretrained="testbed", gen_length=64, block=24)
    with pytest.raises(TypeError, match="policy 'threshold' takes no argument tua"):
        TraceLockLM(pretrained="testbed", policy="threshold", tua=0.9, gen_length=64, block=16)
    with pytest.raises(ValueError, match=r"kl=-1 must be a finite number > 0"):
        TraceLockLM(pretrained="testbed", policy="klass", kl=-1, gen_length=64, block=16)
    with pytest.raises(ValueError, match=r"policy 'credit' keeps a memory per slot of a block, which a sliding window "
                                         r"moves: use block=N .* not window=16"):
        TraceLockLM(pretrained="testbed", policy="credit", gen_length=64, window=16)
