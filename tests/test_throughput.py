"""Throughput mode: length-sorted batches give each prompt the tokens it gets alone, with less padding."""

import pytest
import torch

import tracelock
from tracelock.models import write_tiny_checkpoint
from tracelock.testing import random_prompts
from tracelock.throughput import generate_many, length_batches

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("llada"), family="llada", seed=4))
    m.lm_head.weight.mul_(20.0)  # confident: several commits per step, rows finish at different steps
    return m


def test_length_batches_group_similar_lengths():
    prompts = [[1] * n for n in (3, 9, 4, 8, 2, 9)]
    assert length_batches(prompts, 2) == [[1, 5], [3, 2], [0, 4]]
    assert sorted(i for b in length_batches(prompts, 4) for i in b) == list(range(6))
    with pytest.raises(ValueError, match="batch_size=0 must be a positive int"):
        length_batches(prompts, 0)


def test_generate_many_equals_one_by_one_with_the_cache(model):
    prompts = random_prompts(model, lengths=(9, 3, 12, 4, 11, 5))
    args = dict(policy="threshold", policy_args={"tau": 0.7}, gen_length=16, window=4, cache="dual")
    outputs, stats = generate_many(model, prompts, batch_size=2, **args)
    for prompt, (tokens, steps) in zip(prompts, outputs):
        alone, alone_stats = tracelock.fused_generate(model, [prompt], **args)
        assert tokens == alone[0, -16:].tolist() and steps == alone_stats.steps[0]
    assert stats.prompts == 6 and stats.batches == 3 and stats.tokens_per_second > 0
    assert stats.steps == sum(s for _, s in outputs)
    # input order (9, 3), (12, 4), (11, 5) would pad 6 + 8 + 6 of 64 positions; sorted (12, 11), (9, 5), (4, 3):
    # 1 + 4 + 1 of 50
    assert stats.padding == pytest.approx(6 / 50)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate_many(model, [], batch_size=2, **args)


def test_reference_generate_plugs_in(model):
    prompts = random_prompts(model, lengths=(5, 7))
    fused, _ = generate_many(model, prompts, batch_size=2, policy="confidence", gen_length=8, block=4, cache="prefix")
    ref, _ = generate_many(model, prompts, batch_size=2, policy="confidence", gen_length=8, block=4, cache="prefix",
                           generate=tracelock.reference_generate)
    assert fused == ref
    assert all(not torch.tensor(t).eq(model.spec.mask_id).any() for t, _ in fused)
