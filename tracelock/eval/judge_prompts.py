"""The QA judge's prompts and the strict parsing of its replies.

* Batch ranking: the paper's appendix prompt, verbatim. It asks for a 0-10 *score* per anonymised candidate
  (``candidate_1`` ... ``candidate_n``) in one JSON object; `tracelock.eval.judge` turns the scores into ranks.
* Critic: the paper describes it (appendix, "Additional QA ranking and critic metrics") but does not print it, so
  the text below is ours: one answer against a non-exhaustive reference, verdict correct / incorrect /
  not_judgeable.
* Parsing accepts one JSON object, alone or inside surrounding prose or a code fence, and nothing looser: a
  truncated or malformed object, two objects, duplicate keys, NaN, missing or extra candidates and out-of-range
  scores all raise `ReplyError` with a reason that is sent back to the judge when it is re-asked.
"""

from __future__ import annotations

import json
import math
import re

__all__ = [
    "CRITIC_VERDICTS",
    "ReplyError",
    "candidate_ids",
    "critic_messages",
    "extract_json_object",
    "parse_scores",
    "parse_verdict",
    "ranking_messages",
    "reask_message",
]

RANKING_SYSTEM = "You are a strict scoring assistant. Return exactly one JSON object and nothing else."

# verbatim from the paper's appendix "QA LLM-as-Judge Prompt"; {placeholders} are filled by _fill, not str.format,
# because the schema's braces are literal
RANKING_TEMPLATE = """Score the candidate answers for the same question.

Rules:
1. Score candidates only relative to each other within this batch, not against a
   global scale across questions.
2. Use a 0 to 10 scale, where higher is better. Decimal scores are allowed.
3. Judge correctness first, then completeness, relevance, reasoning quality,
   factual accuracy, fluency, and clarity.
4. Use the following unified scoring rubric:
   - 9 to 10: The answer is strong and complete. It directly answers the
     question, is factually correct, well-structured, fluent, and covers the
     important aspects with appropriate depth.
   - 7 to 8: The answer is mostly correct and useful, but has some limitations,
     such as missing depth, incomplete coverage of important aspects, minor
     ambiguity, or weaker explanation.
   - 5 to 6: The answer is partially useful but has noticeable problems, such as
     factual mistakes, reasoning gaps, grammar or fluency issues, unclear
     wording, or missing key information.
   - 4 to 5: The answer has major problems. It may contain obvious errors, poor
     structure, substantial omissions, or frequent grammar/clarity issues, while
     still retaining some connection to the question.
   - 2 to 3: The answer is very poor. It may be truncated, self-repeating,
     incoherent, largely irrelevant, or unable to provide a usable response.
   - 0 to 1: The answer is almost unusable or malformed. It does not meaningfully
     answer the question, is nonsensical, empty, or fails to form a coherent
     answer.
5. Do not reward candidate ids, style, verbosity, or politeness by themselves.
6. Penalize hallucinated facts, contradictions, unsupported claims, severe
   repetition, truncation, and answers that fail to address the actual question.
7. The `scores` field must include every candidate exactly once, with no missing
   candidates and no extra names.
8. Equal scores are allowed when candidates are truly tied.
9. Output valid JSON only, matching this schema:
{
  "scores": {
    "candidate_1": 8.4,
    "candidate_2": 6.1
  },
  "reason": "short explanation"
}

Total candidates: {num_candidates}
Candidate ids that MUST all appear exactly once in `scores`:
{candidate_ids}

Question:
{question}

Candidates:
{candidate_answers}"""

CRITIC_SYSTEM = "You are a strict grading assistant. Return exactly one JSON object and nothing else."

# not printed in the paper: written from its description of the critic (a non-exhaustive reference answer; examples
# that cannot be judged are skipped in the denominator)
CRITIC_TEMPLATE = """Decide whether the candidate answer to the question below should be considered correct.

Rules:
1. The reference answer is one acceptable answer, not the only one. A candidate that
   differs in wording, structure or detail but is factually consistent with the
   reference and answers the question is correct.
2. The candidate is incorrect if it contradicts the reference on an essential point,
   states wrong facts, fails to address the question, or is empty, truncated or
   incoherent.
3. Use "not_judgeable" only when the reference does not allow a decision, for
   example an open-ended creative request where the reference is just one of many
   valid answers and the candidate is a reasonable different one.
4. Output valid JSON only, matching this schema:
{
  "verdict": "correct",
  "reason": "short explanation"
}
where "verdict" is one of "correct", "incorrect", "not_judgeable".

Question:
{question}

Reference answer:
{reference}

Candidate answer:
{answer}"""

CRITIC_VERDICTS = ("correct", "incorrect", "not_judgeable")

_PLACEHOLDER = re.compile(r"\{(num_candidates|candidate_ids|question|candidate_answers|reference|answer)\}")


