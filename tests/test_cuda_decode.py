"""The decoding loop on a CUDA device: the fused loop (Triton scoring and commit kernels, the CUDA commits when
tracelock._C has them) against the reference loop on the tiny checkpoints in fp32. Skipped without a GPU."""

import pytest
import torch

import tracelock
from tracelock import _ext
from tracelock.models import write_tiny_checkpoint
from tracelock.testing import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

G = 32
CASES = [("confidence", {}), ("topk", {"k": 2}), ("threshold", {"tau": 0.5}), ("entropy", {})]


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request, tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=3)
    return tracelock.load_model(path, device="cuda")


# impl="cuda" needs tracelock._C built with CUDA (TRACELOCK_BUILD_CUDA=1); without it that row has nothing to run
CUDA_IMPL = pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not _ext.has_cuda_ext(),
                                                                   reason="tracelock._C was built without CUDA"))


@pytest.mark.parametrize("impl", [pytest.param(None, id="default"), "torch", "triton", CUDA_IMPL])
@pytest.mark.parametrize("name,args", CASES, ids=[n for n, _ in CASES])
@pytest.mark.parametrize("schedule", [dict(block=8), dict(window=6)], ids=["block", "window"])
def test_fused_equals_reference_on_cuda(model, name, args, impl, schedule):
    prompts = random_prompts(model)
    ref, ref_stats = tracelock.reference_generate(model, prompts, policy=name, policy_args=args, gen_length=G,
                                                  stop_at_eot=True, **schedule)
    got, got_stats = tracelock.fused_generate(model, prompts, policy=name, policy_args=args, gen_length=G,
                                              stop_at_eot=True, impl=impl, **schedule)
    assert got.device.type == "cuda"
    agreement = (ref == got).float().mean().item()
    assert torch.equal(ref, got), f"fused != reference on cuda ({agreement:.1%} equal tokens)"
    assert ref_stats.steps == got_stats.steps
    assert ref_stats.commits_per_step == got_stats.commits_per_step


def test_default_impls_on_cuda():
    from tracelock.ops import pick

    cuda = torch.device("cuda")
    expected = "cuda" if _ext.has_cuda_ext() else "torch"
    assert pick("apply_commits", None, cuda) == expected
    assert pick("window_logits_stats", None, cuda) == "triton"
