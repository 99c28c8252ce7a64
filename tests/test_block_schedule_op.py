"""skip_finished_blocks: the block schedule's advance, its spec on hand-made rows, and the C++ op against it."""

import pytest
import torch

from tracelock import _ext, ops
from tracelock.kernels.ref import skip_finished_blocks_ref
from tracelock.states import ACTIVE, EOT, LOCKED, PROMPT


def counters(B, block_idx=0, steps=0):
    return dict(block_idx=torch.full((B,), block_idx), region_step=torch.full((B,), 5),
                region_initial=torch.full((B,), 7), steps=torch.full((B,), steps))


def run(fn, state, c, rows, P, block, num_regions, S, idle):
    out = {k: v.clone() for k, v in c.items()}
    fn(state, out["block_idx"], out["region_step"], out["region_initial"], out["steps"], rows, P, block, num_regions,
       S, idle)
    return out


def test_spec_skips_every_finished_block_but_never_the_last():
    P, block = 2, 4
    state = torch.full((2, P + 3 * block), ACTIVE, dtype=torch.uint8)
    state[:, :P] = PROMPT
    state[0, P:P + 2 * block] = LOCKED  # blocks 0 and 1 done: row 0 lands in block 2 with 4 active
    state[1, P:] = EOT  # everything done: row 1 stops at the last block
    state[0, P + 2 * block] = LOCKED
    out = run(skip_finished_blocks_ref, state, counters(2), torch.ones(2, dtype=torch.bool), P, block, 3, 4, False)
    assert out["block_idx"].tolist() == [2, 2]
    assert out["region_step"].tolist() == [0, 0]
    assert out["region_initial"].tolist() == [3, 0]


def test_spec_leaves_unselected_and_unfinished_rows():
    P, block = 0, 4
    state = torch.full((3, 8), ACTIVE, dtype=torch.uint8)
    state[0, :4] = LOCKED  # finished, but not selected
    state[1, :3] = LOCKED  # one active left
    out = run(skip_finished_blocks_ref, state, counters(3), torch.tensor([False, True, True]), P, block, 2, 4, False)
    assert out["block_idx"].tolist() == [0, 0, 0]
    assert out["region_step"].tolist() == [5, 5, 5]


def test_spec_idle_steps_waits_for_the_step_budget():
    state = torch.full((1, 8), ACTIVE, dtype=torch.uint8)
    state[0, :4] = LOCKED
    rows = torch.ones(1, dtype=torch.bool)
    assert run(skip_finished_blocks_ref, state, counters(1, steps=3), rows, 0, 4, 2, 4, True)["block_idx"].item() == 0
    assert run(skip_finished_blocks_ref, state, counters(1, steps=4), rows, 0, 4, 2, 4, True)["block_idx"].item() == 1


def random_case(B, P, block, num_regions, seed):
    """Rows with whole blocks finished (locked or EOT-filled) ahead of partly active ones."""
    g = torch.Generator().manual_seed(seed)
    L = P + block * num_regions
    state = torch.full((B, L), ACTIVE, dtype=torch.uint8)
    state[:, :P] = PROMPT
    done_blocks = torch.randint(0, num_regions + 1, (B,), generator=g)
    for b in range(B):
        state[b, P:P + done_blocks[b] * block] = torch.where(torch.rand(done_blocks[b] * block, generator=g) < 0.5,
                                                             LOCKED, EOT).to(torch.uint8)
    state = torch.where((state == ACTIVE) & (torch.rand(B, L, generator=g) < 0.3), LOCKED, state).to(torch.uint8)
    c = dict(block_idx=torch.randint(0, 2, (B,), generator=g).clamp(max=num_regions - 1),
             region_step=torch.randint(0, 9, (B,), generator=g), region_initial=torch.randint(0, 9, (B,), generator=g),
             steps=torch.randint(0, block * num_regions, (B,), generator=g))
    return state, c, torch.rand(B, generator=g) < 0.8


@pytest.mark.parametrize("impl", ["torch", "cpp"], ids=["torch-loop-free", "cpp"])
@pytest.mark.parametrize("idle", [False, True], ids=["adaptive", "idle"])
@pytest.mark.parametrize("B, P, block, num_regions", [(1, 9, 16, 4), (3, 5, 7, 9), (8, 0, 32, 4), (2, 3, 1, 5)])
def test_impl_matches_spec(B, P, block, num_regions, idle, impl):
    """The C++ op and the torch implementation (the spec without its loop and host sync, which the engine's graphs
    hold) against the spec, directly and through the dispatcher."""
    from tracelock.kernels.skip_finished_blocks import skip_finished_blocks_torch

    if impl == "cpp" and not _ext.has_cpp():
        pytest.skip(f"tracelock._C is not built: {_ext.ext_error()}")
    direct = torch.ops.tracelock.skip_finished_blocks if impl == "cpp" else skip_finished_blocks_torch
    for seed in range(20):
        state, c, rows = random_case(B, P, block, num_regions, seed)
        args = (P, block, num_regions, 3, idle)
        ref = run(skip_finished_blocks_ref, state, c, rows, *args)
        got = run(direct, state, c, rows, *args)
        via_ops = run(lambda *a: ops.skip_finished_blocks(*a, impl=impl), state, c, rows, *args)
        for k in ref:
            assert torch.equal(got[k], ref[k]), (seed, k)
            assert torch.equal(via_ops[k], ref[k]), (seed, k)


@pytest.mark.parametrize("name, bad, match", [
    ("block_idx", torch.zeros(2, dtype=torch.int32), "block_idx must be torch.int64"),
    ("rows", torch.ones(3, dtype=torch.bool), r"rows must have shape \[2\]"),
    ("state", torch.zeros(2, 8, dtype=torch.int64), "state must be torch.uint8"),
])
def test_dispatcher_names_the_bad_argument(name, bad, match):
    args = dict(state=torch.zeros(2, 8, dtype=torch.uint8), **counters(2), rows=torch.ones(2, dtype=torch.bool))
    args[name] = bad
    with pytest.raises((TypeError, ValueError), match=match):
        ops.skip_finished_blocks(**args, prompt_len=0, block=4, num_regions=2, steps_per_block=4, idle_steps=False,
                                 impl="torch")
