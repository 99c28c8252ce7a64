"""Two feature caches as one training set, mixed at a ratio: self-training's ``alpha D_self + (1 - alpha) D_pre``.

Each cache is split by trace on its own (`FeatureCache.split`). The training items are every training item of the
original pool plus the self-training pool's training items cycled (or cut) to ``round(alpha / (1 - alpha) n_pre)``
items, so a uniformly drawn training item comes from the new pool with probability ``alpha``; the old pool is kept
whole. Validation is both pools' held-out items, unweighted.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MixedCache", "mixed_counts"]


def mixed_counts(n_pre: int, n_self: int, alpha: float) -> int:
    """Training items drawn from the self-training pool so that they are an ``alpha`` share of the mix."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must lie in (0, 1): the self-training share of the training mix")
    if n_pre < 1 or n_self < 1:
        raise ValueError(f"both pools need training items (original {n_pre}, self-training {n_self}); collect more "
                         "traces or lower the validation fraction")
    return max(1, round(alpha / (1 - alpha) * n_pre))


class MixedCache:
    """The feature-cache item API (``len``, ``[i]``, ``split``, ``code_dim``, ``groups``, ``index``) over the original
    pool ``pre`` and the self-training pool ``new``, mixed at ``alpha`` once :meth:`split` has run.

    Both caches must hold codes of the same encoder (their indexes' digests agree).
    """

    def __init__(self, pre, new, alpha: float):
        digests = [(getattr(c, "index", None) or {}).get("encoder", {}).get("digest") for c in (pre, new)]
        if digests[0] != digests[1]:
            raise ValueError("the two caches were written by different encoders; featurize the self-training traces "
                             "with the original cache's encoder (the controller's run folder holds it)")
        if pre.code_dim != new.code_dim or pre.groups != new.groups:
            raise ValueError(f"the caches' codes differ ({pre.code_dim} vs {new.code_dim} wide); use one encoder")
        mixed_counts(1, 1, alpha)
        self.pre, self.new, self.alpha = pre, new, float(alpha)
        self.code_dim, self.groups, self.index = pre.code_dim, pre.groups, getattr(pre, "index", None)
        self._items = None

    def split(self, fraction: float, seed: int = 0) -> tuple:
        """(train, val) indices of the mix (and the mix itself, built here)."""
        pre_train, pre_val = self.pre.split(fraction, seed)
        new_train, new_val = self.new.split(fraction, seed)
        n_new = mixed_counts(len(pre_train), len(new_train), self.alpha)
        cycled = new_train[np.arange(n_new) % len(new_train)]
        train = [(0, int(i)) for i in pre_train] + [(1, int(i)) for i in cycled]
        val = [(0, int(i)) for i in pre_val] + [(1, int(i)) for i in new_val]
        self._items = train + val
        return np.arange(len(train)), np.arange(len(train), len(self._items))

    def _mix(self) -> list:
        if self._items is None:
            raise RuntimeError("call MixedCache.split(...) first: it builds the mix")
        return self._items

    def __len__(self) -> int:
        return len(self._mix())

    def __getitem__(self, i: int) -> dict:
        source, j = self._mix()[i]
        return (self.pre if source == 0 else self.new)[j]
