"""Record canonical traces while decoding: an observer for `fused_generate` that keeps tokens only.

The observer sees every step of every row (`tracelock.decode.loop.StepRecord`). From the states it derives the
step at which each generation position was committed (a position that is active at step t and not at step t + 1
was committed at step t, whether the policy chose it or stop-at-EOT filled it), and at the recorded steps it keeps
the proposals of the step's commit region. With ``fraction < 1`` a row's steps are sampled, the first and the last
always kept; the last step is only known once the row stops appearing, so the latest step is held provisionally.
"""

from __future__ import annotations

import numpy as np
import torch

from tracelock import states
from tracelock.decode.settings import DecodeSettings
from tracelock.generate import fused_generate
from tracelock.traces.trace import NO_PROPOSAL, Trace


class TraceRecorder:
    """Observer that turns one `fused_generate` batch into `Trace` objects.

    Args:
        spec (ModelSpec): the backbone's spec (mask and end tokens).
        prompts (list): the batch's prompts as token-id lists, in batch order (their lengths locate the left
            padding; the canvas is ``[pad | prompt | generation]``).
        gen_length (int): the run's generation length.
        fraction (float): share of each row's steps to record, in (0, 1]; first and last steps always. Default: 1.0.
        seed (int): seed of the step sampling. Default: 0.
        keep_confidence (bool): also keep the proposals' max-prob (fp16). Default: False.
        row_seeds (list[int], optional): one non-negative sampling seed per row, so a row samples the same steps
            whatever batch it lands in. Default: ``seed`` and the row index.

    Examples::

        rec = TraceRecorder(model.spec, prompts, gen_length=64)
        canvas, stats = fused_generate(model, prompts, policy="confidence", gen_length=64, block=8, observer=rec)
        traces = rec.traces(canvas)
    """

    def __init__(self, spec, prompts, gen_length: int, *, fraction: float = 1.0, seed: int = 0,
                 keep_confidence: bool = False, row_seeds=None):
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction={fraction!r} must lie in (0, 1]: the share of each row's steps to record")
        B = len(prompts)
        if B == 0:
            raise ValueError("prompts is empty; pass the batch's prompts as token-id lists")
        if row_seeds is not None and len(row_seeds) != B:
            raise ValueError(f"row_seeds has {len(row_seeds)} entries for {B} prompts; pass one per prompt")
        self.spec, self.gen_length, self.fraction, self.keep_confidence = spec, gen_length, fraction, keep_confidence
        self.prompt_lengths = [len(p) for p in prompts]
        self._commit = np.full((B, gen_length), -1, np.int32)
        self._final_state = np.zeros((B, gen_length), np.uint8)
        self._last_step = np.full(B, -1, np.int64)
        self._last_chosen = [None] * B
        self._records = [[] for _ in range(B)]  # (step, proposals [G], confidence [G] or None)
        self._pending = [None] * B  # the latest step when it was not sampled: kept only if it turns out last
        seeds = row_seeds if row_seeds is not None else [[seed, r] for r in range(B)]
        self._rngs = [np.random.default_rng(s) for s in seeds]

    def __call__(self, rec) -> None:
        G = self.gen_length
        P = rec.x.shape[1] - G
        rows, steps = rec.rows.tolist(), rec.step.tolist()
        gen_state = rec.state[:, P:].cpu().numpy()
        # slot values into [b, G] rows; inactive slots go to a spare column G that is dropped
        col = torch.where(rec.active, rec.positions - P, G)
        props = torch.full((len(rows), G + 1), NO_PROPOSAL, dtype=torch.int32, device=col.device)
        props = props.scatter(1, col, rec.signals.proposal.to(torch.int32))[:, :G].cpu().numpy()
        chosen = torch.zeros((len(rows), G + 1), dtype=torch.bool, device=col.device)
        chosen = chosen.scatter(1, col, rec.chosen & rec.active)[:, :G].cpu().numpy()
        conf = None
        if self.keep_confidence:
            conf = torch.full((len(rows), G + 1), float("nan"), dtype=torch.float16, device=col.device)
            conf = conf.scatter(1, col, rec.signals.confidence.to(torch.float16))[:, :G].cpu().numpy()
        for i, (r, t) in enumerate(zip(rows, steps)):
            if t != self._last_step[r] + 1:
                raise RuntimeError(f"row {r} jumped from step {self._last_step[r]} to {t}: a TraceRecorder must "
                                   "observe every step of one fresh decoding run")
            if t > 0:
                # committed at the previous step: chosen there, or filled after an end token (stop_at_eot)
                newly = (self._commit[r] < 0) & (gen_state[i] != states.ACTIVE)
                self._commit[r, newly] = t - 1
                self._final_state[r, newly] = gen_state[i, newly]
            entry = (t, props[i], None if conf is None else conf[i])
            keep = t == 0 or self.fraction >= 1 or self._rngs[r].random() < self.fraction
            if keep:
                self._records[r].append(entry)
            self._pending[r] = None if keep else entry
            self._last_step[r], self._last_chosen[r] = t, chosen[i]

    def traces(self, final_canvas, metas=None) -> list[Trace]:
        """One `Trace` per row, from the run's final canvas [B, P + G] and optional per-row meta dicts."""
        canvas = torch.as_tensor(final_canvas).cpu().numpy()
        B, G = len(self.prompt_lengths), self.gen_length
        if canvas.shape[0] != B or canvas.shape[1] < G:
            raise ValueError(f"final_canvas has shape {list(canvas.shape)}; expected [{B}, P + {G}] from the run "
                             "this recorder observed")
        if metas is not None and len(metas) != B:
            raise ValueError(f"metas has {len(metas)} entries for {B} rows; pass one dict per row")
        P = canvas.shape[1] - G
        end_ids = np.asarray(self.spec.end_ids, dtype=np.int64)
        out = []
        for r in range(B):
            last = int(self._last_step[r])
            if last < 0:
                raise RuntimeError(f"row {r} was never observed; pass the recorder as fused_generate(observer=...)")
            final = canvas[r, P:].astype(np.int32)
            commit, final_state = self._commit[r].copy(), self._final_state[r].copy()
            # positions still open were committed at the last step: an end token or a fill is EOT
            rest = commit < 0
            chosen_end = self._last_chosen[r] & np.isin(final, end_ids)
            commit[rest] = last
            final_state[rest] = np.where(~self._last_chosen[r] | chosen_end, states.EOT, states.LOCKED)[rest]
            records = self._records[r] + ([self._pending[r]] if self._pending[r] is not None else [])
            trace = Trace(
                prompt=canvas[r, P - self.prompt_lengths[r]:P].astype(np.int32), final=final,
                final_state=final_state, commit_step=commit,
                steps=np.array([s for s, _, _ in records], dtype=np.int32),
                proposals=np.stack([p for _, p, _ in records]).astype(np.int32),
                confidence=np.stack([c for _, _, c in records]) if self.keep_confidence else None,
                mask_id=int(self.spec.mask_id), num_steps=last + 1, meta=dict(metas[r]) if metas else {},
            )
            if not np.array_equal(trace.x_at(trace.num_steps)[len(trace.prompt):], final):
                raise RuntimeError(f"row {r}: the recorded commits do not rebuild the final canvas; the recorder "
                                   "missed steps (one recorder per run)")
            out.append(trace)
        return out


