"""The static-shape engine on a CUDA device (tiny checkpoints, fp32): uncompiled, its steps captured as CUDA graphs
(``compile="cudagraphs"``) and torch.compile with CUDA graphs (``compile=True``), each row equal to `fused_generate`
on its prompt alone; one host sync per step. Skipped without a GPU (bench/studies/gpu_compile_session.sh runs it)."""

import pytest
import torch

import tracelock
from tracelock.policies.tracelock import TraceLockPolicy
from tracelock.testing import (
    assert_same_decode,
    counting_cuda_syncs,
    decode_on_engine,
    eos_prone_model,
    fresh_controller,
    random_prompts,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
G = 16


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    return eos_prone_model(tmp_path_factory.mktemp(request.param), request.param, G).to("cuda")


def _cases(model):
    controller, encoder = fresh_controller(model)
    return [dict(policy="threshold", policy_args={"tau": 0.7}, block=4, cache="dual"),
            dict(policy="confidence", window=8),
            dict(policy=TraceLockPolicy(controller, encoder, theta=0.55), window=6, cache="prefix", refresh_shift=3)]


@pytest.mark.parametrize("compile", [False, "cudagraphs", True], ids=["uncompiled", "cudagraphs", "inductor"])
def test_engine_rows_equal_fused_generate_on_cuda(model, compile):
    prompts = random_prompts(model)
    for kw in _cases(model):
        kw = dict(kw, gen_length=G)
        for rnd in range(2):  # the second decode replays what the first captured
            rows, engine = decode_on_engine(model, prompts, compile=compile, **kw)
            for r, prompt in enumerate(prompts):
                assert_same_decode(rows[r], tracelock.fused_generate(model, [prompt], **kw), f"{kw} round {rnd}")


def test_one_sync_per_step_on_cuda(model):
    prompts = random_prompts(model)
    kw = dict(policy="threshold", policy_args={"tau": 0.7}, gen_length=G, block=4, cache="dual")
    rows, engine = decode_on_engine(model, prompts, compile="cudagraphs", **kw)  # captures
    engine.reset()
    for p in prompts:
        engine.admit(p)
    steps = 0
    with counting_cuda_syncs() as syncs:
        while engine.step():
            steps += 1
    # at most one read per step, the last (which finds no live row and runs nothing) included
    assert steps > G // 4 and len(syncs) <= steps + 1, (len(syncs), steps)
