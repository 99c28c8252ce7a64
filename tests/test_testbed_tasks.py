"""The bundled testbed's task generators: determinism, disjoint splits, held-out sets, diverse and correct answers."""

import random
import re
import subprocess
import sys

import pytest

from tracelock.tasks.gsm8k import check_equations, extract_answer
from tracelock.tasks.math_task import MAX_VALUE
from tracelock.testbed import (
    TASKS,
    Example,
    approx_tokens,
    code_program,
    held_out,
    normalize,
    resample_answer,
    sample,
    score,
    split_of,
)

TASK_NAMES = ("math", "code")


def _run_checks(programs: list[tuple[str, str, str]]) -> str:
    """Run each (program, tests, entry point) in a fresh namespace of one plain subprocess; '' when all pass."""
    script = "import sys\nfailed = []\n"
    for i, (program, tests, entry) in enumerate(programs):
        src = program + tests + f"\ncheck({entry})\n"
        script += f"try:\n    exec({src!r}, {{}})\nexcept Exception as e:\n    failed.append(({i}, repr(e)))\n"
    script += "print(failed)\nsys.exit(1 if failed else 0)\n"
    r = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60)
    return "" if r.returncode == 0 else r.stdout + r.stderr


@pytest.mark.parametrize("task", TASK_NAMES)
def test_deterministic(task):
    a = [sample(task, "train", random.Random(123)) for _ in range(3)]
    b = [sample(task, "train", random.Random(123)) for _ in range(3)]
    assert a == b
    rng1, rng2 = random.Random(5), random.Random(5)
    assert [sample(task, "train", rng1) for _ in range(20)] == [sample(task, "train", rng2) for _ in range(20)]
    assert held_out(task, "test", 50, seed=1) == held_out(task, "test", 50, seed=1)
    assert held_out(task, "test", 50, seed=1) != held_out(task, "test", 50, seed=2)


def test_split_of_is_stable_and_proportioned():
    assert split_of("chain|4+3-2") == split_of("chain|4+3-2")
    counts = {"train": 0, "validation": 0, "test": 0}
    for i in range(20_000):
        counts[split_of(f"k{i}")] += 1
    assert 0.085 < counts["test"] / 20_000 < 0.115
    assert 0.04 < counts["validation"] / 20_000 < 0.06


@pytest.mark.parametrize("task", TASK_NAMES)
def test_splits_disjoint_after_normalisation(task):
    rng = random.Random(0)
    train = [sample(task, "train", rng) for _ in range(3000)]
    test = held_out(task, "test", 500)
    assert all(split_of(e.key) == "train" for e in train) and all(split_of(e.key) == "test" for e in test)
    assert not {normalize(e.prompt) for e in train} & {normalize(e.prompt) for e in test}
    assert not {e.key for e in train} & {e.key for e in test}
    # the stronger property behind it: a normalised prompt determines its key, whatever the split or phrasing
    owner = {}
    for e in train + test + [sample(task, s, rng) for s in ("validation", "test") for _ in range(300)]:
        assert owner.setdefault(normalize(e.prompt), e.key) == e.key, e.prompt


@pytest.mark.parametrize("task", TASK_NAMES)
def test_held_out_distinct_and_large(task):
    val = held_out(task, "validation", 1100, seed=3)
    assert len(val) == 1100 and len({e.key for e in val}) == 1100
    assert all(split_of(e.key) == "validation" for e in val)


class _FakeProblem:
    def __init__(self, i):
        self.task, self.key, self.prompt, self.target, self.entry_point = "fake", f"fake{i}", f"P{i}", str(i), None

    def answer(self, rng):
        return f"#### {self.key[4:]}"


class _FakeTask:
    @staticmethod
    def sample_problem(rng):
        return _FakeProblem(rng.randrange(300))


def test_held_out_raises_when_split_too_small(monkeypatch):
    monkeypatch.setitem(TASKS, "fake", _FakeTask)
    n_test = sum(split_of(f"fake{i}") == "test" for i in range(300))
    assert len(held_out("fake", "test", n_test, patience=5000)) == n_test
    with pytest.raises(ValueError, match="ran out"):
        held_out("fake", "test", n_test + 1, patience=5000)
    with pytest.raises(ValueError):
        sample("nope", "train", random.Random(0))
    with pytest.raises(ValueError):
        held_out("math", "dev", 1)


_EQ = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


def _check_math_answer(e: Example, answer: str) -> None:
    assert extract_answer(answer) == e.target and answer.endswith(f"#### {e.target}")
    assert score(e, answer) is True
    eqs = _EQ.findall(answer)
    assert len(eqs) >= 1, answer  # 1-3 steps, each with an equation
    for a, op, b, c in eqs:
        assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c), answer
        assert all(0 <= int(v) <= MAX_VALUE for v in (a, b, c))
    n, ok = check_equations(answer)
    assert n == ok == len(eqs)
    assert len(answer) <= 200 and approx_tokens(answer) <= 45, answer


