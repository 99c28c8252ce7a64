"""QA judging: within-prompt batch ranking of the systems' answers, and the critic rate against references.

`rank_systems` shows the judge, for each prompt, every system's answer at once, anonymised as candidate_1 ...
candidate_n in an order shuffled by a seeded RNG (the mapping back is kept), with the paper's prompt. The judge
scores them 0-10; the scores become ranks (1 = best):

* **average rank** uses fractional ranking (tied candidates share the mean of the places they span: scores
  9, 9, 5 -> ranks 1.5, 1.5, 3), so every prompt's ranks sum to n(n+1)/2. The paper's LLaDA QA rows sum to
  15.00 +- 0.01 over five systems, which competition ranking with any tie would push below 15.
* **top-two rate**: a candidate is in the prompt's top-two group when at most one candidate scored strictly
  higher (scores 8, 6, 6, 6 put all four there). The paper's top-two rates sum to 204-234% over five systems,
  above the 200% that a group of exactly two allows, so ties widen the group.

`critic_rate` asks whether each answer is correct against a non-exhaustive reference; not_judgeable verdicts are
skipped in the denominator, as in the paper. Rates are fractions in [0, 1] (the paper prints percentages).

An unusable reply (see `judge_prompts`) is recorded with its raw text and reason and the judge is re-asked, with
the reason, up to `retries` times; after that the prompt is recorded as unjudged and left out of every average,
never scored. Transport failures (after the backend's own retries) raise: they say nothing about the answers.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from tracelock.eval.judge_prompts import (
    ReplyError,
    candidate_ids,
    critic_messages,
    parse_scores,
    parse_verdict,
    ranking_messages,
    reask_message,
)

__all__ = [
    "CriticItem",
    "CriticResult",
    "Judge",
    "PromptRanking",
    "RankingResult",
    "UnusableReply",
    "critic_rate",
    "fractional_ranks",
    "rank_systems",
    "top_two_group",
]


class Judge(Protocol):
    """Anything that answers a chat: `HTTPJudge`, `LocalJudge`, or your own."""

    def complete(self, messages: list[dict]) -> str: ...


@dataclass
class UnusableReply:
    """One judge reply that could not be used: the attempt it came from (0 = first ask), its text, and why."""

    attempt: int
    raw: str
    reason: str


@dataclass
class PromptRanking:
    """One prompt's judgement. `order[k]` is the system shown as candidate_{k+1}; score/rank/top-two maps are
    keyed by system name and empty when the prompt is unjudged."""

    index: int
    order: list[str]
    judged: bool
    scores: dict[str, float] = field(default_factory=dict)
    ranks: dict[str, float] = field(default_factory=dict)
    top_two: dict[str, bool] = field(default_factory=dict)
    reason: str = ""
    unusable: list[UnusableReply] = field(default_factory=list)


@dataclass
class RankingResult:
    systems: list[str]
    prompts: list[PromptRanking]
    seed: int

    @property
    def judged(self) -> list[PromptRanking]:
        return [p for p in self.prompts if p.judged]

    @property
    def unjudged(self) -> list[int]:
        """Indices of prompts the judge never answered usably; they are in no average."""
        return [p.index for p in self.prompts if not p.judged]

    @property
    def n_unusable_replies(self) -> int:
        return sum(len(p.unusable) for p in self.prompts)

    def average_rank(self) -> dict[str, float | None]:
        """System -> mean fractional rank over judged prompts (lower is better); None when none was judged."""
        done = self.judged
        return {s: sum(p.ranks[s] for p in done) / len(done) if done else None for s in self.systems}

    def top_two_rate(self) -> dict[str, float | None]:
        """System -> fraction of judged prompts that put it in the top-two group; None when none was judged."""
        done = self.judged
        return {s: sum(p.top_two[s] for p in done) / len(done) if done else None for s in self.systems}

    def to_dict(self) -> dict:
        return {
            "systems": self.systems,
            "seed": self.seed,
            "n_prompts": len(self.prompts),
            "n_judged": len(self.judged),
            "n_unjudged": len(self.unjudged),
            "unjudged": self.unjudged,
            "n_unusable_replies": self.n_unusable_replies,
            "average_rank": self.average_rank(),
            "top_two_rate": self.top_two_rate(),
            "prompts": [asdict(p) for p in self.prompts],
        }


@dataclass
class CriticItem:
    """One answer's verdict (None when unjudged) with the judge's reason and any unusable replies."""

    index: int
    verdict: str | None
    reason: str = ""
    unusable: list[UnusableReply] = field(default_factory=list)


@dataclass
class CriticResult:
    items: list[CriticItem]

    def count(self, verdict: str | None) -> int:
        return sum(item.verdict == verdict for item in self.items)

    @property
    def rate(self) -> float | None:
        """correct / (correct + incorrect): not_judgeable and unjudged items are outside the denominator."""
        correct, incorrect = self.count("correct"), self.count("incorrect")
        return correct / (correct + incorrect) if correct + incorrect else None

    def to_dict(self) -> dict:
        return {
            "rate": self.rate,
            "n_items": len(self.items),
            "n_correct": self.count("correct"),
            "n_incorrect": self.count("incorrect"),
            "n_not_judgeable": self.count("not_judgeable"),
            "n_unjudged": self.count(None),
            "unjudged": [item.index for item in self.items if item.verdict is None],
            "n_unusable_replies": sum(len(item.unusable) for item in self.items),
            "items": [asdict(item) for item in self.items],
        }


def fractional_ranks(scores: dict[str, float]) -> dict[str, float]:
    """Key -> rank by descending score (1 = best); ties share the mean of their places (9, 9, 5 -> 1.5, 1.5, 3)."""
    ordered = sorted(scores.values(), reverse=True)
    # the places a score spans are first+1 .. first+count (1-based)
    return {k: ordered.index(v) + (ordered.count(v) + 1) / 2 for k, v in scores.items()}


def top_two_group(scores: dict[str, float]) -> dict[str, bool]:
    """Key -> whether at most one other key scored strictly higher (ties at second place all join the group)."""
    return {k: sum(o > v for o in scores.values()) <= 1 for k, v in scores.items()}


def _ask(judge: Judge, messages: list[dict], parse: Callable[[str], tuple], retries: int):
    """(parsed value or None, unusable replies): ask, then re-ask with the reason up to `retries` times."""
    unusable = []
    for attempt in range(retries + 1):
        raw = judge.complete(messages)
        try:
            return parse(raw), unusable
        except ReplyError as e:
            unusable.append(UnusableReply(attempt, raw, str(e)))
            messages = [*messages, {"role": "assistant", "content": raw}, reask_message(str(e))]
    return None, unusable


def _check_texts(name: str, texts, n: int | None = None) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{name} must be a list of strings, got {type(texts).__name__}")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise TypeError(f"{name} must hold strings only; items {bad[:5]} are not (decode answers to text first)")
    if n is not None and len(texts) != n:
        raise ValueError(f"{name} has {len(texts)} items but there are {n} prompts; pass one per prompt")
    return list(texts)


def _check_retries(retries: int) -> None:
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0 (re-asks after an unusable reply), got {retries!r}")


def rank_systems(judge: Judge, prompts: Sequence[str], answers_by_system: dict[str, Sequence[str]], seed: int = 0,
                 *, retries: int = 2) -> RankingResult:
    """Rank the systems' answers within each prompt with the paper's batch-ranking prompt.

    Args:
        judge (Judge): the backend (`complete(messages) -> str`).
        prompts (list[str]): the questions, [N].
        answers_by_system (dict[str, list[str]]): system name -> its answers, [N] each; at least two systems.
            Names never reach the judge.
        seed (int): seeds the per-prompt candidate order (prompt i uses its own RNG, so a subset of prompts keeps
            its order). Default: 0.
        retries (int): re-asks after an unusable reply before the prompt is recorded as unjudged. Default: 2.

    Returns:
        RankingResult: per-prompt scores, fractional ranks and top-two membership, unjudged prompts and every
        unusable reply; `average_rank()`, `top_two_rate()` and `to_dict()` summarise it.
    """
    prompts = _check_texts("prompts", prompts)
    if not isinstance(answers_by_system, dict) or len(answers_by_system) < 2:
        raise ValueError("answers_by_system must be a dict of at least two systems (name -> answers): ranking "
                         "compares the systems' answers for the same prompt")
    if not all(isinstance(s, str) for s in answers_by_system):
        raise TypeError(f"answers_by_system's keys must be system names (str), got {list(answers_by_system)}")
    answers = {s: _check_texts(f"answers_by_system[{s!r}]", a, len(prompts)) for s, a in answers_by_system.items()}
    _check_retries(retries)
    systems = list(answers)
    ids = candidate_ids(len(systems))
    rankings = []
    for i, question in enumerate(prompts):
        order = list(systems)
        # a str seed is hashed with SHA-512 by random.seed, so the order is the same in every process
        random.Random(f"tracelock-judge:{seed}:{i}").shuffle(order)
        messages = ranking_messages(question, [answers[s][i] for s in order])
        parsed, unusable = _ask(judge, messages, lambda raw: parse_scores(raw, ids), retries)
        if parsed is None:
            rankings.append(PromptRanking(i, order, judged=False, unusable=unusable))
            continue
        by_id, reason = parsed
        scores = {s: by_id[cid] for cid, s in zip(ids, order)}
        rankings.append(PromptRanking(i, order, True, scores, fractional_ranks(scores), top_two_group(scores),
                                      reason, unusable))
    return RankingResult(systems, rankings, seed)


def critic_rate(judge: Judge, prompts: Sequence[str], answers: Sequence[str], references: Sequence[str], *,
                retries: int = 2) -> CriticResult:
    """Judge each answer against its reference answer (correct / incorrect / not_judgeable).

    Args:
        judge (Judge): the backend.
        prompts (list[str]): the questions, [N].
        answers (list[str]): one system's answers, [N].
        references (list[str]): the reference answers (e.g. Alpaca's output), [N]; leave out items without one.
        retries (int): re-asks after an unusable reply before the item is recorded as unjudged. Default: 2.

    Returns:
        CriticResult: per-item verdicts; `.rate` is correct / (correct + incorrect).
    """
    prompts = _check_texts("prompts", prompts)
    answers = _check_texts("answers", answers, len(prompts))
    references = _check_texts("references", references, len(prompts))
    empty = [i for i, r in enumerate(references) if not r.strip()]
    if empty:
        raise ValueError(f"references {empty[:5]} are empty; leave items without a reference out of the critic")
    _check_retries(retries)
    items = []
    for i, (question, answer, reference) in enumerate(zip(prompts, answers, references)):
        parsed, unusable = _ask(judge, critic_messages(question, answer, reference), parse_verdict, retries)
        verdict, reason = parsed if parsed is not None else (None, "")
        items.append(CriticItem(i, verdict, reason, unusable))
    return CriticResult(items)
