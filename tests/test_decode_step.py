"""The step's verbs (`tracelock.decode.step`) on constructed inputs, and the one place a step is closed: no module
of the package but `decode/step.py` asks a policy to decide or runs the commit ops (docs/design.md, "A step")."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tracelock import states
from tracelock.decode.context import RunContext
from tracelock.decode.kv_cache import needs_refresh, trigger_shift
from tracelock.decode.schedule import Schedule
from tracelock.decode.settings import DecodeSettings
from tracelock.decode.step import StepRows, close_step, commit_region, gen_lengths, scatter_slots, step_input
from tracelock.kernels.ref import commit_step_ref, skip_finished_blocks_ref
from tracelock.ops import spec_set
from tracelock.policies import Policy, make_policy
from tracelock.policies.base import CommitRule
from tracelock.signals import Signals

PACKAGE = Path(__file__).resolve().parent.parent / "tracelock"
P, G = 2, 8  # prompt length, generated positions
L = P + G


def _schedule(**kind) -> Schedule:
    schedule = Schedule(G, kind.get("block"), kind.get("window"), False, skip_finished_blocks_ref)
    schedule.bind(P, G)
    return schedule


def test_a_step_is_closed_in_one_module():
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("decide", "commit_rule")):
                callers.add(path.relative_to(PACKAGE).as_posix())
    assert callers == {"decode/step.py"}


def test_the_commit_region_of_each_schedule():
    first_active = torch.tensor([2, 5])
    block = commit_region(_schedule(block=4), torch.tensor([0, 1]), first_active, L)
    assert block.lo.tolist() == [2, 6] and block.hi.tolist() == [6, 10]
    assert block.valid.all() and block.tail is None
    window = commit_region(_schedule(window=4), torch.tensor([0, 0]), torch.tensor([2, 8]), L, lookahead=3)
    # the second row's window [8, 10) is cut by the canvas: its last two slots are padding
    assert window.valid.tolist() == [[True] * 4, [True, True, False, False]]
    assert window.gather.tolist()[1] == [8, 9, 9, 9]
    assert window.scatter_positions(L).tolist()[1] == [8, 9, L, L]
    assert window.tail.tolist() == [[6, 7, 8], [9, 9, 9]] and window.tail_inside.tolist() == [[True] * 3, [False] * 3]
    assert window.query().shape == (2, 7)


def test_the_refresh_rule():
    since, pointer, lo = torch.tensor([0, 2, 2, 5]), torch.tensor([2, 2, 2, 2]), torch.tensor([2, 2, 6, 3])
    assert needs_refresh(since, pointer, lo, 4, None).tolist() == [True, False, True, False]
    assert needs_refresh(since, pointer, lo, 4, 5).tolist() == [True, False, True, True]
    # blocks refresh as soon as the block start moves
    assert trigger_shift("block", None) == 1 and trigger_shift("window", 4) == 4
    assert needs_refresh(since, pointer, lo, trigger_shift("block", None), None).tolist() == [True, False, True, True]


def test_scatter_drops_padding_slots_and_gen_lengths_stop_at_an_end_token():
    into = torch.zeros((1, 4), dtype=torch.long)
    assert scatter_slots(torch.tensor([[7, 8, 9]]), into, torch.tensor([[1, 4, 3]])).tolist() == [[0, 7, 0, 9]]
    assert into.tolist() == [[0, 0, 0, 0]]
    assert gen_lengths(torch.tensor([[5, 6, 1, 6], [5, 5, 5, 5]]), [1, 2]) == [2, 4]


def _context(policy, schedule, *, end_id, stop_at_eot, commit_step=None) -> RunContext:
    """A run context for the verbs alone: no model but its pad and end tokens, the spec set's ops."""
    model = SimpleNamespace(spec=SimpleNamespace(pad_id=0, end_ids=[end_id]))
    settings = DecodeSettings(policy="threshold", gen_length=G, stop_at_eot=stop_at_eot)
    return RunContext(model, settings, spec_set(), schedule, policy, None, None, commit_step, None,
                      torch.tensor([end_id]), steps_per_region=G, lookahead=0, tap_layout=None)


def _step(policy, *, end_id=1, stop_at_eot=False, commit_step=None, **kind):
    """A region of 4 slots over a canvas with two rows, all generation positions active."""
    schedule = _schedule(**kind)
    ctx = _context(policy, schedule, end_id=end_id, stop_at_eot=stop_at_eot, commit_step=commit_step)
    x = torch.full((2, L), 99)
    state = torch.full((2, L), states.ACTIVE, dtype=torch.uint8)
    state[:, :P] = states.PROMPT
    counters = schedule.start(state, P, G)
    region = commit_region(schedule, counters.block_idx, torch.full((2,), P), L)
    confidence = torch.tensor([[0.9, 0.2, 0.95, 0.1], [0.3, 0.4, 0.2, 0.1]])
    signals = Signals(torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]]), confidence, confidence / 2,
                      torch.zeros_like(confidence), torch.zeros_like(confidence))
    step = StepRows(torch.arange(2), x, state, None, counters)
    return ctx, step_input(ctx, signals, region, step), region, step


@pytest.mark.parametrize("stop_at_eot", [False, True])
def test_close_step_commits_what_the_policy_chooses(stop_at_eot):
    policy = make_policy("threshold", tau=0.5)
    policy.setup(gen_length=G, num_regions=2)
    ctx, inp, region, step = _step(policy, stop_at_eot=stop_at_eot, block=4)
    x, state = step.x, step.state
    seen = []
    first_active, committed = close_step(ctx, inp, region, step, observe=seen.append)
    # row 0: the two slots above tau; row 1: none passes, so its most confident slot
    assert seen[0].tolist() == [[True, False, True, False], [False, True, False, False]]
    assert committed.tolist() == [2, 1] and first_active.tolist() == [3, 2]
    assert x[0, P:P + 4].tolist() == [11, 99, 13, 99] and x[1, P:P + 4].tolist() == [99, 22, 99, 99]
    assert (state[:, P:P + 4] == states.LOCKED).sum().item() == 3


@pytest.mark.parametrize("stop_at_eot", [False, True])
def test_close_step_takes_the_commit_step_op_for_a_policy_with_its_rule(stop_at_eot):
    class MarginRule(Policy):
        """TraceLock's rule (commit where sigmoid(score - tau) > theta) on scores made from the confidences."""

        name = "margin-rule"

        def commit_rule(self, inp):
            return CommitRule(inp.signals.confidence * 10 - 5, torch.zeros(2), 0.5, 0)

        def decide(self, inp, generator=None):
            raise AssertionError("the commit_step op closes this step")

    ctx, inp, region, step = _step(MarginRule(), stop_at_eot=stop_at_eot, commit_step=commit_step_ref, window=4)
    first_active, committed = close_step(ctx, inp, region, step)
    assert committed.tolist() == [2, 1] and first_active.tolist() == [3, 2]
    # with stop_at_eot too (an end token committed: the tail after it is filled, not counted as commits)
    ctx, inp, region, step = _step(MarginRule(), end_id=11, stop_at_eot=stop_at_eot, commit_step=commit_step_ref,
                                   window=4)
    x = step.x
    first_active, committed = close_step(ctx, inp, region, step)
    assert committed.tolist() == [2, 1]
    assert first_active.tolist() == ([L, 2] if stop_at_eot else [3, 2])
    want = [99, 99, 11, 0, 13, 0, 0, 0, 0, 0] if stop_at_eot else [99, 99, 11, 99, 13, 99, 99, 99, 99, 99]
    assert x[0].tolist() == want
