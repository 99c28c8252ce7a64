"""Which decoded rows become training traces: each filter returns a reason string or None (keep).

Training on the model's own traces teaches the controller the model's behaviour, so rows that are not a usable
answer (empty, a few tokens, degenerate repetition; for code, a program that does not parse or fails its own
hidden tests) are dropped, and every drop is counted by reason in the collection summary, never silent.
Text filters work on token ids, so they behave the same with any tokenizer.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass

import numpy as np

EMPTY, TOO_SHORT, DOMINANT_TOKEN, REPEATED_NGRAM = "empty", "too_short", "dominant_token", "repeated_ngram"
DOES_NOT_PARSE, FAILS_TESTS = "does_not_parse", "fails_tests"


@dataclass(frozen=True)
class TraceFilterConfig:
    """Thresholds of the filters. The defaults pass every reference answer of the testbed tasks.

    Args:
        min_tokens (int): fewer answer tokens (before the first end token) is "too_short". Default: 3.
        max_token_fraction (float): one token id making up more than this share of an answer of at least
            ``min_span`` tokens is "dominant_token". Default: 0.5.
        max_repeats (int): an n-gram repeated back to back this many times ... Default: 4.
        min_span (int): ... and covering at least this many tokens is "repeated_ngram". Default: 8.
        max_ngram (int): longest n-gram checked for back-to-back repeats. Default: 8.
        run_tests (bool): run code answers against their hidden tests in the sandbox. Default: True.
        enabled (bool): False keeps every row (e.g. to study the raw distribution). Default: True.
    """

    min_tokens: int = 3
    max_token_fraction: float = 0.5
    max_repeats: int = 4
    min_span: int = 8
    max_ngram: int = 8
    run_tests: bool = True
    enabled: bool = True


def empty_or_short(answer: list, min_tokens: int) -> str | None:
    """``answer``: the generated ids before the first end token."""
    if not answer:
        return EMPTY
    return TOO_SHORT if len(answer) < min_tokens else None


def dominant_token(answer: list, max_fraction: float, min_span: int) -> str | None:
    if len(answer) < min_span:
        return None
    _, top = Counter(answer).most_common(1)[0]
    return DOMINANT_TOKEN if top > max_fraction * len(answer) else None


def repeated_ngram(answer: list, max_repeats: int, min_span: int, max_ngram: int = 8) -> str | None:
    """Some n-gram (n <= max_ngram) repeated ``max_repeats`` times back to back over ``min_span`` tokens or more:
    the loop a collapsing decoder falls into ("the the the ...", "= 4 = 4 = 4 ...")."""
    seq = np.asarray(answer)
    for n in range(1, max_ngram + 1):
        repeats = max(max_repeats, -(-min_span // n))  # enough copies to cover min_span tokens
        # r back-to-back copies of an n-gram <=> seq[i] == seq[i + n] for (r - 1) * n consecutive i
        same = np.concatenate([[False], seq[n:] == seq[:-n], [False]]) if len(seq) > n else np.zeros(2, bool)
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if len(edges) and (edges[1::2] - edges[::2]).max() >= (repeats - 1) * n:
            return REPEATED_NGRAM
    return None


def does_not_parse(program: str) -> str | None:
    try:
        ast.parse(program)
    except (SyntaxError, ValueError):  # ValueError: null bytes in the source
        return DOES_NOT_PARSE
    return None


def text_reason(answer: list, config: TraceFilterConfig) -> str | None:
    """The first text filter that drops ``answer`` (ids before the first end token), or None."""
    if not config.enabled:
        return None
    return (empty_or_short(answer, config.min_tokens)
            or dominant_token(answer, config.max_token_fraction, config.min_span)
            or repeated_ngram(answer, config.max_repeats, config.min_span, config.max_ngram))


def code_reasons(programs: list, tests: list, config: TraceFilterConfig, workers: int = 2) -> list:
    """For code rows: "does_not_parse", or "fails_tests" when ``tests[i]`` = (test code, entry point) is given and
    the program fails them in the sandbox; None keeps the row."""
    if len(tests) != len(programs):
        raise ValueError(f"tests has {len(tests)} entries for {len(programs)} programs; pass None where there are none")
    if not config.enabled:
        return [None] * len(programs)
    reasons = [does_not_parse(p) for p in programs]
    run = [i for i, (r, t) in enumerate(zip(reasons, tests)) if r is None and t is not None and config.run_tests]
    if run:
        from tracelock.sandbox import check_many

        results = check_many([(programs[i], tests[i][0], tests[i][1]) for i in run], workers=workers, timeout=5.0)
        for i, res in zip(run, results):
            reasons[i] = None if res.status == "ok" else FAILS_TESTS
    return reasons
