"""GSM8K-style answer extraction and scoring (tracelock.tasks.gsm8k)."""

import json
from pathlib import Path

import pytest

from tracelock.tasks.gsm8k import all_equations_correct, check_equations, extract_answer, is_correct, normalize_number

GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"  # ../shared


@pytest.mark.parametrize("text, expected", [
    ("She has 4 + 3 = 7 apples.\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("####  $18.", "18"),
    ("The answer is $1,234.", "1234"),
    ("so the total is 3.75 dollars", "3.75"),
    ("#### -3", "-3"),
    ("it drops to -12 degrees.", "-12"),
    ("He owes -$5.", "-5"),
    ("4 + 3 = 7 apples\n#### 7\n#### 9", "7"),  # the first marker wins over later ones
    ("2 then 3 then 5.", "5"),  # no marker: the last number
    ("#### none\nso 42", "42"),  # a marker without a number falls back to the last number
    ("no numbers here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_normalize_number():
    assert normalize_number("-$1,234.50") == "-1234.50"
    assert normalize_number("7.") == "7"
    assert normalize_number("abc") is None


@pytest.mark.parametrize("completion, reference, ok", [
    ("#### 5", "5", True),
    ("#### 5.0", "5", True),
    ("The answer is $5.", "5", True),
    ("#### 5", "Janet sells 2 + 3 = 5 eggs.\n#### 5", True),
    ("#### 1,000", "1000", True),
    ("#### 6", "5", False),
    ("#### -5", "5", False),
    ("I do not know", "5", False),
    ("#### 5", "no number", False),
])
def test_is_correct(completion, reference, ok):
    assert is_correct(completion, reference) is ok


def test_check_equations():
    assert check_equations("Mia has 4 + 3 = 7 apples.\n7 - 2 = 5 are left.\n#### 5") == (2, 2)
    assert check_equations("3 * 4 = 12. 12 + 1 = 14.") == (2, 1)
    assert check_equations("She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.") == (1, 1)
    assert check_equations("no equations, just 7") == (0, 0)
    assert all_equations_correct("2 + 2 = 4\n#### 4") and not all_equations_correct("2 + 2 = 5")


def test_real_gsm8k_answers():
    if not GSM8K_TEST.exists():
        pytest.skip("GSM8K test split not available")
    with GSM8K_TEST.open() as f:
        rows = [json.loads(next(f)) for _ in range(5)]
    for row in rows:
        answer = row["answer"]
        value = answer.split("####")[-1].strip().replace(",", "")
        assert extract_answer(answer) == value
        assert is_correct(answer, value) and is_correct(f"So the answer is {value}.", answer)
        assert not is_correct(f"#### {float(value) + 1}", answer)
        n, ok = check_equations(answer)
        assert n >= 1 and ok == n, answer  # the <<a op b = c>> annotations parse and are true


def test_every_gold_solution_of_the_test_split():
    """The public API on all 1,319 gold solutions: the extracted number is the gold one, and scores correct."""
    from tracelock.eval import extract_gsm8k_answer, is_gsm8k_correct

    if not GSM8K_TEST.exists():
        pytest.skip("GSM8K test split not available")
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    assert len(rows) == 1319
    gold = [row["answer"].split("####")[-1].strip().replace(",", "") for row in rows]
    recovered = sum(extract_gsm8k_answer(row["answer"]) == g for row, g in zip(rows, gold))
    scored = sum(is_gsm8k_correct(row["answer"], row["answer"]) for row in rows)
    print(f"GSM8K gold solutions: {recovered}/{len(rows)} numbers recovered, {scored}/{len(rows)} scored correct")
    assert recovered == scored == 1319