def test_math_answers_diverse_and_correct():
    rng = random.Random(0)
    examples = [sample("math", "train", rng) for _ in range(20)] + held_out("math", "test", 20)
    distinct = []
    for e in examples:
        answers = {resample_answer(e, rng) for _ in range(50)} | {e.answer}
        distinct.append(len(answers))
        for a in answers:
            _check_math_answer(e, a)
            assert a.split("\n")[-1] not in e.prompt
        assert score(e, f"#### {int(e.target) + 1}") is False
        assert int(e.target) >= 0 and re.fullmatch(r"\d+", e.target)
    assert min(distinct) >= 5, distinct
    # stated numbers are single digits
    for e in examples:
        assert all(len(n) == 1 for n in re.findall(r"\d+", e.prompt)), e.prompt


def test_math_pair_orders_vary():
    rng = random.Random(1)
    e = next(x for x in iter(lambda: sample("math", "train", rng), None) if x.key.startswith("pair") and
             x.key.split("|")[1] != re.sub(r"[-+].*", "", x.key.split("|")[1]) and
             x.key.split("|")[2] != re.sub(r"[-+].*", "", x.key.split("|")[2]))
    first_eq = {_EQ.search(resample_answer(e, rng)).group(0) for _ in range(60)}
    assert len(first_eq) >= 3  # either account first, commuted or not


def test_code_answers_diverse_and_pass_tests():
    rng = random.Random(0)
    examples = [sample("code", "train", rng) for _ in range(20)] + held_out("code", "test", 20)
    programs, distinct = [], []
    for e in examples:
        assert e.prompt.startswith(f"def {e.entry_point}(") and e.prompt.endswith('"""\n')
        assert e.target.startswith("def check(candidate):\n") and e.target.count("assert candidate(") >= 10
        assert "candidate(0)" in e.target and "candidate(-1)" in e.target
        answers = {resample_answer(e, rng) for _ in range(50)} | {e.answer}
        distinct.append(len(answers))
        for a in answers:
            assert a.endswith("\n") and all(line.startswith("    ") for line in a.splitlines()), a
            assert len(a) <= 120 and approx_tokens(a) <= 45, a
            assert a.rstrip("\n").split("\n")[-1] not in e.prompt
            assert code_program(e, a) == e.prompt + a
            programs.append((code_program(e, a), e.target, e.entry_point))
        assert score(e, e.answer) is None
    assert min(distinct) >= 5, distinct
    assert _run_checks(programs) == ""
    # a wrong body fails the hidden tests
    assert _run_checks([(code_program(examples[0], "    return 12345\n"), examples[0].target, "f")]) != ""


def test_code_reference_runs_in_plain_subprocess():
    for e in held_out("code", "validation", 3, seed=4):
        program = code_program(e, e.answer)
        r = subprocess.run([sys.executable, "-c", program + e.target + f"\ncheck({e.entry_point})"], timeout=30)
        assert r.returncode == 0, program
        bad = subprocess.run([sys.executable, "-c", code_program(e, "    return 99999\n") + e.target +
                              f"\ncheck({e.entry_point})"], capture_output=True, timeout=30)
        assert bad.returncode != 0


def test_normalize():
    assert normalize("  Mia HAS\n 4   apples. ") == "mia has 4 apples."


def test_eval_task_spec_picks_the_split():
    from tracelock.eval.tasks import make_task
    from tracelock.tasks import split_of

    test, val = make_task("testbed:math").items(5), make_task("testbed:math@validation").items(5)
    # ids are places in the split's pool, so two draws pair by id
    assert all(re.fullmatch(r"math:test:\d+", it.id) for it in test)
    assert all(re.fullmatch(r"math:validation:\d+", it.id) for it in val)
    assert {split_of(it.reference.key) for it in val} == {"validation"}
    assert {split_of(it.reference.key) for it in test} == {"test"}
    assert make_task("testbed:code@validation").name == "testbed:code@validation"
    with pytest.raises(ValueError, match="testbed:math@validation"):
        make_task("testbed:math@train")


def test_a_draw_is_random_seeded_and_paired_by_pool_place():
    from tracelock.tasks import POOL, draw, held_out

    pool = held_out("code", "test", POOL)
    a, b = draw("code", "test", 50, seed=1), draw("code", "test", 50, seed=2)
    assert a == draw("code", "test", 50, seed=1) and a != b
    assert all(pool[i] == ex for i, ex in a + b)  # an item is its pool place, whatever the draw
    places = [i for i, _ in a]
    assert len(set(places)) == 50 and places != sorted(places) and max(places) > 500  # not the first 50
    # a larger draw is not a longer prefix of the pool: its mix does not drift with n
    assert max(i for i, _ in draw("code", "test", 500, seed=1)) > 1500
    for bad in (0, POOL + 1, True):
        with pytest.raises(ValueError, match=f"n={bad!r}: a draw takes 1 to {POOL}"):
            draw("code", "test", bad)


def test_file_tasks_draw_at_random_too(tmp_path):
    import json

    from tracelock.eval.tasks import make_task

    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(100)))
    ids = [it.id for it in make_task(f"gsm8k:{path}", seed=3).items(10)]
    assert len(set(ids)) == 10 and ids != [f"gsm8k:{i}" for i in range(10)]
    assert ids == [it.id for it in make_task(f"gsm8k:{path}", seed=3).items(10)]
    assert ids != [it.id for it in make_task(f"gsm8k:{path}", seed=4).items(10)]
    assert len(make_task(f"gsm8k:{path}").items(None)) == 100
