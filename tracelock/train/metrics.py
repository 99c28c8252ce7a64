"""Held-out metrics of future-stability prediction (paper Table "Feature ablations"), in numpy.

Scores are margins ``m = a - tau`` (any monotone score works for AUROC and AP); labels are 1 (stable) / 0.
The commit decision is ``sigmoid(m) > 0.5``, i.e. ``m > 0``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["accuracy_at", "auroc", "average_precision", "f_beta", "stability_metrics"]


def _check(scores, labels):
    scores, labels = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(labels).ravel()
    if scores.shape != labels.shape:
        raise ValueError(f"scores ({scores.size}) and labels ({labels.size}) must have the same length")
    if not np.isin(labels, (0, 1)).all():
        raise ValueError("labels must be 0 or 1; drop unlabelled (-1) positions first")
    return scores, labels.astype(bool)


def auroc(scores, labels) -> float:
    """Area under the ROC curve: P(score of a random positive > a random negative), ties counted 1/2.

    Computed as the Mann-Whitney U statistic with average ranks for tied scores. NaN when a class is empty.
    """
    s, y = _check(scores, labels)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    ranks = np.empty(len(s))
    # average rank (1-based) over each run of equal scores
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    for a, b in zip(starts, ends):
        ranks[order[a:b]] = (a + 1 + b) / 2
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def average_precision(scores, labels) -> float:
    """Average precision: sum over distinct thresholds (descending) of ``(R_k - R_{k-1}) * P_k``.

    All positions with equal score enter at the same threshold (the step-wise definition of scikit-learn's
    ``average_precision_score``, no interpolation). NaN without positives.
    """
    s, y = _check(scores, labels)
    n_pos = int(y.sum())
    if n_pos == 0:
        return float("nan")
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    # the last index of each run of equal scores is where that threshold's counts are read
    last = np.flatnonzero(np.r_[s[1:] != s[:-1], True])
    tp = np.cumsum(y)[last]
    precision = tp / (last + 1)
    recall = tp / n_pos
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def accuracy_at(scores, labels, threshold: float = 0.0) -> float:
    """Fraction of positions where ``score > threshold`` equals the label (Acc@0.5 is margin > 0)."""
    s, y = _check(scores, labels)
    return float(np.mean((s > threshold) == y)) if len(s) else float("nan")


def f_beta(scores, labels, beta: float = 0.5, threshold: float = 0.0) -> float:
    """F-beta of the commit decision ``score > threshold`` with "stable" as the positive class.

    ``F = (1 + b^2) P R / (b^2 P + R)``; beta = 0.5 weighs precision (a wrong commit is never revised) four times
    as much as recall. 0 when nothing is committed or nothing is stable (precision or recall undefined or 0).
    """
    s, y = _check(scores, labels)
    pred = s > threshold
    tp = int((pred & y).sum())
    if tp == 0:
        return 0.0
    precision, recall = tp / int(pred.sum()), tp / int(y.sum())
    b2 = beta * beta
    return float((1 + b2) * precision * recall / (b2 * precision + recall))


def stability_metrics(scores, labels) -> dict:
    """AUROC, AP, Acc@0.5 and F0.5 of margins ``scores`` against stability ``labels``, plus the counts."""
    s, y = _check(scores, labels)
    return dict(auroc=auroc(s, y), ap=average_precision(s, y), acc_at_0_5=accuracy_at(s, y), f0_5=f_beta(s, y),
                positions=int(len(s)), positive_rate=float(y.mean()) if len(y) else float("nan"))
