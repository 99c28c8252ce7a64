"""GSM8K-style word problems with small numbers and diverse worked answers.

A problem is one person's count that changes over 1-2 steps ("chain"), or two people's counts combined at the end
("pair": together / how many more). Stated numbers are 1-9, every intermediate and final value is 0-30
(`MAX_VALUE`): small enough that a tiny model learns the arithmetic, so what remains hard is the commitment order.
The problem key holds the structure and numbers only (template + numbers/ops); names, objects, verbs and sentence
phrasings are surface, chosen per problem and not part of the key. Every rendering states all numbers in order
inside structure-specific sentences, so two keys never render to the same prompt.

Answers: one line per step with an equation (``4 + 3 = 7``), 3-5 phrasings per step type, commuted operands
where valid, optional start / filler / summary lines, a varying order for the pair's two independent accounts,
and a final ``#### N`` line. `MathProblem.answer(rng)` draws a fresh one.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

NAMES = (("Mia", "she", "her"), ("Leo", "he", "him"), ("Tom", "he", "him"), ("Anna", "she", "her"),
         ("Sam", "he", "him"), ("Lily", "she", "her"), ("Ben", "he", "him"), ("Emma", "she", "her"),
         ("Max", "he", "him"), ("Zoe", "she", "her"))
OBJECTS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "cards", "shells", "stamps", "balloons")
CONTAINERS = (("boxes", "box"), ("bags", "bag"), ("packs", "pack"))
# (prompt sentence, present verb, gerund); {S} subject, {B} another person, {o} object pronoun of the subject
PLUS = (("{S} buys {n} more {obj}.", "buys", "buying"), ("{S} finds {n} more {obj}.", "finds", "finding"),
        ("{B} gives {o} {n} {obj}.", "gets", "getting"))
MINUS = (("{S} loses {n} {obj}.", "loses", "losing"), ("{S} sells {n} {obj}.", "sells", "selling"),
         ("{S} gives {n} {obj} to {B}.", "gives away", "giving away"))
BUY = (("{S} buys {m} {cons} with {n} {obj} in each {con}.", "buys", "buying"),
       ("{S} gets {m} more {cons} of {n} {obj} each.", "gets", "getting"))
START_N = ("{A} has {a} {obj}.", "{A} owns {a} {obj}.")
START_X = ("{A} has {m} {cons} with {n} {obj} in each {con}.", "{A} has {m} {cons} of {obj}, each with {n} {obj}.")
ASK_CHAIN = ("How many {obj} does {A} have now?", "How many {obj} does {A} have in the end?")
ASK_SUM = ("How many {obj} do {A} and {B} have together?", "How many {obj} do {A} and {B} have in total?")
ASK_DIFF = ("How many more {obj} does {A} have than {B}?",)

# answer lines; {eq} is the step's equation "a op b = c"
A_START = ("{A} starts with {a} {obj}.", "At first {A} has {a} {obj}.", "{A} has {a} {obj} at the start.")
A_START_X = ("{A} has {eq} {obj}.", "{A} starts with {eq} {obj}.", "{m} {cons} of {n} is {eq} {obj}.",
             "At first there are {eq} {obj}.")
A_PLUS = ("{S} {pres} {n}, so {s} has {eq}.", "After {ger} {n}, {s} has {eq} {obj}.", "Then {s} has {eq} {obj}.",
          "{eq} {obj} after {ger} {n}.", "Now {s} has {eq}.")
A_MINUS = ("{S} {pres} {n}, so {s} has {eq}.", "After {ger} {n}, {s} has {eq} {obj}.", "{eq} {obj} are left.",
           "Now {s} has {eq} {obj} left.", "Then {s} has {eq}.")
A_BUY = ("{S} {pres} {eq} more {obj}.", "The {cons} hold {eq} {obj}.", "{m} {cons} of {n} is {eq} {obj}.")
A_SUM = ("Together they have {eq} {obj}.", "In total they have {eq} {obj}.", "{A} and {B} have {eq} {obj} together.",
         "So {eq} {obj} in total.")
A_DIFF = ("{A} has {eq} more {obj} than {B}.", "The difference is {eq}.", "So {A} has {eq} more.")
A_FILLER = ("Let's think step by step.", "We go step by step.", "Step by step.")
A_SUMMARY = ("The answer is {ans}.", "So the answer is {ans}.")
MAX_CHARS, MAX_TOKENS = 200, 45
MAX_VALUE = 30
_TOKEN = re.compile(r"\n|\d|[A-Za-z]+|[^\sA-Za-z\d]")


@dataclass(frozen=True)
class Account:
    name: int  # index into NAMES
    start: tuple  # ("n", a) or ("x", m, n): m containers of n
    events: tuple  # ("+", n) | ("-", n) | ("x", m, n): gets m containers of n
    verbs: tuple  # phrasing index per event


def _key(acc: Account) -> str:
    s = "".join(f"{e[0]}{e[1]}" if len(e) == 2 else f"+{e[1]}x{e[2]}" for e in acc.events)
    return (str(acc.start[1]) if acc.start[0] == "n" else f"{acc.start[1]}x{acc.start[2]}") + s


def _steps(acc: Account) -> tuple[list[tuple], int]:
    """([(kind, x, n, y, event_index)], final value); kind "x" is a product m * n = y with x = m."""
    steps = []
    if acc.start[0] == "n":
        v = acc.start[1]
    else:
        v = acc.start[1] * acc.start[2]
        steps.append(("x", acc.start[1], acc.start[2], v, -1))
    for i, e in enumerate(acc.events):
        if e[0] == "x":
            q = e[1] * e[2]
            steps += [("x", e[1], e[2], q, i), ("+", v, q, v + q, i)]
            v += q
        else:
            y = v + e[1] if e[0] == "+" else v - e[1]
            steps.append((e[0], v, e[1], y, i))
            v = y
    return steps, v


def _valid(acc: Account) -> bool:
    steps, _ = _steps(acc)
    return all(0 <= s[3] <= MAX_VALUE for s in steps)


def _fmt(s: str, ctx: dict) -> str:
    out = s.format(**ctx)
    return out[0].upper() + out[1:]


@dataclass(frozen=True)
class MathProblem:
    kind: str  # "chain" | "pair"
    accounts: tuple  # one Account (chain) or two (pair)
    combine: str  # "" | "sum" | "diff"
    obj: int
    container: int
    other: int  # the extra person of a chain ("gives 2 to Leo")
    style: tuple  # prompt phrasing choices: (start, question, "then" connectors)
    task = "math"
    entry_point = None

    @property
    def key(self) -> str:
        return f"{self.kind}{self.combine}|" + "|".join(_key(a) for a in self.accounts)

    @property
    def value(self) -> int:
        vals = [_steps(a)[1] for a in self.accounts]
        return vals[0] if self.kind == "chain" else vals[0] + vals[1] if self.combine == "sum" else vals[0] - vals[1]

    @property
    def target(self) -> str:
        return str(self.value)

    def _ctx(self, acc: Account) -> dict:
        name, pron, objp = NAMES[acc.name]
        other = NAMES[self.other if self.kind == "chain" else self.accounts[1 - self.accounts.index(acc)].name][0]
        cons, con = CONTAINERS[self.container]
        return dict(A=name, B=other, o=objp, obj=OBJECTS[self.obj], cons=cons, con=con,
                    S=pron.capitalize() if self.kind == "chain" else name, s=pron if self.kind == "chain" else name)

    @property
    def prompt(self) -> str:
        start_style, ask_style, then = self.style
        out = []
        for acc in self.accounts:
            c = self._ctx(acc)
            st = acc.start
            out.append(_fmt(START_N[start_style], dict(c, a=st[1])) if st[0] == "n"
                       else _fmt(START_X[start_style], dict(c, m=st[1], n=st[2])))
            for i, (e, verb) in enumerate(zip(acc.events, acc.verbs)):
                table = BUY if e[0] == "x" else PLUS if e[0] == "+" else MINUS
                sent = _fmt(table[verb][0], dict(c, m=e[1], n=e[-1]))
                if then and i > 0 and "{S}" in table[verb][0]:
                    sent = f"Then {sent[0].lower() if self.kind == 'chain' else sent[0]}{sent[1:]}"
                out.append(sent)
        c = dict(self._ctx(self.accounts[0]))
        ask = ASK_CHAIN if self.kind == "chain" else ASK_SUM if self.combine == "sum" else ASK_DIFF
        out.append(_fmt(ask[ask_style % len(ask)], c))
        return " ".join(out)

    def _account_lines(self, acc: Account, rng: random.Random) -> list[tuple[str, bool]]:
        """[(line, optional)] for one account's steps."""
        c = self._ctx(acc)
        steps, _ = _steps(acc)
        lines = []
        if acc.start[0] == "n":
            lines.append((_fmt(rng.choice(A_START), dict(c, a=acc.start[1])), True))
        for kind, x, n, y, i in steps:
            if self.kind == "chain" and rng.random() < 0.3:
                c = dict(c, S=NAMES[acc.name][0], s=NAMES[acc.name][0])  # name instead of pronoun
            verb = BUY[acc.verbs[i]] if i >= 0 and acc.events[i][0] == "x" else None
            if kind == "x":
                eq = f"{x} * {n} = {y}" if rng.random() < 0.5 else f"{n} * {x} = {y}"
                table = A_START_X if i < 0 else A_BUY
                lines.append((_fmt(rng.choice(table), dict(c, eq=eq, m=x, n=n, pres=verb[1] if verb else "")), False))
                continue
            if verb is None:
                verb = (PLUS if kind == "+" else MINUS)[acc.verbs[i]]
            eq = f"{n} + {x} = {y}" if kind == "+" and rng.random() < 0.5 else f"{x} {kind} {n} = {y}"
            table = A_PLUS if kind == "+" else A_MINUS
            lines.append((_fmt(rng.choice(table), dict(c, eq=eq, n=n, pres=verb[1], ger=verb[2])), False))
        return lines

    def answer(self, rng: random.Random) -> str:
        for _ in range(20):
            text = self._render_answer(rng)
            if len(text) <= MAX_CHARS and approx_tokens(text) <= MAX_TOKENS:
                return text
        return min((self._render_answer(rng, optional=False) for _ in range(30)), key=approx_tokens)

    def _render_answer(self, rng: random.Random, optional: bool = True) -> str:
        blocks = [self._account_lines(a, rng) for a in self.accounts]
        if self.kind == "pair":
            rng.shuffle(blocks)  # the two accounts are independent
        lines = [x for b in blocks for x in b]
        if self.kind == "pair":
            vals = [_steps(a)[1] for a in self.accounts]
            c = self._ctx(self.accounts[0])
            if self.combine == "sum":
                x, y = vals if rng.random() < 0.5 else vals[::-1]
                lines.append((_fmt(rng.choice(A_SUM), dict(c, eq=f"{x} + {y} = {x + y}")), False))
            else:
                lines.append((_fmt(rng.choice(A_DIFF), dict(c, eq=f"{vals[0]} - {vals[1]} = {self.value}")), False))
        if rng.random() < 0.25:
            lines.insert(0, (rng.choice(A_FILLER), True))
        if rng.random() < 0.3:
            lines.append((rng.choice(A_SUMMARY).format(ans=self.value), True))
        keep = [t for t, opt in lines if not opt or (optional and rng.random() < 0.5)]
        return "\n".join(keep + [f"#### {self.value}"])


