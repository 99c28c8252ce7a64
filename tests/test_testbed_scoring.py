"""The testbed scorer runs each distinct program once: later items with the same program, in the same batch or a
later one, take its remembered verdict; a run that did not complete (timed out or killed) is run again."""

import tracelock.testbed.evaluate as evaluate
from tracelock.tasks import held_out


def test_a_program_runs_in_the_sandbox_once(monkeypatch):
    ran = []

    def counting(jobs, **kw):  # the real sandbox, counted
        ran.append(len(jobs))
        return check_many(jobs, **kw)

    check_many = evaluate.check_many
    monkeypatch.setattr(evaluate, "_VERDICTS", {})
    monkeypatch.setattr(evaluate, "check_many", counting)
    items = held_out("code", "test", 3)
    answers = [ex.answer for ex in items]
    wrong = "    return None\n"
    # each item's reference and a wrong body, and the first reference again: six programs
    scored = evaluate.score_items(items * 2 + items[:1], answers + [wrong] * 3 + answers[:1])
    assert scored == [True] * 3 + [False] * 3 + [True]
    assert ran == [6]
    assert evaluate.score_items(items, [wrong, answers[1], wrong]) == [False, True, False]
    assert ran == [6, 0]
    # math needs no sandbox
    math = held_out("math", "test", 2)
    assert evaluate.score_items(math, [ex.answer for ex in math]) == [True, True] and ran == [6, 0, 0]


def test_a_run_that_did_not_complete_is_not_remembered(monkeypatch):
    monkeypatch.setattr(evaluate, "_VERDICTS", {})
    item = held_out("code", "test", 1)
    loop = "    while True:\n        pass\n"  # a timeout, or a kill at the CPU limit on a loaded machine
    assert evaluate.score_items(item, [loop]) == [False]
    assert evaluate._VERDICTS == {}
