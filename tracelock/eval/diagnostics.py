"""Trace diagnostics of the paper's appendix ("Confidence and Trace Diagnostics", "Self-Training and RL"): how two
policies' trajectories diverge on the same items, how fast each commits, how the controller's score relates to the
backbone's confidence, and the learned threshold over decoding time.

Step convention (the trace's): "at step s" is the canvas after the row's first s forwards, i.e. ``Trace.x_at(s)``;
a position is committed at step s when ``commit_step < s``. A row that finished before s keeps its final canvas,
so rows of different lengths can be compared and averaged at every step.

Everything here is numpy on `Trace` objects and `ControllerSteps`, except `ControllerStepRecorder`, the observer of
`fused_generate` that records the controller's per-step scores (its file format: `write_controller_steps`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracelock.atomic import atomic_write_bytes
from tracelock.traces.trace import Trace

GRID_MASKED, GRID_SAME, GRID_DIFFERENT = 0, 1, 2  # trace-grid cells: masked in both (grey), same token (green), red
CONTROLLER_STEPS_FORMAT, CONTROLLER_STEPS_VERSION = "tracelock-controller-steps", 1


def _committed(trace: Trace, step: int) -> np.ndarray:
    """[G] bool positions committed after ``step`` forwards (a finished row stays final)."""
    return trace.commit_step < step


def probe_steps(last: int, every: int) -> np.ndarray:
    """[K] the steps ``every, 2 * every, ...`` up to ``last``, and ``last`` itself (the paper probes every 16)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every={every!r} must be a positive int (probe every that many steps; the paper uses 16)")
    steps = list(range(every, last + 1, every))
    if last > 0 and (not steps or steps[-1] != last):
        steps.append(last)
    return np.array(steps, dtype=np.int64)


def pair_traces(traces_a, traces_b) -> list[tuple[Trace, Trace]]:
    """(a, b) traces of the same items (matched by ``meta["id"]``), in the order of ``traces_a``.

    Items present under only one policy are left out; the pairs must share prompt and generation length.
    """
    by_id = {t.meta.get("id"): t for t in traces_b}
    pairs = []
    for a in traces_a:
        b = by_id.get(a.meta.get("id"))
        if b is None:
            continue
        if a.gen_length != b.gen_length or not np.array_equal(a.prompt, b.prompt):
            raise ValueError(f"item {a.meta.get('id')!r}: the two traces have different prompts or generation "
                             f"lengths ({a.gen_length} vs {b.gen_length}); compare traces of one setting and task")
        pairs.append((a, b))
    if not pairs:
        raise ValueError("the two trace sets share no item id (Trace.meta['id']); pass traces of the same items")
    return pairs


@dataclass
class Divergence:
    """Trace divergence between policies A and B at probe steps (one pair of traces, or the mean over items).

    Args:
        step (np.ndarray): [K] probe steps.
        mask_sym_diff (np.ndarray): [K] positions masked in exactly one trace, as a fraction of the generation
            length (the paper normalises its count metrics by it).
        mask_jaccard (np.ndarray): [K] Jaccard overlap of the two still-masked sets, the paper's "mask Jaccard"
            (its table's late rows, 13% symmetric difference with 37% common-token difference, are only possible
            for the masked sets). Undefined (NaN) once both traces are fully committed: an item counts in the mean
            only while one of its traces still has a mask, so finished items do not pull it to 100%.
        common_token_diff (np.ndarray): [K] positions committed in both with different tokens, as a fraction of
            the generation length.
        committed_jaccard (np.ndarray): [K] Jaccard overlap of the two committed sets (NaN if neither committed).
        items (int): item pairs averaged (1 for a single pair).
    """

    step: np.ndarray
    mask_sym_diff: np.ndarray
    mask_jaccard: np.ndarray
    common_token_diff: np.ndarray
    committed_jaccard: np.ndarray
    items: int = 1

    # the paper's three columns, then the committed sets' overlap
    METRICS = ("mask_sym_diff", "mask_jaccard", "common_token_diff", "committed_jaccard")