class ReplyError(ValueError):
    """A judge reply that cannot be used; the message says why (it is shown to the judge when re-asking)."""


def _fill(template: str, **values: str) -> str:
    # one pass over the template, so a question or answer that contains "{question}" is never substituted again
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def candidate_ids(n: int) -> list[str]:
    """The anonymous ids the paper's prompt uses: ``candidate_1`` ... ``candidate_n``."""
    return [f"candidate_{i}" for i in range(1, n + 1)]


def ranking_messages(question: str, answers: list[str]) -> list[dict]:
    """Chat messages asking for scores of `answers` (already shuffled), shown as candidate_1 ... candidate_n."""
    ids = candidate_ids(len(answers))
    blocks = "\n\n".join(f"[{cid}]\n{answer}" for cid, answer in zip(ids, answers))
    user = _fill(RANKING_TEMPLATE, num_candidates=str(len(ids)), candidate_ids=", ".join(ids), question=question,
                 candidate_answers=blocks)
    return [{"role": "system", "content": RANKING_SYSTEM}, {"role": "user", "content": user}]


def critic_messages(question: str, answer: str, reference: str) -> list[dict]:
    """Chat messages asking whether `answer` is correct against the non-exhaustive `reference`."""
    user = _fill(CRITIC_TEMPLATE, question=question, reference=reference, answer=answer)
    return [{"role": "system", "content": CRITIC_SYSTEM}, {"role": "user", "content": user}]


def reask_message(reason: str) -> dict:
    """The user turn appended after an unusable reply: greedy judges repeat themselves unless told what was wrong."""
    return {"role": "user", "content": f"Your previous reply could not be used: {reason}. Reply again with exactly "
                                       "one JSON object that follows the schema, and nothing else."}


def _reject_constant(name: str):
    raise ReplyError(f"{name} is not a valid JSON number")


def _no_duplicates(pairs: list[tuple]) -> dict:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ReplyError(f"duplicate keys {dup} in the JSON object")
    return dict(pairs)


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)


def extract_json_object(text: str) -> dict:
    """The one JSON object in `text`, which may sit inside prose or a code fence.

    Every ``{`` outside a decoded object must start a complete object: a truncated or malformed one (even with a
    valid object nested inside it) is an error, and so are zero or several top-level objects.
    """
    if not isinstance(text, str):
        raise ReplyError(f"the reply is {type(text).__name__}, not text")
    found, pos = [], text.find("{")
    while pos != -1:
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ReplyError(f"malformed or truncated JSON object at character {pos}: {e.msg}") from None
        found.append(obj)
        pos = text.find("{", end)
    if not found:
        raise ReplyError("no JSON object in the reply")
    if len(found) > 1:
        raise ReplyError(f"{len(found)} JSON objects in the reply, expected exactly one")
    return found[0]


def _check_fields(obj: dict, required: str) -> None:
    if required not in obj:
        raise ReplyError(f"the JSON object has no {required!r} field")
    extra = sorted(set(obj) - {required, "reason"})
    if extra:
        raise ReplyError(f"unexpected fields {extra} in the JSON object (allowed: {required!r}, 'reason')")
    if "reason" in obj and not isinstance(obj["reason"], str):
        raise ReplyError("'reason' must be a string")


def parse_scores(text: str, ids: list[str]) -> tuple[dict[str, float], str]:
    """(candidate id -> score in [0, 10], reason) from a ranking reply; every id exactly once, nothing else."""
    obj = extract_json_object(text)
    _check_fields(obj, "scores")
    scores = obj["scores"]
    if not isinstance(scores, dict):
        raise ReplyError("'scores' must be a JSON object mapping candidate ids to numbers")
    missing, extra = [i for i in ids if i not in scores], sorted(set(scores) - set(ids))
    if missing or extra:
        raise ReplyError(f"'scores' must have exactly the ids {ids}: missing {missing}, unexpected {extra}")
    out = {}
    for cid in ids:
        v = scores[cid]
        # bool is an int subclass: true/false are not scores
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ReplyError(f"the score of {cid} is {json.dumps(v)}, not a number")
        if not 0 <= v <= 10:
            raise ReplyError(f"the score of {cid} is {v}, outside the 0 to 10 scale")
        out[cid] = float(v)
    return out, obj.get("reason", "")


def parse_verdict(text: str) -> tuple[str, str]:
    """(verdict, reason) from a critic reply; the verdict is one of `CRITIC_VERDICTS`."""
    obj = extract_json_object(text)
    _check_fields(obj, "verdict")
    verdict = obj["verdict"]
    if verdict not in CRITIC_VERDICTS:
        raise ReplyError(f"'verdict' is {json.dumps(verdict)}, expected one of {list(CRITIC_VERDICTS)}")
    return verdict, obj.get("reason", "")