class Recording:
    """One decode setting that records traces: its settings and its policy, built once (a learned policy reads its
    controller or filters from disk here), then `run` on each batch of prompts (`collect` runs it per chunk)."""

    def __init__(self, model, *, policy="confidence", gen_length=64, block=None, window=None, policy_args=None,
                 fraction=1.0, seed=0, keep_confidence=False, stop_at_eot=False):
        from tracelock.policies import resolve_policy

        built = resolve_policy(policy, policy_args, gen_length=gen_length, model=model)
        self.model, self.fraction, self.keep_confidence = model, fraction, keep_confidence
        self.settings = DecodeSettings(policy=built, gen_length=gen_length, block=block, window=window,
                                       stop_at_eot=stop_at_eot, seed=seed)
        # what each trace's meta says of its decode
        self.meta = dict(policy=policy if isinstance(policy, str) else repr(policy), policy_args=policy_args or {},
                         gen_length=gen_length, block=block, window=window, stop_at_eot=stop_at_eot,
                         fraction=fraction, seed=seed, family=model.spec.family)

    def run(self, prompts, *, batch_size=16, row_seeds=None, metas=None) -> list[Trace]:
        """Decode ``prompts`` (token-id lists) in batches and return one `Trace` per prompt, in order.

        Each trace's meta holds the decode settings, updated with ``metas[i]`` when given. ``row_seeds`` (one per
        prompt) pins each prompt's step sampling whatever batch it lands in (see `TraceRecorder`).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        for name, per_row in (("metas", metas), ("row_seeds", row_seeds)):
            if per_row is not None and len(per_row) != len(prompts):
                raise ValueError(f"{name} has {len(per_row)} entries for {len(prompts)} prompts; pass one per "
                                 "prompt")
        seed, out = self.settings.seed, []
        for start in range(0, len(prompts), batch_size):
            idx = range(start, min(start + batch_size, len(prompts)))
            batch = [prompts[i] for i in idx]
            seeds = [row_seeds[i] for i in idx] if row_seeds is not None else [[seed, i] for i in idx]
            rec = TraceRecorder(self.model.spec, batch, self.settings.gen_length, fraction=self.fraction, seed=seed,
                                keep_confidence=self.keep_confidence, row_seeds=seeds)
            canvas, _ = fused_generate(self.model, batch, self.settings, observer=rec)
            out += rec.traces(canvas, [dict(self.meta, **(metas[i] if metas else {})) for i in idx])
        return out


def record(model, prompts, *, policy="confidence", gen_length=64, block=None, window=None, policy_args=None,
           fraction=1.0, seed=0, keep_confidence=False, batch_size=16, stop_at_eot=False, row_seeds=None,
           metas=None) -> list[Trace]:
    """Decode ``prompts`` (token-id lists) in batches and return one `Trace` per prompt, in order (one
    `Recording`'s `Recording.run`)."""
    recording = Recording(model, policy=policy, gen_length=gen_length, block=block, window=window,
                          policy_args=policy_args, fraction=fraction, seed=seed, keep_confidence=keep_confidence,
                          stop_at_eot=stop_at_eot)
    return recording.run(prompts, batch_size=batch_size, row_seeds=row_seeds, metas=metas)