def _jaccard(x: np.ndarray, y: np.ndarray) -> float:
    union = int((x | y).sum())
    return float("nan") if union == 0 else int((x & y).sum()) / union


def _divergence_at(a: Trace, b: Trace, steps: np.ndarray) -> Divergence:
    G = a.gen_length
    rows = []
    for s in steps:
        ca, cb = _committed(a, s), _committed(b, s)
        both = ca & cb
        rows.append(((ca ^ cb).sum() / G, _jaccard(~ca, ~cb), (both & (a.final != b.final)).sum() / G,
                     _jaccard(ca, cb)))
    cols = np.array(rows, dtype=np.float64).reshape(len(steps), 4).T
    return Divergence(np.asarray(steps, dtype=np.int64), **dict(zip(Divergence.METRICS, cols)))


def trace_divergence(a: Trace, b: Trace, every: int = 16) -> Divergence:
    """Divergence of two traces of one item every ``every`` steps and at the last step of the longer one."""
    (a, b), = pair_traces([a], [b])
    return _divergence_at(a, b, probe_steps(max(a.num_steps, b.num_steps), every))


def divergence_over_items(traces_a, traces_b, every: int = 16) -> Divergence:
    """Mean divergence over the items both sets hold, every ``every`` steps up to the longest trace (plus that
    last step); an item whose two traces finished earlier contributes its final state, and to the Jaccard
    overlaps only where they are defined (NaN at a step where no item defines them)."""
    pairs = pair_traces(traces_a, traces_b)
    steps = probe_steps(max(max(a.num_steps, b.num_steps) for a, b in pairs), every)
    per_item = [_divergence_at(a, b, steps) for a, b in pairs]
    means = []
    for m in Divergence.METRICS:
        values = np.stack([getattr(d, m) for d in per_item])
        defined = (~np.isnan(values)).sum(0)
        total = np.where(np.isnan(values), 0.0, values).sum(0)
        means.append(np.divide(total, defined, out=np.full(len(steps), np.nan), where=defined > 0))
    return Divergence(steps, **dict(zip(Divergence.METRICS, means)), items=len(pairs))


def cumulative_acceptance(traces) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S + 1] = 0..S, fraction [S + 1]): the share of generation positions committed after s forwards,
    averaged over the traces (S = the longest trace; a finished trace counts as fully committed)."""
    traces = list(traces)
    if not traces:
        raise ValueError("traces is empty; pass the traces of one policy and setting")
    steps = np.arange(max(t.num_steps for t in traces) + 1)
    # fraction committed after s steps = share of commit_step < s: a per-trace cumulative histogram
    fractions = [np.searchsorted(np.sort(t.commit_step), steps, side="left") / t.gen_length for t in traces]
    return steps, np.mean(fractions, axis=0)


def trace_grid(a: Trace, b: Trace, every: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(steps [K], grid [G, K] uint8) for one item under two policies: `GRID_SAME` where both committed the same
    token, `GRID_DIFFERENT` where the tokens differ or only one committed, `GRID_MASKED` where both are masked;
    columns every ``every`` steps up to the longer trace's last step (the paper's side-by-side trace figures)."""
    (a, b), = pair_traces([a], [b])
    steps = probe_steps(max(a.num_steps, b.num_steps), every)
    grid = np.full((a.gen_length, len(steps)), GRID_MASKED, dtype=np.uint8)
    same = a.final == b.final
    for k, s in enumerate(steps):
        ca, cb = _committed(a, s), _committed(b, s)
        grid[ca & cb & same, k] = GRID_SAME
        grid[(ca ^ cb) | (ca & cb & ~same), k] = GRID_DIFFERENT
    return steps, grid


