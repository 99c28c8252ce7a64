"""PC-Sampler (arXiv 2508.13021; NEUIR/PC-Sampler, MIT): LLaDA's schedule with a position- and frequency-aware order,
so early positions and informative (rare) tokens go first.

Written from the rule as its code computes it (``generate_with_pc_sampler``): each step commits LLaDA's scheduled
count of masked slots of the region, the highest by ``exp(-lambd j) min(-p log(f_bg(x) + 1e-9), alpha)``, with ``j``
the slot's offset in the region, ``p`` the proposal's probability and ``f_bg`` the proposal's frequency in a
background corpus (tokens absent from it count ``1 / num_token``). No state beyond the table.

The table is PC-Sampler's own file format, ``{"num_token": N, "p_baseline_dict": {token_id: count}}`` (its
``reference_corpus_llada.json`` for LLaDA); each bundled model ships one counted from its training text
(``background="testbed"`` / ``"testbed-dream"``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .base import Policy, StepInput, check_flags, check_steps, first_token_form, held_ends, split_steps, topk_mask
from .llada import llada_schedule_k

__all__ = ["PCSamplerPolicy", "load_background"]

# the bundled models' tables, by the name `tracelock.load_model` takes
_BUNDLED = {"testbed": "model", "testbed-dream": "model-dream"}


def background_path(background: str) -> Path:
    """The table's file: a bundled model's name, or a path."""
    if background in _BUNDLED:
        return Path(__file__).resolve().parents[1] / "testbed" / _BUNDLED[background] / "background.json"
    return Path(background)


def load_background(background: str) -> tuple[dict, int]:
    """({token id: count}, num_token) of a PC-Sampler background table, checked; errors name the argument."""
    path = background_path(background)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"background={background!r}: no such file; pass a PC-Sampler table (JSON "
                         '{"num_token": N, "p_baseline_dict": {token_id: count}}) or a bundled model\'s name '
                         f"({', '.join(_BUNDLED)})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"background={background!r} is not a readable JSON table ({e})") from None
    try:
        total = int(raw["num_token"])
        counts = {int(k): float(v) for k, v in raw["p_baseline_dict"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(f"background={background!r} is not a PC-Sampler table: it needs the keys num_token and "
                         "p_baseline_dict ({token_id: count})") from None
    if total <= 0 or any(k < 0 or v < 0 for k, v in counts.items()):
        raise ValueError(f"background={background!r}: num_token must be > 0 and ids and counts >= 0")
    return counts, total


class PCSamplerPolicy(Policy):
    """LLaDA's scheduled count per step, ordered by ``exp(-lambd j) min(-p log f_bg(x), alpha)``.

    Args:
        background (str): the background table: a path to PC-Sampler's JSON format or a bundled model's name.
        lambd (float): the position decay, >= 0 (authors: 0.25). Default: 0.25.
        alpha (float): the cap on the frequency term, > 0 (authors: 10). Default: 10.0.
        steps (int, optional): total steps, a multiple of the region count (LLaDA's schedule). Default:
            gen_length (the authors' ``steps = gen_length``).
        first_token (bool): the Dream form: a region's first step commits its first masked position only. Default:
            False.
        hold_end (bool): an end-of-text proposal commits only once no active slot left of it proposes text (held
            slots rank last; the count stays). Default: False.
    """

    name = "pc"
    deterministic = True

    def __init__(self, background: str, lambd: float = 0.25, alpha: float = 10.0, steps: int | None = None,
                 first_token: bool = False, hold_end: bool = False) -> None:
        super().__init__()
        if not isinstance(background, str) or not background:
            raise TypeError(f"background={background!r} must be a path or a bundled model's name")
        for name, value, ok, what in (("lambd", lambd, lambda v: v >= 0, ">= 0"),
                                      ("alpha", alpha, lambda v: v > 0, "> 0")):
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and ok(value)):
                raise ValueError(f"{name}={value!r} must be a finite number {what} (the authors use lambd=0.25, "
                                 "alpha=10)")
        check_steps(steps)
        check_flags(first_token=first_token, hold_end=hold_end)
        self.background, self.lambd, self.alpha, self.steps = background, float(lambd), float(alpha), steps
        self.first_token, self.hold_end = first_token, hold_end
        self._counts, self._total = load_background(background)
        self._table = {}

    def setup(self, *, gen_length: int, num_regions: int) -> None:
        super().setup(gen_length=gen_length, num_regions=num_regions)
        self._steps_per_region = split_steps(self.steps, gen_length, num_regions)

    def frequencies(self, proposal: torch.Tensor) -> torch.Tensor:
        """f_bg of each proposed token (1 / num_token for ids the table lacks); the table is built once per device."""
        key = str(proposal.device)
        if key not in self._table:
            size = max(self._counts, default=0) + 1
            table = torch.full((size,), 1 / self._total, dtype=torch.float32)
            ids = list(self._counts)
            table[ids] = torch.tensor([self._counts[k] / self._total for k in ids], dtype=torch.float32)
            self._table[key] = table.to(proposal.device)
        table = self._table[key]
        inside = proposal < table.shape[0]
        return torch.where(inside, table[proposal.clamp(max=table.shape[0] - 1)], 1 / self._total)

    def scores(self, inp: StepInput) -> torch.Tensor:
        """[B, R] PC-Sampler's score of each slot's proposal."""
        proposal, p = inp.signals.proposal, inp.signals.confidence
        informative = (-p * torch.log(self.frequencies(proposal) + 1e-9)).clamp(max=self.alpha)
        j = torch.arange(proposal.shape[-1], device=proposal.device, dtype=torch.float32)
        return torch.exp(-self.lambd * j) * informative

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        score = self.scores(inp)
        if self.hold_end:
            score = torch.where(held_ends(inp), float("-inf"), score)
        chosen = topk_mask(score, inp.active, llada_schedule_k(inp, self.steps_per_region()))
        return first_token_form(inp, chosen) if self.first_token else chosen
