"""Learn2PD (arXiv 2509.25188) as a policy of the common loop, and the L2P-Hidden diagnostic.

At each step the block's confidences, committed positions included, go through the filter trained for that block
size; every active slot with ``sigmoid(logit) > threshold`` is committed, **plus** the backbone's scheduled rule
(LLaDA's schedule: the scheduled top-k by confidence, on Dream by neg-entropy; steps = gen_length by default,
so one per step). Thresholds: 0.96 for the LLaDA family, 0.9 for Dream (upstream's).

End-of-Text Prediction (EoTP), upstream's ``generate_l2p_eot``: if the filter accepts the end token at an active
slot, the row is truncated after the first such slot; otherwise, if any masked position of the canvas proposes the
end token, after the most confident of them. Truncation ``x = x[:, :pos + 1]`` is a key mask over the cut tail
(`tracelock.decode.canvas.truncate_after`), so later forwards see the shorter canvas; the tail reads as end/pad
tokens. Committed positions after the cut are dropped too, so a recorded trace shows them as committed end tokens.

Deployment at another width (the paper's generalisation table): a region that is a multiple of the filter's block
is scored chunk by chunk (block 64 with a block-32 filter: two chunks). ``filter_block`` picks the filter trained for
that block instead of the region's own. Upstream's filter would crash on a block shortened by a truncation; here the
positions past the cut feed zeros.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .base import Policy, StepInput, held_ends
from .llada import ConfidencePolicy

__all__ = ["L2PHiddenPolicy", "L2PPolicy"]


def _load(filters, kind: str) -> dict:
    from tracelock.l2p.filter import L2PFilter, load_filters

    if isinstance(filters, L2PFilter):
        filters = {filters.config.block: filters}
    elif isinstance(filters, str | Path):
        filters = load_filters(filters, kind)
    if not isinstance(filters, dict) or not filters:
        raise TypeError(f"filters must be a `tracelock train-l2p` folder, an L2PFilter or a {{block: filter}} dict, "
                        f"got {type(filters).__name__}")
    for block, f in filters.items():
        if f.config.kind != kind:
            raise ValueError(f"the block-{block} filter reads {f.config.kind} inputs but this policy feeds {kind}; "
                             f"use the {'l2p-hidden' if f.config.kind == 'hidden' else 'l2p'} policy")
    families = {f.config.family for f in filters.values()}
    if len(families) != 1:
        raise ValueError(f"the filters come from backbones of different families {sorted(families)}; load one "
                         "backbone's filters")
    return filters


class L2PPolicy(Policy):
    """Learn2PD: the filter's accepts plus the scheduled rule, with end-of-text truncation.

    Args:
        filters (str | Path | L2PFilter | dict): a `tracelock train-l2p` folder (one filter per block size), one
            filter, or ``{block: filter}``.
        threshold (float, optional): accept when ``sigmoid(logit) > threshold``. Default: 0.96 (LLaDA family), 0.9
            (Dream family), by the filters' backbone.
        steps (int, optional): the scheduled rule's total steps. Default: gen_length.
        filter_block (int, optional): use the filter trained for this block size (a divisor of the region width).
            Default: the filter of the region's own width.
        eotp (bool): end-of-text prediction and truncation. Default: True.
        hold_end (bool): not Learn2PD's: an end-of-text proposal with an active slot left of it that proposes text
            is held (`held_ends`, as ``threshold``'s ``hold_end``): the filter's accepts skip it, the scheduled rule
            ranks it last (``confidence``'s ``hold_end``), and end-of-text prediction cuts only at an end no masked
            text proposal lies left of (the region's and the lookahead's). Default: False.
        model (DiffusionBackbone, optional): when given, the filters' backbone is checked against it now.

    Examples::

        tokens, stats = tracelock.fused_generate(model, ids, policy=L2PPolicy("runs/l2p"), gen_length=256, block=32)
    """

    name = "l2p"
    deterministic = True
    learned = True
    kind = "confidence"

    def __init__(self, filters, threshold: float | None = None, steps: int | None = None,
                 filter_block: int | None = None, eotp: bool = True, hold_end: bool = False, model=None) -> None:
        super().__init__()
        from tracelock.l2p.filter import DEFAULT_THRESHOLD

        if not isinstance(hold_end, bool):
            raise TypeError(f"hold_end={hold_end!r} must be a bool (True: hold end-of-text behind the text)")
        self._filters = _load(filters, self.kind)
        family = next(iter(self._filters.values())).config.family
        threshold = DEFAULT_THRESHOLD.get(family, 0.9) if threshold is None else threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold < 1:
            raise ValueError(f"threshold={threshold!r} must lie in (0, 1); upstream uses 0.96 (LLaDA), 0.9 (Dream)")
        if filter_block is not None and filter_block not in self._filters:
            raise ValueError(f"filter_block={filter_block} has no filter; trained blocks: {sorted(self._filters)}")
        if model is not None:
            self._check_backbone(model)
        self.threshold, self.filter_block, self.eotp, self.family = float(threshold), filter_block, bool(eotp), family
        self.hold_end = hold_end
        self.eot_lookahead = self.eotp
        # upstream: the LLaDA schedule (exactly one per step at steps = gen_length), ranked by neg-entropy on Dream
        self._base = ConfidencePolicy(steps, score="neg_entropy" if family == "dream" else "confidence",
                                      hold_end=hold_end)
        self._eos = next(iter(self._filters.values())).config.eos_id
        if self.eotp and self._eos is None:
            raise ValueError("these filters record no end token (eos_id), which end-of-text prediction needs; "
                             "retrain them with `tracelock train-l2p` or pass eotp=False")

    def _check_backbone(self, model) -> None:
        from tracelock.features import backbone_fingerprint, backbone_mismatch

        got = backbone_fingerprint(model)
        for block, f in self._filters.items():
            why = backbone_mismatch(f.config.backbone, got) if f.config.backbone else None
            if why is not None:
                raise ValueError(f"the block-{block} filter was trained on {why}; train filters for this backbone "
                                 "with `tracelock train-l2p`")

    def setup(self, *, gen_length: int, num_regions: int) -> None:
        super().setup(gen_length=gen_length, num_regions=num_regions)
        self._base.setup(gen_length=gen_length, num_regions=num_regions)
        self._steps_per_region = self._base.steps_per_region()

    def _filter_for(self, width: int):
        block = self.filter_block or width
        f = self._filters.get(block)
        if f is None or width % block:
            raise ValueError(f"no Learn2PD filter for a {width}-wide region (trained blocks: {sorted(self._filters)}); "
                             f"train one with `tracelock train-l2p --block {width}` or pass filter_block=N for a "
                             f"trained N that divides {width}")
        return f

    def filter_inputs(self, inp: StepInput) -> torch.Tensor:
        """[B, R] the slots' confidences (committed positions included)."""
        return inp.signals.confidence

    def filter_logits(self, inp: StepInput) -> torch.Tensor:
        """[B, R] the filter's logits, chunk by chunk of its block."""
        x = self.filter_inputs(inp)
        if self.eotp and inp.attention_mask is not None and inp.positions is not None:
            # positions cut off by an earlier truncation are gone upstream: they feed zeros
            kept = inp.attention_mask.gather(1, inp.positions)
            x = x * kept.reshape(kept.shape + (1,) * (x.dim() - 2)).to(x.dtype)
        B, R = x.shape[:2]
        f = self._filter_for(R)
        dev = x.device
        if next(f.parameters()).device != dev:
            f.to(dev)
        w = f.config.block
        return f(x.reshape(B * (R // w), w, *x.shape[2:])).reshape(B, R)

    def accepts(self, inp: StepInput) -> torch.Tensor:
        """[B, R] the active slots the filter accepts (never a held end with ``hold_end``)."""
        active = inp.active & ~held_ends(inp) if self.hold_end else inp.active
        return active & (torch.sigmoid(self.filter_logits(inp)) > self.threshold)

    def decide(self, inp: StepInput, generator: torch.Generator | None = None):
        accepted = self.accepts(inp)
        chosen = accepted | self._base.select(inp, generator)
        return chosen, (self.end_cut(inp, accepted) if self.eotp else None)

    def select(self, inp: StepInput, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.accepts(inp) | self._base.select(inp, generator)

    def end_cut(self, inp: StepInput, accepted: torch.Tensor) -> torch.Tensor:
        """[B] the last canvas position each row keeps (L: no cut). The filter's first accepted end token wins;
        else the most confident masked position proposing it (the region's and the lookahead's), ties to the left;
        with ``hold_end`` only one no masked text proposal lies left of."""
        if inp.positions is None or inp.state is None:
            raise ValueError("end-of-text prediction needs StepInput.positions and state; run the policy through "
                             "fused_generate / reference_generate")
        L = inp.state.shape[1]
        pos, active, sig = inp.positions, inp.active, inp.signals
        if inp.lookahead is not None:
            pos = torch.cat([pos, inp.lookahead.positions], 1)
            active = torch.cat([active, inp.lookahead.active], 1)
            proposal = torch.cat([sig.proposal, inp.lookahead.signals.proposal], 1)
            conf = torch.cat([sig.confidence, inp.lookahead.signals.confidence], 1)
            eos_prob = torch.cat([sig.eos_prob, inp.lookahead.signals.eos_prob], 1)
        else:
            proposal, conf, eos_prob = sig.proposal, sig.confidence, sig.eos_prob
        R = accepted.shape[1]
        accepted_end = accepted & (sig.proposal == self._eos)
        first = pos[:, :R].gather(1, accepted_end.to(torch.uint8).argmax(1, keepdim=True)).squeeze(1)
        masked_end = active & (proposal == self._eos)
        if self.hold_end:  # `held_ends` over the region and the lookahead, both in position order
            text = active & ~((eos_prob >= conf) & (eos_prob > 0))
            masked_end &= text.cumsum(1) == 0
        best = pos.gather(1, torch.where(masked_end, conf.float(), -torch.inf).argmax(1, keepdim=True)).squeeze(1)
        none = torch.full_like(first, L)
        return torch.where(accepted_end.any(1), first, torch.where(masked_end.any(1), best, none))


class L2PHiddenPolicy(L2PPolicy):
    """The paper's L2P-Hidden diagnostic: Learn2PD's blockwise filter and rule, fed each slot's hidden-state codes
    (a `tracelock.features.TapEncoder` over its three taps) instead of its confidence.

    Args:
        filters: a `tracelock train-l2p --input hidden` folder (its encoder is read from the same folder), or
            filters with ``encoder``.
        encoder (TapEncoder | str | Path, optional): the encoder the filters were trained with. Default: the
            filters' folder.
        Others as `L2PPolicy`.
    """

    name = "l2p-hidden"
    needs_taps = True
    kind = "hidden"

    def __init__(self, filters, encoder=None, threshold: float | None = None, steps: int | None = None,
                 filter_block: int | None = None, eotp: bool = True, hold_end: bool = False, model=None) -> None:
        from tracelock.features import load_encoder

        super().__init__(filters, threshold=threshold, steps=steps, filter_block=filter_block, eotp=eotp,
                         hold_end=hold_end, model=model)
        if encoder is None:
            if not isinstance(filters, str | Path):
                raise ValueError("encoder is required with filter objects: pass the TapEncoder they were trained "
                                 "with (a `train-l2p --input hidden` folder holds both)")
            encoder = filters
        self._encoder = load_encoder(encoder, model=model) if isinstance(encoder, str | Path) else encoder
        self._device = None
        widths = {f.config.features for f in self._filters.values()}
        if widths != {self._encoder.code_dim}:
            raise ValueError(f"the filters read {sorted(widths)} features per position but the encoder writes "
                             f"{self._encoder.code_dim}; pass the encoder they were trained with")

    def filter_inputs(self, inp: StepInput) -> torch.Tensor:
        """[B, R, C] the slots' codes from their taps."""
        if inp.taps is None or inp.positions is None:
            raise ValueError("l2p-hidden needs StepInput.taps and positions (needs_taps = True); run it through "
                             "fused_generate / reference_generate")
        # padding slots past the region may lie past the taps' [0, T): their inputs are never committed
        where = inp.positions.clamp(max=inp.taps[0].shape[1] - 1)[..., None]
        h = [t.gather(1, where.expand(-1, -1, t.shape[-1])) for t in inp.taps]
        if self._device != h[0].device:
            self._encoder.to(h[0].device)
            self._device = h[0].device
        return self._encoder.codes(*h)