@dataclass
class ControllerSteps:
    """The TraceLock controller's decisions at every recorded step (what `ControllerStepRecorder` keeps).

    Args:
        item_ids (list[str]): the recorded rows' item ids; ``row`` indexes it.
        row (np.ndarray): [N] int32 row of each recorded step.
        step (np.ndarray): [N] int32 the row's step index (0 at its first forward).
        tau (np.ndarray): [N] float32 threshold logit the policy used at that step.
        num_slots (np.ndarray): [N] int32 active slots of that step; the slot arrays hold them step after step.
        position (np.ndarray): [M] int32 generation position (0-based in the generated region) of each slot.
        confidence (np.ndarray): [M] float32 the backbone's max-prob of the slot's proposal.
        score (np.ndarray): [M] float32 the controller's raw score ``a``.
        chosen (np.ndarray): [M] bool the policy committed the slot at that step.
        gen_length (int): the run's generation length.
    """

    item_ids: list
    row: np.ndarray
    step: np.ndarray
    tau: np.ndarray
    num_slots: np.ndarray
    position: np.ndarray
    confidence: np.ndarray
    score: np.ndarray
    chosen: np.ndarray
    gen_length: int

    STEP_ARRAYS = ("row", "step", "tau", "num_slots")
    SLOT_ARRAYS = ("position", "confidence", "score", "chosen")

    def slot_steps(self) -> np.ndarray:
        """[M] the step index of every slot."""
        return np.repeat(self.step, self.num_slots)

    @staticmethod
    def concat(parts) -> ControllerSteps:
        """One record from several (e.g. one recorder per batch); item ids must not repeat."""
        parts = list(parts)
        if not parts:
            raise ValueError("parts is empty; pass at least one ControllerSteps or recorder")
        if len({p.gen_length for p in parts}) != 1:
            raise ValueError(f"parts have different gen_length ({sorted({p.gen_length for p in parts})}); record "
                             "one setting per file")
        ids = [i for p in parts for i in p.item_ids]
        if len(ids) != len(set(ids)):
            raise ValueError("an item id appears in more than one part; each item is recorded once per file")
        offsets = np.cumsum([0] + [len(p.item_ids) for p in parts[:-1]])
        arrays = {k: np.concatenate([getattr(p, k) for p in parts]) for k in ControllerSteps.STEP_ARRAYS[1:]}
        arrays |= {k: np.concatenate([getattr(p, k) for p in parts]) for k in ControllerSteps.SLOT_ARRAYS}
        row = np.concatenate([p.row + o for p, o in zip(parts, offsets)]).astype(np.int32)
        return ControllerSteps(item_ids=ids, row=row, gen_length=parts[0].gen_length, **arrays)


