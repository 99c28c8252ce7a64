"""HumanEval-style small functions: a signature plus docstring, completed by a function body.

A problem is a chain of 1-3 integer operations (add / subtract 1-9, multiply / integer-divide / remainder 2-9) or a
parity conditional with one or two operations per branch. The key holds the operations only; the function name, argument
name and docstring phrasing are surface. Bodies come in many semantically equal forms: one expression or several
statements, temp variables with varied names or the argument reassigned, augmented assignments, commuted operands
(``3 * (x - 7)``), ``if``/``else``/conditional expressions with even or odd tests.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

FUNC_NAMES = ("f", "g", "h", "calc", "compute", "transform", "solve", "apply")
ARG_NAMES = ("x", "n", "a", "value", "num", "v")
TEMP_NAMES = ("y", "result", "res", "t", "tmp", "out", "z", "r")
TEST_INPUTS = (0, 1, 2, 3, 5, 8, 11, 20, -1, -2, -7, -12)
# kind -> (operator, precedence, constants, commutes, phrasings of "op on {v}")
OPS = {
    "add": ("+", 1, range(1, 10), True, ("add {k} to {v}", "increase {v} by {k}")),
    "sub": ("-", 1, range(1, 10), False, ("subtract {k} from {v}", "decrease {v} by {k}")),
    "mul": ("*", 2, range(2, 10), True, ("multiply {v} by {k}", "multiply {v} by {k}")),
    "div": ("//", 2, range(2, 10), False, ("integer-divide {v} by {k}", "divide {v} by {k} rounding down")),
    "mod": ("%", 2, range(2, 10), False, ("take {v} modulo {k}", "take the remainder of {v} divided by {k}")),
}
JOIN2 = ("{0}, then {1}.", "{0} and then {1}.", "First {0}, then {1}.")
JOIN3 = ("{0}, then {1}, then {2}.", "{0}, {1}, and then {2}.", "First {0}, then {1}, and finally {2}.")
COND = ("If {v} is even, {0}; otherwise {1}.", "If {v} is odd, {1}; otherwise {0}.")
EVEN = ("{v} % 2 == 0", "not {v} % 2")
ODD = ("{v} % 2 == 1", "{v} % 2 != 0", "{v} % 2")


def apply_op(kind: str, k: int, x: int) -> int:
    if kind in ("add", "sub"):
        return x + k if kind == "add" else x - k
    return x * k if kind == "mul" else x // k if kind == "div" else x % k


def _expr(kind: str, k: int, inner: tuple[str, int], commute: bool) -> tuple[str, int]:
    """(text, precedence) of `inner op k`; atoms have precedence 3."""
    sym, prec = OPS[kind][:2]
    text, p = inner
    if commute and OPS[kind][3]:
        return f"{k} {sym} {f'({text})' if p <= prec else text}", prec
    return f"{f'({text})' if p < prec else text} {sym} {k}", prec


@dataclass(frozen=True)
class CodeProblem:
    ops: tuple  # ((kind, k), ...): a chain applied in order; with cond, (even branch, odd branch) of such chains
    cond: bool
    func: int
    arg: int
    style: tuple  # docstring phrasing choices
    task = "code"

    @property
    def key(self) -> str:
        chain = lambda ops: ",".join(f"{kind}{k}" for kind, k in ops)  # noqa: E731
        return f"if|{chain(self.ops[0])}|{chain(self.ops[1])}" if self.cond else chain(self.ops)

    @property
    def entry_point(self) -> str:
        return FUNC_NAMES[self.func]

    def __call__(self, x: int) -> int:
        for kind, k in self.ops[x % 2] if self.cond else self.ops:
            x = apply_op(kind, k, x)
        return x

    @property
    def target(self) -> str:
        return "def check(candidate):\n" + "".join(f"    assert candidate({x}) == {self(x)}\n" for x in TEST_INPUTS)

    @property
    def prompt(self) -> str:
        v = ARG_NAMES[self.arg]
        phrase_style, join_style, ref_style = self.style
        refs = ("the result", "it")
        if self.cond:
            parts = [" and then ".join(OPS[kind][4][phrase_style].format(k=k, v="it") for kind, k in branch)
                     for branch in self.ops]
            doc = COND[join_style % len(COND)].format(*parts, v=v)
        else:
            parts = [OPS[kind][4][phrase_style].format(k=k, v=v if i == 0 else refs[(ref_style + i) % 2])
                     for i, (kind, k) in enumerate(self.ops)]
            join = "{0}." if len(parts) == 1 else (JOIN2 if len(parts) == 2 else JOIN3)[join_style]
            doc = join.format(*parts)
        doc = doc[0].upper() + doc[1:]
        return f'def {FUNC_NAMES[self.func]}({v}):\n    """{doc}"""\n'

    def answer(self, rng: random.Random) -> str:
        v = ARG_NAMES[self.arg]
        return self._cond_body(v, rng) if self.cond else self._chain_body(v, rng)

    def _cond_body(self, v: str, rng: random.Random) -> str:
        a, b = (self._group_expr(branch, v, rng) for branch in self.ops)
        cond = rng.choice(EVEN).format(v=v)
        if rng.random() < 0.5:  # test for odd instead
            a, b, cond = b, a, rng.choice(ODD).format(v=v)
        form = rng.randrange(3)
        if form == 0:
            return f"    if {cond}:\n        return {a}\n    return {b}\n"
        if form == 1:
            return f"    if {cond}:\n        return {a}\n    else:\n        return {b}\n"
        return f"    return {a} if {cond} else {b}\n"

    def _chain_body(self, v: str, rng: random.Random) -> str:
        ops = list(self.ops)
        # split the chain into consecutive groups: every group but the last is assigned to a variable
        cuts = sorted(rng.sample(range(1, len(ops)), rng.randint(0, len(ops) - 1))) if len(ops) > 1 else []
        groups = [ops[i:j] for i, j in zip([0] + cuts, cuts + [len(ops)])]
        temp = rng.choice([t for t in TEMP_NAMES if t != v] + [v])  # the argument itself may be reassigned
        fresh = rng.random() < 0.5  # a new temp name per statement
        lines, cur = [], v
        for gi, group in enumerate(groups):
            last = gi == len(groups) - 1
            if last and rng.random() < 0.6:
                lines.append(f"return {self._group_expr(group, cur, rng)}")
                break
            name = rng.choice([t for t in TEMP_NAMES if t not in (v, cur)]) if fresh and gi else temp
            if len(group) == 1 and name == cur and rng.random() < 0.6:
                kind, k = group[0]
                lines.append(f"{cur} {OPS[kind][0]}= {k}")
            else:
                lines.append(f"{name} = {self._group_expr(group, cur, rng)}")
            cur = name
            if last:
                lines.append(f"return {cur}")
        return "".join(f"    {line}\n" for line in lines)

    @staticmethod
    def _group_expr(group: list, var: str, rng: random.Random) -> str:
        e = (var, 3)
        for kind, k in group:
            e = _expr(kind, k, e, rng.random() < 0.5)
        return e[0]


def _compatible(a: str, b: str) -> bool:
    """Consecutive operations that would merge or cancel are not chained (add add, add sub, mul mul, ...)."""
    return a != b and {a, b} != {"add", "sub"}


def _positions(p: CodeProblem) -> list[tuple[int, int]]:
    return [(b, j) for b in range(2) for j in range(len(p.ops[b]))] if p.cond else [(-1, j) for j in range(len(p.ops))]


def _drop(p: CodeProblem, b: int, j: int) -> CodeProblem:
    """`p` without one operation (the j-th of branch b, or of the chain when b < 0)."""
    if b < 0:
        return CodeProblem(p.ops[:j] + p.ops[j + 1:], False, 0, 0, p.style)
    branches = list(p.ops)
    branches[b] = branches[b][:j] + branches[b][j + 1:]
    return CodeProblem(tuple(branches), True, 0, 0, p.style)


@functools.lru_cache(maxsize=1 << 17)
def _useful(ops: tuple, cond: bool) -> bool:
    """Not (nearly) constant on the tests, and every operation matters (dropping it changes some output)."""
    p = CodeProblem(ops, cond, 0, 0, (0, 0, 0))
    outputs = [p(x) for x in TEST_INPUTS]
    return len(set(outputs)) > 2 and all(outputs != [q(x) for x in TEST_INPUTS]
                                         for q in (_drop(p, b, j) for b, j in _positions(p)))


def _sample_chain(rng: random.Random, n_ops: int) -> tuple | None:
    ops = []
    for _ in range(n_ops):
        kind = rng.choice(tuple(OPS))
        if ops and not _compatible(ops[-1][0], kind):
            return None
        ops.append((kind, rng.choice(OPS[kind][2])))
    return tuple(ops)


def sample_problem(rng: random.Random) -> CodeProblem:
    """A random problem of the task's distribution (any split), with its surface chosen."""
    kind = rng.choices(("1", "2", "3", "if"), weights=(3, 4, 2, 1))[0]
    while True:
        if kind == "if":
            ops = (_sample_chain(rng, rng.choice((1, 1, 2))), _sample_chain(rng, 1))
            ops = None if None in ops or ops[0] == ops[1] else ops if rng.random() < 0.5 else ops[::-1]
        else:
            ops = _sample_chain(rng, int(kind))
        if ops is None:
            continue
        style = (rng.randrange(2), rng.randrange(3), rng.randrange(2))
        p = CodeProblem(ops, kind == "if", rng.randrange(len(FUNC_NAMES)), rng.randrange(len(ARG_NAMES)), style)
        if _useful(ops, kind == "if"):
            return p
