"""apply_commits (the loop's per-step bookkeeping): torch reference vs the C++ CPU op, at decode-loop sizes."""

import platform

import pytest
import torch

from tracelock import ops
from tracelock._ext import has_cpp
from tracelock.kernels.ref import apply_commits_ref
from tracelock.states import ACTIVE, PROMPT

SIZES = [(1, 160), (8, 320)]
IMPLS = ["torch"] + (["cpp"] if has_cpp() else [])


def make_case(B, L):
    g = torch.Generator().manual_seed(0)
    state = torch.full((B, L), ACTIVE, dtype=torch.uint8)
    state[:, : L // 4] = PROMPT
    x = torch.randint(0, 100, (B, L), generator=g)
    proposal = torch.randint(0, 100, (B, L), generator=g)
    commit = torch.rand(B, L, generator=g) < 0.1
    return x, state, proposal, commit, torch.tensor([7, 9])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,L", SIZES, ids=[f"B{b}-L{n}" for b, n in SIZES])
def test_apply_commits(benchmark, impl, B, L):
    x, state, proposal, commit, end_ids = make_case(B, L)
    # check before timing: the candidate equals the spec on this input
    ref_x, ref_state, got_x, got_state = x.clone(), state.clone(), x.clone(), state.clone()
    ref = apply_commits_ref(ref_x, ref_state, proposal, commit, end_ids, 0, True)
    got = ops.apply_commits(got_x, got_state, proposal, commit, end_ids, 0, True, impl=impl)
    assert torch.equal(ref, got) and torch.equal(ref_x, got_x) and torch.equal(ref_state, got_state)

    benchmark.group = f"apply_commits-B{B}-L{L}"
    benchmark.extra_info.update(impl=impl, machine=platform.processor() or platform.machine(),
                                torch=torch.__version__, threads=torch.get_num_threads())

    def step():
        # the op mutates its inputs: each call gets fresh copies (timed for both impls alike)
        return ops.apply_commits(x.clone(), state.clone(), proposal, commit, end_ids, 0, True, impl=impl)

    benchmark.pedantic(step, rounds=200, warmup_rounds=5)
