"""GSM8K-style answer extraction and scoring, shared by the bundled math testbed and real GSM8K.

* `extract_answer(text)`: the number after the first ``####`` marker; without a marker, the last number in the
  text. Commas, currency signs and trailing dots are stripped ("$1,234." -> "1234"); negatives and decimals are kept.
* `is_correct(completion, reference)`: numeric equality of the two extracted answers (``float`` after normalising,
  so "5", "5.0" and "$5." all match). `reference` may be a bare number or a full GSM8K answer with a ``####`` line.
* `check_equations(text)`: ``(n_equations, n_correct)`` over arithmetic equations such as ``4 + 3 = 7`` or GSM8K's
  ``<<16-3-4=9>>`` annotations, for the "every equation correct" metric (a right final number for wrong reasons).
"""

from __future__ import annotations

import re

__all__ = ["all_equations_correct", "check_equations", "extract_answer", "is_correct", "normalize_number"]

# an optional minus sign, an optional currency sign, then digits with thousands commas and an optional decimal part
_NUMBER = re.compile(r"(?<![\w.])([-\u2212]?)\s?\$?\s?(\d[\d,]*(?:\.\d*)?|\.\d+)")
_MARKER = re.compile(r"####")
# an arithmetic expression (numbers, + - * / x × ÷, parentheses) = a number
_EQUATION = re.compile(r"([\d.,()\s]*\d[\d.,()\s+\-*/x×÷]*?)=\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")


def normalize_number(text: str) -> str | None:
    """The first number in `text` as a plain string ("-$1,234.50" -> "-1234.50", "7." -> "7"), or None."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    sign = "-" if m.group(1) else ""
    digits = m.group(2).replace(",", "").rstrip(".")
    if not digits:
        return None
    return sign + digits


def extract_answer(text: str) -> str | None:
    """The answer of a GSM8K-style solution: after the first ``####``, else the last number in the text."""
    if text is None:
        return None
    m = _MARKER.search(text)
    if m is not None:
        line = text[m.end():].split("\n", 1)[0]
        found = normalize_number(line)
        if found is not None:
            return found
    last = None
    for m in _NUMBER.finditer(text):
        last = m
    if last is None:
        return None
    return normalize_number(last.group(0))


def _as_float(s: str | None) -> float | None:
    if s is None:
        return None
    try:
        return float(s)
    except ValueError:
        return None


def is_correct(completion: str, reference: str) -> bool:
    """Whether the completion's extracted answer equals the reference's numerically."""
    got = _as_float(extract_answer(completion))
    want = _as_float(extract_answer(reference))
    return got is not None and want is not None and got == want


def _eval_arith(expr: str) -> float | None:
    expr = expr.replace(",", "").replace("×", "*").replace("÷", "/").replace("x", "*")
    expr = re.sub(r"^[.,\s]*(?=[\d(])", "", expr).strip()  # drop a sentence's trailing dot caught before it
    if not expr or not re.fullmatch(r"[\d.\s()+\-*/]+", expr) or not re.search(r"[+\-*/]", expr.lstrip("-")):
        return None
    try:
        return float(eval(expr, {"__builtins__": {}}, {}))  # noqa: S307 - the regex above admits arithmetic only
    except (SyntaxError, ZeroDivisionError, TypeError, ValueError):
        return None


def check_equations(text: str) -> tuple[int, int]:
    """(number of arithmetic equations ``a op b ... = c`` in `text`, number of them that are arithmetically true)."""
    n = ok = 0
    for line in text.split("\n"):
        for lhs, rhs in _EQUATION.findall(line):
            value = _eval_arith(lhs)
            if value is None:
                continue
            n += 1
            ok += abs(value - float(rhs.replace(",", ""))) < 1e-6
    return n, ok


def all_equations_correct(text: str) -> bool:
    """True when every equation in `text` is arithmetically true (vacuously true with none)."""
    n, ok = check_equations(text)
    return n == ok
