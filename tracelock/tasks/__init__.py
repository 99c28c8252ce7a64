"""The tasks, at the bottom of the package: the testbed's math and code tasks (`math_task`, `code_task`), GSM8K's
answer rules (`gsm8k`, which also grade the math task, so testbed and GSM8K accuracy are the same measurement), and
here their common interface: examples, the task registry, stable splits, held-out sets and scoring. Nothing here
imports the rest of the package; the bundled models' training and demos (`tracelock.testbed`) and the evaluation
harness (`tracelock.eval`) build on it.

Splits are assigned from the canonical problem key (template + numbers/ops, never the phrasing) by a stable hash:
about 10% "test", 5% "validation", the rest "train". Different keys always render to different prompts, so a
held-out prompt never appears (after `normalize`) among training prompts, whatever phrasing either drew.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from tracelock.tasks import code_task, math_task
from tracelock.tasks.gsm8k import is_correct
from tracelock.tasks.math_task import approx_tokens  # noqa: F401  (the testbed re-exports it)

SPLITS = ("train", "validation", "test")


class Problem(Protocol):
    task: str
    key: str
    prompt: str
    target: str
    entry_point: str | None

    def answer(self, rng: random.Random) -> str: ...


class TaskModule(Protocol):
    def sample_problem(self, rng: random.Random) -> Problem: ...


@dataclass(frozen=True)
class Example:
    task: str  # "math" | "code"
    prompt: str  # the user message; for code the signature + docstring, the start of the program
    answer: str  # one reference answer drawn from the diverse answer distribution (the training target)
    key: str  # canonical problem key: split assignment and dedup
    target: str  # math: the final number; code: the hidden HumanEval-style `def check(candidate): ...`
    entry_point: str | None  # code: the function name
    problem: Any = field(default=None, compare=False, repr=False)  # the generating problem, for `resample_answer`


TASKS: dict[str, TaskModule] = {"math": math_task, "code": code_task}


def split_of(key: str) -> str:
    """The split of a problem key: a stable hash, ~10% "test", ~5% "validation", the rest "train"."""
    h = int.from_bytes(hashlib.sha256(f"tracelock-testbed-split:{key}".encode()).digest()[:8], "big") % 1000
    return "test" if h < 100 else "validation" if h < 150 else "train"


def _example(task: str, problem: Problem, rng: random.Random) -> Example:
    return Example(task=task, prompt=problem.prompt, answer=problem.answer(rng), key=problem.key,
                   target=problem.target, entry_point=problem.entry_point, problem=problem)


def _task(task: str) -> TaskModule:
    if task not in TASKS:
        from tracelock.text import did_you_mean

        raise ValueError(f"unknown testbed task {task!r}; known: {sorted(TASKS)}{did_you_mean(task, TASKS)}")
    return TASKS[task]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {SPLITS}")


def sample(task: str, split: str, rng: random.Random) -> Example:
    """A random problem of `split` (rejection-sampled on `split_of(key)`) with a freshly drawn answer."""
    t = _task(task)
    _check_split(split)
    while True:
        p = t.sample_problem(rng)
        if split_of(p.key) == split:
            return _example(task, p, rng)


def resample_answer(example: Example, rng: random.Random) -> str:
    """Another answer to the same problem (same prompt and surface), drawn from the answer distribution."""
    if example.problem is None:
        raise ValueError("this Example carries no problem to resample from")
    return example.problem.answer(rng)


# ceilings of a held-out draw, above what each split holds (math: about 8,600 distinct test problems and 94,000 train
# ones, code: 4,200 and 109,000): a larger count is refused at once instead of after minutes of drawing
MAX_HELD_OUT = {"train": 200_000, "validation": 20_000, "test": 20_000}


def held_out(task: str, split: str, n: int, seed: int = 0, patience: int = 20_000) -> list[Example]:
    """`n` problems of `split` with distinct keys, deterministic from `seed`.

    Problems are drawn from the task's distribution (so the held-out mix matches training); raises ValueError when
    `patience` consecutive draws bring no new key, i.e. the split has (practically) fewer than `n` distinct keys.
    """
    t = _task(task)
    _check_split(split)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_HELD_OUT[split]:
        raise ValueError(f"n={n!r}: the {split} split of {task} holds fewer than {MAX_HELD_OUT[split]:,} distinct "
                         f"problems; ask for 1 to {MAX_HELD_OUT[split]:,} (--limit)")
    rng = random.Random(f"tracelock-held-out:{task}:{split}:{seed}")
    seen: set[str] = set()
    out: list[Example] = []
    misses = 0
    while len(out) < n:
        p = t.sample_problem(rng)
        if p.key in seen or split_of(p.key) != split:
            misses += 1
            if misses > patience:
                raise ValueError(f"split {split!r} of task {task!r} ran out of distinct problems at {len(out)} < {n}")
            continue
        misses = 0
        seen.add(p.key)
        out.append(_example(task, p, rng))
    return out


# the population a random draw samples from: a split's first POOL distinct problems (seed 0). Taking the first n
# distinct problems instead would make the mix depend on n: simple problems have few distinct keys, are drawn early
# and run out, so later items are harder (a key's mean part count: 2.5 over the first 100 test items, 2.9-3.1 after
# the 300th; the LLaDA-family math reference scored 87% on the first 100 test items, 75.5% on the next 200)
POOL = 2000


@functools.cache
def _pool(task: str, split: str) -> tuple:
    return tuple(held_out(task, split, POOL))


def draw(task: str, split: str, n: int, seed: int = 0) -> list[tuple[int, Example]]:
    """`n` (pool index, example) pairs sampled without replacement from the split's pool of `POOL` distinct
    problems, in a random order fixed by `seed`; the pool index names an item across draws (paired comparisons)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= POOL:
        raise ValueError(f"n={n!r}: a draw takes 1 to {POOL} items of the split's pool")
    pool = _pool(task, split)
    picks = random.Random(f"tracelock-draw:{task}:{split}:{seed}").sample(range(POOL), n)
    return [(i, pool[i]) for i in picks]


def score(example: Example, completion: str) -> bool | None:
    """math: exact numeric match of the extracted answer; code: None (run `code_program` + target in a sandbox)."""
    if example.task == "code":
        return None
    return is_correct(completion, example.target)


def code_program(example: Example, completion: str) -> str:
    """The full program: the prompt (signature + docstring) followed by the completion (the function body)."""
    return example.prompt + completion


def normalize(text: str) -> str:
    """Lower-case and collapse whitespace (used to check that train and held-out prompts are disjoint)."""
    return " ".join(text.lower().split())
