"""bench/studies/confident_errors.py on constructed controller steps: each commit's window place, step-mates, margin and
whether the fallback chose it; the first divergence of two answers, ignoring what follows both ends."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tracelock.eval.diagnostics import ControllerSteps

_spec = importlib.util.spec_from_file_location("confident_errors", Path(__file__).with_name("confident_errors.py"))
errors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(errors)


def test_commit_table_reads_every_commit():
    # one item, two steps: step 0 sees slots 2, 3, 4 and commits 3 and 4 (margins 3 and -1 against tau 0.5);
    # step 1 sees slot 2 alone and commits it
    steps = ControllerSteps(
        item_ids=["a"], row=np.array([0, 0], np.int32), step=np.array([0, 1], np.int32),
        tau=np.array([0.5, 1.0], np.float32), num_slots=np.array([3, 1], np.int32),
        position=np.array([2, 3, 4, 2], np.int32), confidence=np.array([0.4, 0.9, 0.8, 0.5], np.float32),
        score=np.array([0.0, 3.5, -0.5, 0.0], np.float32), chosen=np.array([False, True, True, True]),
        gen_length=8)
    table = errors.commit_table(steps, theta=0.9)  # logit(0.9) = 2.197
    assert set(table["a"]) == {2, 3, 4}
    assert table["a"][3] == pytest.approx(dict(step=0, window_place=1, committed_with=2, confidence=0.9, score=3.5,
                                               tau=0.5, own=True))
    assert table["a"][4]["window_place"] == 2 and not table["a"][4]["own"]
    assert table["a"][2]["step"] == 1 and table["a"][2]["window_place"] == 0 and table["a"][2]["committed_with"] == 1


def test_first_divergence_ignores_the_padding_after_both_ends():
    end = 1
    assert errors.first_divergence(np.array([5, 6, 7, end]), np.array([5, 6, 8, end]), (end,)) == 2
    assert errors.first_divergence(np.array([5, end, 9, 9]), np.array([5, end, 3, 3]), (end,)) is None
    assert errors.first_divergence(np.array([5, end, end]), np.array([5, 6, end]), (end,)) == 1
    assert errors.first_divergence(np.array([5, 6]), np.array([5, 6]), (end,)) is None
