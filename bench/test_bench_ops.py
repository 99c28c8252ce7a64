"""The loop's per-step bookkeeping (apply_commits, skip_finished_blocks): torch reference vs the C++ CPU op, at
decode-loop sizes; for the block advance also its spec (a host-synced loop) beside the loop-free torch
implementation."""

import platform

import pytest
import torch

from tracelock import ops
from tracelock._ext import has_cpp
from tracelock.kernels.ref import apply_commits_ref, skip_finished_blocks_ref
from tracelock.states import ACTIVE, LOCKED, PROMPT

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


BLOCK_SIZES = [(1, 64, 16, 4), (64, 64, 16, 8)]


@pytest.mark.parametrize("impl", ["spec"] + IMPLS)
@pytest.mark.parametrize("B,P,block,regions", BLOCK_SIZES,
                         ids=[f"B{b}-L{p + k * r}-block{k}" for b, p, k, r in BLOCK_SIZES])
def test_skip_finished_blocks(benchmark, impl, B, P, block, regions):
    # every row has just finished block 0: one skip per call, what the loop does at a block's end
    state = torch.full((B, P + block * regions), ACTIVE, dtype=torch.uint8)
    state[:, :P], state[:, P:P + block] = PROMPT, LOCKED
    rows, zeros = torch.ones(B, dtype=torch.bool), torch.zeros(B, dtype=torch.long)
    args = (P, block, regions, block, False)

    def step():
        counters = [zeros.clone() for _ in range(4)]
        if impl == "spec":
            skip_finished_blocks_ref(state, *counters, rows, *args)
        else:
            ops.skip_finished_blocks(state, *counters, rows, *args, impl=impl)
        return counters

    ref = [zeros.clone() for _ in range(4)]
    skip_finished_blocks_ref(state, *ref, rows, *args)
    assert all(torch.equal(a, b) for a, b in zip(ref, step())) and ref[0].eq(1).all()

    benchmark.group = f"skip_finished_blocks-B{B}-L{P + block * regions}-block{block}"
    benchmark.extra_info.update(impl=impl, machine=platform.processor() or platform.machine(),
                                torch=torch.__version__, threads=torch.get_num_threads())
    benchmark.pedantic(step, rounds=200, warmup_rounds=5)