class ControllerStepRecorder:
    """Observer for `fused_generate` with a `TraceLockPolicy`: per step and row the threshold logit tau, and per
    active slot the confidence, the controller score ``a`` and whether it was chosen.

    The policy keeps its last step's (a, tau) only while a recorder is open (``policy.record_scores``), so pass
    the same policy instance to `fused_generate`, and close the recorder (or use it as a context manager)
    afterwards. One recorder per `fused_generate` call, like `TraceRecorder`; ``ControllerSteps.concat`` joins
    batches. Under an observer the loop takes the policy's select path, which computes ``a`` on every path.

    Args:
        policy (TraceLockPolicy): the policy instance the run decodes with.
        gen_length (int): the run's generation length (slot positions are stored relative to it).
        item_ids (list[str], optional): the batch rows' item ids. Default: "0", "1", ...

    Examples::

        with ControllerStepRecorder(policy, 64, ids) as rec:
            fused_generate(model, prompts, policy=policy, gen_length=64, window=32, observer=rec)
        write_controller_steps(folder / "controller_steps.safetensors", rec.steps())
    """

    def __init__(self, policy, gen_length: int, item_ids=None):
        from tracelock.policies.tracelock import TraceLockPolicy

        if not isinstance(policy, TraceLockPolicy):
            raise TypeError(f"policy must be a TraceLockPolicy instance (the one passed to fused_generate), got "
                            f"{type(policy).__name__}: only TraceLock has a controller score and threshold")
        if isinstance(gen_length, bool) or not isinstance(gen_length, int) or gen_length < 1:
            raise ValueError(f"gen_length={gen_length!r} must be the run's generation length (a positive int)")
        self.policy, self.gen_length = policy, gen_length
        self.item_ids = None if item_ids is None else [str(i) for i in item_ids]
        self._steps, self._slots, self._last_step = [], [], {}
        policy.record_scores, policy.last_scores = True, None

    def __call__(self, rec) -> None:
        scores, self.policy.last_scores = self.policy.last_scores, None
        if scores is None or not self.policy.record_scores:
            raise RuntimeError("the policy computed no scores for this step: pass the recorder's own policy "
                               "instance to fused_generate, and do not close the recorder before the run ends")
        a, tau = scores
        if a.shape != rec.active.shape:
            raise RuntimeError(f"the policy's last scores {list(a.shape)} are not this step's slots "
                               f"{list(rec.active.shape)}; one recorder per policy and run")
        rows, steps = rec.rows.tolist(), rec.step.tolist()
        if self.item_ids is not None and max(rows) >= len(self.item_ids):
            raise ValueError(f"item_ids has {len(self.item_ids)} entries but the run has row {max(rows)}; pass "
                             "one id per prompt of the batch")
        P = rec.x.shape[1] - self.gen_length
        active = rec.active.cpu().numpy()
        per_slot = [t.detach().float().cpu().numpy() for t in (a, rec.signals.confidence)]
        position = (rec.positions - P).cpu().numpy()
        chosen = (rec.chosen & rec.active).cpu().numpy()
        tau = tau.detach().float().cpu().numpy()
        for i, (r, t) in enumerate(zip(rows, steps)):
            if t != self._last_step.get(r, -1) + 1:
                raise RuntimeError(f"row {r} jumped from step {self._last_step.get(r, -1)} to {t}: a "
                                   "ControllerStepRecorder must observe every step of one decoding run")
            self._last_step[r] = t
            on = active[i]
            self._steps.append((r, t, tau[i], int(on.sum())))
            self._slots.append((position[i][on], per_slot[1][i][on], per_slot[0][i][on], chosen[i][on]))

    def close(self) -> None:
        """Stop the policy keeping scores (decoding without a recorder holds on to nothing)."""
        self.policy.record_scores, self.policy.last_scores = False, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def steps(self) -> ControllerSteps:
        """What was recorded, rows renumbered in order of their item ids (or row index)."""
        rows = sorted(self._last_step)
        ids = [self.item_ids[r] for r in rows] if self.item_ids is not None else [str(r) for r in rows]
        renumber = {r: k for k, r in enumerate(rows)}
        cols = list(zip(*self._steps)) or [(), (), (), ()]
        slots = list(zip(*self._slots)) or [[np.zeros(0)]] * 4
        return ControllerSteps(
            item_ids=ids, row=np.array([renumber[r] for r in cols[0]], dtype=np.int32),
            step=np.array(cols[1], dtype=np.int32), tau=np.array(cols[2], dtype=np.float32),
            num_slots=np.array(cols[3], dtype=np.int32), position=np.concatenate(slots[0]).astype(np.int32),
            confidence=np.concatenate(slots[1]).astype(np.float32), score=np.concatenate(slots[2]).astype(np.float32),
            chosen=np.concatenate(slots[3]).astype(bool), gen_length=self.gen_length,
        )


def write_controller_steps(path, steps) -> None:
    """Write a `ControllerSteps` (or a recorder's, or a list of either, joined) as one safetensors file, atomically:
    the step and slot arrays, and the item ids and generation length in the header."""
    from safetensors.numpy import save

    parts = steps if isinstance(steps, list | tuple) else [steps]
    steps = ControllerSteps.concat([p.steps() if isinstance(p, ControllerStepRecorder) else p for p in parts])
    arrays = {k: np.ascontiguousarray(getattr(steps, k)) for k in ControllerSteps.STEP_ARRAYS}
    arrays |= {k: np.ascontiguousarray(getattr(steps, k)) for k in ControllerSteps.SLOT_ARRAYS}
    arrays["chosen"] = arrays["chosen"].astype(np.uint8)
    header = {"format": CONTROLLER_STEPS_FORMAT, "version": str(CONTROLLER_STEPS_VERSION),
              "item_ids": json.dumps(steps.item_ids), "gen_length": str(steps.gen_length)}
    atomic_write_bytes(path, save(arrays, metadata=header))


