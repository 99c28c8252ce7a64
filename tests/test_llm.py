"""`tracelock.LLM` and `SamplingParams` (vLLM's offline shape): text in, text out, on both bundled models; the same
tokens as the `fused_generate` call they stand for, batched or not."""

import re
from pathlib import Path

import pytest

import tracelock

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTION = "Zoe has 9 books. She finds 4 more books. How many books does Zoe have now?"
CHAT = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def llm():
    return tracelock.LLM(model="testbed", max_num_seqs=2)


def test_chat_is_fused_generate_on_the_chat_template(llm):
    params = tracelock.SamplingParams(max_tokens=64, block=16)
    (request,) = llm.chat(CHAT, params)
    tok = llm.get_tokenizer()
    ids = tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    tokens, stats = tracelock.fused_generate(llm.model, [ids], policy="threshold", policy_args={"tau": 0.9},
                                             gen_length=64, block=16)
    out = request.outputs[0]
    generated = tokens[0, len(ids):].tolist()
    end = next(i for i, t in enumerate(generated) if t in llm.model.spec.end_ids)
    assert request.prompt_token_ids == ids and out.token_ids == generated[:end] and out.steps == stats.steps[0]
    assert out.text == tok.decode(generated[:end], skip_special_tokens=True) and out.text.endswith("#### 13")
    assert (out.finish_reason, out.stop_reason, out.index) == ("stop", generated[end], 0)


def test_batches_equal_single_prompts_and_keep_the_order(llm):
    prompts = ["Zoe has 9 books.", "Max has 3 cats and", {"prompt_token_ids": [5, 6, 7]}, "def f(x):"]
    params = tracelock.SamplingParams(max_tokens=20, block=8)  # 20 decodes as 24 and is cut back
    batched = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    assert [r.outputs[0].token_ids for r in batched] == [r.outputs[0].token_ids for r in alone]
    assert [r.prompt for r in batched] == ["Zoe has 9 books.", "Max has 3 cats and", None, "def f(x):"]
    assert all(len(r.outputs[0].token_ids) <= 20 for r in batched)


def test_length_stop_strings_and_n_samples(llm):
    (short,) = llm.chat(CHAT, tracelock.SamplingParams(max_tokens=5, block=8))
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 5
    (stopped,) = llm.chat(CHAT, tracelock.SamplingParams(max_tokens=64, block=16, stop=["####", "\n"]))
    assert stopped.outputs[0].text == "Zoe starts with 9 books." and stopped.outputs[0].stop_reason == "\n"
    params = tracelock.SamplingParams(n=3, temperature=1.5, top_p=0.9, max_tokens=32, block=16, seed=1)
    (sampled,) = llm.chat(CHAT, params)
    assert [o.index for o in sampled.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1  # completion i samples with seed + i
    assert [o.token_ids for o in llm.chat(CHAT, params)[0].outputs] == [o.token_ids for o in sampled.outputs]


def test_the_dream_family_and_one_params_per_prompt():
    llm = tracelock.LLM(model="testbed-dream")
    greedy = tracelock.SamplingParams(max_tokens=32, policy="entropy", policy_args={"steps": 32}, block=None,
                                      window=32)
    out = llm.chat([CHAT, CHAT], [greedy, tracelock.SamplingParams(max_tokens=32)])
    assert len(out) == 2 and all(r.outputs[0].text for r in out)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_new_tokens=64), "max_new_tokens= is max_tokens= here"),
    (dict(steps=64), r"policy_args=\{'steps': S\}"),
    (dict(block_length=16), "block= here"),
    (dict(remasking="low_confidence"), "policy='confidence'"),
    (dict(temperature=-1), "temperature=-1 must be"),
    (dict(top_p=0), "top_p=0 must lie in"),
    (dict(logprobs=5), "logprobs=5 is not supported"),
    (dict(policy="treshold"), "did you mean 'threshold'"),
    (dict(block=16, window=16), "not both"),
])
def test_bad_sampling_params_say_the_fix(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        tracelock.SamplingParams(**kwargs)


def test_decode_keywords_from_other_projects_are_named(llm):
    with pytest.raises(TypeError, match=r"steps= is a policy argument here"):
        tracelock.fused_generate(llm.model, [[1]], policy="confidence", gen_length=16, steps=64)
    with pytest.raises(TypeError, match="block_length= is block= here"):
        tracelock.generate_many(llm.model, [[1]], batch_size=1, policy="confidence", gen_length=16, block_length=16)
    with pytest.raises(TypeError, match="remasking= is the policy here"):
        tracelock.reference_generate(llm.model, [[1]], policy="confidence", gen_length=16, remasking="random")


def test_llm_checks_its_own_arguments():
    with pytest.raises(ValueError, match="dtype='bf16'"):
        tracelock.LLM(model="testbed", dtype="bf16")
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        tracelock.LLM(model="testbed", max_num_seqs=0)


def test_the_coming_from_page_runs_its_vllm_example(capsys):
    page = (Path(__file__).resolve().parent.parent / "docs" / "coming-from.md").read_text()
    block = re.findall(r"```python\n(.*?)```", page[page.index("## vLLM"):], re.S)[0]
    exec(block, {"chat": CHAT})
    (printed,) = capsys.readouterr().out.splitlines()
    assert printed.count("'length'") + printed.count("'stop'") == 2