def approx_tokens(text: str) -> int:
    """Rough token count of the testbed tokenizers: words, single digits, punctuation and newlines."""
    return len(_TOKEN.findall(text))


def _sample_account(rng: random.Random, name: int, n_eq: int, pair: bool) -> Account:
    boxes = n_eq >= 1 and rng.random() < 0.3
    start = ("x", rng.randint(2, 9), rng.randint(2, 9)) if boxes else ("n", rng.randint(1, 9))
    eq, events, value = (1 if start[0] == "x" else 0), [], (start[1] * start[2] if start[0] == "x" else start[1])
    while eq < n_eq:
        if n_eq - eq >= 2 and rng.random() < 0.25:
            e = ("x", rng.randint(2, 9), rng.randint(2, 9))
            value, eq = value + e[1] * e[2], eq + 2
        elif value > 0 and rng.random() < 0.5:
            e = ("-", rng.randint(1, min(9, value)))
            value, eq = value - e[1], eq + 1
        else:
            e = ("+", rng.randint(1, 9))
            value, eq = value + e[1], eq + 1
        events.append(e)
    n_verbs = lambda e: len(BUY) if e[0] == "x" else 2 if pair else 3  # noqa: E731 - pairs never give to the other
    return Account(name, start, tuple(events), tuple(rng.randrange(n_verbs(e)) for e in events))


def sample_problem(rng: random.Random) -> MathProblem:
    """A random problem of the task's distribution (any split), with its surface chosen."""
    while True:
        names = rng.sample(range(len(NAMES)), 2)
        style = (rng.randrange(2), rng.randrange(2), rng.random() < 0.5)
        surface = dict(obj=rng.randrange(len(OBJECTS)), container=rng.randrange(len(CONTAINERS)), style=style)
        if rng.random() < 0.6:
            acc = _sample_account(rng, names[0], rng.choice((1, 2, 2)), pair=False)
            if not acc.events:
                continue
            p = MathProblem("chain", (acc,), "", other=names[1], **surface)
        else:
            ea, eb = rng.choice(((1, 0), (0, 1), (1, 1), (2, 0), (0, 2), (1, 1)))
            accs = (_sample_account(rng, names[0], ea, True), _sample_account(rng, names[1], eb, True))
            p = MathProblem("pair", accs, rng.choice(("sum", "diff")), other=names[1], **surface)
            if p.combine == "diff" and p.value <= 0:
                continue
        if all(_valid(a) for a in p.accounts) and 0 <= p.value <= MAX_VALUE:
            return p