def read_controller_steps(path) -> ControllerSteps:
    """The `ControllerSteps` of a file `write_controller_steps` wrote."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; it is written by `tracelock eval` for TraceLock policies "
                                "(write_controller_steps)")
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            arrays = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file ({err}); re-run the evaluation that wrote "
                         "it") from None
    if meta.get("format") != CONTROLLER_STEPS_FORMAT or int(meta.get("version", -1)) > CONTROLLER_STEPS_VERSION:
        raise ValueError(f"{path} is not a {CONTROLLER_STEPS_FORMAT} file up to v{CONTROLLER_STEPS_VERSION} "
                         f"(header format={meta.get('format')!r}, version={meta.get('version')!r})")
    missing = set(ControllerSteps.STEP_ARRAYS + ControllerSteps.SLOT_ARRAYS) - set(arrays)
    if missing:
        raise ValueError(f"{path} lacks the arrays {sorted(missing)}; re-run the evaluation that wrote it")
    arrays["chosen"] = arrays["chosen"].astype(bool)
    return ControllerSteps(item_ids=json.loads(meta["item_ids"]), gen_length=int(meta["gen_length"]), **arrays)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (Spearman's convention)."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    # tie groups: the start index of each run of equal values
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    avg = (starts + ends - 1) / 2 + 1
    ranks = np.empty(len(x))
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2:
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    norm = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / norm) if norm > 0 else float("nan")


def score_confidence_correlation(steps: ControllerSteps) -> dict:
    """Per step, the correlation between the backbone's confidence and the controller's score over the active
    slots of every row at that step (the paper's "stepwise correlation"): {"step" [K], "pearson" [K],
    "spearman" [K], "slots" [K]}. NaN where fewer than two slots or either side is constant."""
    slot_step = steps.slot_steps()
    conf, score = steps.confidence.astype(np.float64), steps.score.astype(np.float64)
    out = {"step": np.unique(slot_step)}
    rows = []
    for s in out["step"]:
        on = slot_step == s
        x, y = conf[on], score[on]
        rows.append((_pearson(x, y), _pearson(_ranks(x), _ranks(y)), on.sum()))
    cols = np.array(rows, dtype=np.float64).reshape(-1, 3)
    out.update(pearson=cols[:, 0], spearman=cols[:, 1], slots=cols[:, 2].astype(np.int64))
    return out


def threshold_over_steps(steps: ControllerSteps, quantiles=(0.1, 0.25, 0.5, 0.75, 0.9)) -> dict:
    """The learned threshold as a probability, ``sigmoid(tau)``, per step over the rows decoded at that step (the
    paper's "hidden threshold trajectories"): {"step" [K], "mean" [K], "quantiles" [K, Q], "q" [Q], "rows" [K]}."""
    q = np.asarray(quantiles, dtype=np.float64)
    if q.ndim != 1 or np.any((q < 0) | (q > 1)):
        raise ValueError(f"quantiles={quantiles!r} must be a sequence of numbers in [0, 1]")
    prob = 1.0 / (1.0 + np.exp(-steps.tau.astype(np.float64)))
    uniq = np.unique(steps.step)
    mean, quant, rows = [], [], []
    for s in uniq:
        p = prob[steps.step == s]
        mean.append(p.mean())
        quant.append(np.quantile(p, q))
        rows.append(len(p))
    return {"step": uniq, "mean": np.array(mean), "quantiles": np.array(quant).reshape(len(uniq), len(q)), "q": q,
            "rows": np.array(rows, dtype=np.int64)}
