"""A decoding step on the bundled testbed model: `fused_generate` (the op dispatcher: window_logits_stats from the
LM head's input, C++ commits when built) vs `reference_generate` (full logits, torch specs), per backbone forward."""

import platform

import pytest
import torch

import tracelock
from tracelock.testbed.tasks import held_out
from tracelock.text import encode_prompt

GEN, BLOCK, BATCH = 64, 16, 8
RUNNERS = {"reference": tracelock.reference_generate, "fused": tracelock.fused_generate}


@pytest.fixture(scope="module")
def prompts():
    model, tok = tracelock.load_model("testbed"), tracelock.load_tokenizer("testbed")
    return model, [encode_prompt(tok, ex.prompt) for ex in held_out("math", "test", BATCH)], {}


@pytest.mark.parametrize("policy,args", [("confidence", {}), ("threshold", {"tau": 0.9})], ids=["confidence", "tau0.9"])
@pytest.mark.parametrize("runner", list(RUNNERS))
def test_decode_step(benchmark, prompts, runner, policy, args):
    model, ids, references = prompts
    kwargs = dict(policy=policy, policy_args=args, gen_length=GEN, block=BLOCK)
    # check before timing: the run being timed gives the reference's tokens and steps
    if policy not in references:
        references[policy] = tracelock.reference_generate(model, ids, **kwargs)
    ref, ref_stats = references[policy]
    got, stats = RUNNERS[runner](model, ids, **kwargs) if runner != "reference" else references[policy]
    assert torch.equal(ref, got) and stats.steps == ref_stats.steps

    # per forward: the group's rows divide by the same step count, so their ratio is the per-step ratio
    benchmark.group = f"decode-testbed-{policy}-B{BATCH}-gen{GEN}-block{BLOCK}-forwards{stats.forwards}"
    benchmark.extra_info.update(runner=runner, forwards=stats.forwards, machine=platform.processor() or
                                platform.machine(), torch=torch.__version__, threads=torch.get_num_threads())
    benchmark.pedantic(lambda: RUNNERS[runner](model, ids, **kwargs), rounds=5, warmup_rounds=1)
