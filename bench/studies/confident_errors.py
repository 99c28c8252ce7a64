"""TraceLock's confident errors: the commits that turned a right answer wrong, read from a `tracelock eval` run.

For every item the reference rule (the family's one token per step) answers right and TraceLock answers wrong,
the first generated position where TraceLock's final tokens leave the reference's is its **first wrong commit**.
For it the script reports the token (TraceLock's and the reference's), its place in the generation and in the
window at that step (0 = the window's first still-masked position), the step, how many tokens that step
committed, the backbone's confidence, the controller's score ``a`` against the step's threshold, and whether
the commit was the controller's own (its margin cleared theta) or the fallback's (nothing cleared it). The same
figures over every TraceLock commit of the run are the baseline to compare with. Per pairing of outcomes it also
reports the answers' lengths under both rules and when TraceLock committed its first end-of-text position: a
rule that commits the padding early leaves the answer less room.

The eval run must hold TraceLock's controller steps (`tracelock eval` writes them for a tracelock policy) and the
reference's traces, e.g.::

    tracelock eval --model testbed --tasks testbed:math@validation --limit 300 --seed 44 --settings 64/16,64/32 \
        --policies "confidence,threshold:tau=0.9,tracelock:theta=0.9" \
        --controller tracelock/testbed/controller-llada --out runs/errors --threads 1 --batch-size 100
    python bench/studies/confident_errors.py runs/errors --setting 64/32 --policy tracelock-theta-0.9 \
        --theta 0.9 --reference confidence --model testbed --out errors-64-32.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tracelock import states
from tracelock.atomic import atomic_write_json
from tracelock.eval.diagnostics import ControllerSteps, read_controller_steps
from tracelock.eval.items import folder_items
from tracelock.traces.store import iter_traces


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def commit_table(steps: ControllerSteps, theta: float) -> dict:
    """{item id: {position: dict(step, window_place, committed_with, confidence, score, tau, own)}} of every
    commit the controller steps record (a position is committed once); ``own``: its margin ``a - tau`` cleared
    ``logit(theta)`` (else the step's fallback chose it)."""
    cut = float(np.log(theta / (1 - theta)))
    slot_step = steps.slot_steps()
    slot_row = np.repeat(steps.row, steps.num_slots)
    slot_tau = np.repeat(steps.tau, steps.num_slots)
    starts = np.concatenate([[0], np.cumsum(steps.num_slots)[:-1]])
    window_start = np.repeat([steps.position[s:s + n].min() if n else 0 for s, n in zip(starts, steps.num_slots)],
                             steps.num_slots)
    per_step = np.repeat(np.add.reduceat(steps.chosen.astype(np.int64), starts) if len(starts) else [],
                         steps.num_slots)
    table = {i: {} for i in steps.item_ids}
    for k in np.flatnonzero(steps.chosen):
        item = steps.item_ids[slot_row[k]]
        table[item][int(steps.position[k])] = dict(
            step=int(slot_step[k]), window_place=int(steps.position[k] - window_start[k]),
            committed_with=int(per_step[k]), confidence=float(steps.confidence[k]), score=float(steps.score[k]),
            tau=float(slot_tau[k]), own=bool(steps.score[k] - slot_tau[k] > cut))
    return table


def first_divergence(ours: np.ndarray, theirs: np.ndarray, end_ids) -> int | None:
    """The first position where two final generations differ, ignoring what follows both rows' end of text."""
    differ = np.flatnonzero(ours != theirs)
    if not len(differ):
        return None
    p = int(differ[0])
    ended = [np.flatnonzero(np.isin(row[:p], list(end_ids))) for row in (ours, theirs)]
    return None if all(len(e) for e in ended) else p


def lengths_by_pair(ours_items, ref_items, ours_tr, ref_tr) -> dict:
    """Per pairing of outcomes (both right, reference only, ...): the answers' lengths (generated positions before
    the end-of-text padding) under both rules, how often TraceLock's is shorter, and the mean step at which TraceLock
    committed its first end-of-text position against the step of its last text commit."""
    groups = {}
    for item, rec in ours_items.items():
        if item not in ref_items:
            continue
        a, b = bool(rec["correct"]), bool(ref_items[item]["correct"])
        group = "both right" if a and b else "both wrong" if not (a or b) else "TraceLock only" if a else \
            "reference only"
        t, r = ours_tr[item], ref_tr[item]
        ends_t, ends_r = t.final_state == states.EOT, r.final_state == states.EOT
        groups.setdefault(group, []).append((int((~ends_t).sum()), int((~ends_r).sum()),
                                             int(t.commit_step[ends_t].min()) if ends_t.any() else -1,
                                             int(t.commit_step[~ends_t].max()) if (~ends_t).any() else -1))
    out = {}
    for group, rows in groups.items():
        v = np.array(rows, dtype=np.float64)
        out[group] = dict(items=len(rows), length=float(v[:, 0].mean()), reference_length=float(v[:, 1].mean()),
                          share_shorter=float((v[:, 0] < v[:, 1]).mean()), first_end_commit_step=float(v[:, 2].mean()),
                          last_text_commit_step=float(v[:, 3].mean()))
    return out


def _quantiles(values) -> dict:
    values = np.asarray(values, dtype=np.float64)
    if not len(values):
        return {}
    q = np.quantile(values, [0.1, 0.25, 0.5, 0.75, 0.9])
    return dict(n=len(values), mean=float(values.mean()), p10=q[0], p25=q[1], median=q[2], p75=q[3], p90=q[4])


def summarize(commits: list, width: int) -> dict:
    """Distributions of a set of commit records (the first wrong ones, or all)."""
    place = np.array([c["window_place"] for c in commits])
    return dict(
        n=len(commits),
        confidence=_quantiles([c["confidence"] for c in commits]),
        probability=_quantiles([_sigmoid(c["score"]) for c in commits]),
        margin=_quantiles([c["score"] - c["tau"] for c in commits]),
        step=_quantiles([c["step"] for c in commits]),
        committed_with=_quantiles([c["committed_with"] for c in commits]),
        window_place=_quantiles(place),
        share_in_window_second_half=float(np.mean(place >= width // 2)) if len(place) else None,
        share_beyond_16=float(np.mean(place >= 16)) if len(place) else None,
        share_fallback=float(np.mean([not c["own"] for c in commits])) if commits else None,
        share_confidence_below_0_5=float(np.mean([c["confidence"] < 0.5 for c in commits])) if commits else None,
    )


def analyse(run: Path, setting: str, policy: str, reference: str, theta: float, tokenizer=None,
            end_ids=(0,)) -> dict:
    base = run / "runs" / setting.replace("/", "-")
    ours_dir = base / policy
    ref_dir = Path(reference) if "/" in reference else base / reference  # another run's policy folder
    for d in (ours_dir, ref_dir):
        if not d.is_dir():
            options = sorted(p.name for p in base.iterdir()) if base.is_dir() else []
            raise SystemExit(f"{d} is not a policy folder of the run; the setting's folders: {options}")
    files = sorted(ours_dir.glob("controller_steps-rank*.safetensors"))
    if not files:
        raise SystemExit(f"{ours_dir} holds no controller steps: pass a tracelock policy's folder")
    steps = ControllerSteps.concat([read_controller_steps(f) for f in files])
    table = commit_table(steps, theta)
    ours_items, ref_items = folder_items(ours_dir), folder_items(ref_dir)
    ours_tr = {t.meta["id"]: t for t in iter_traces(ours_dir / "traces")}
    ref_tr = {t.meta["id"]: t for t in iter_traces(ref_dir / "traces")}
    width = int(setting.split("/")[1])
    first, rows = [], []
    pairs = {"both right": 0, "both wrong": 0, "reference only": 0, "TraceLock only": 0}
    for item, rec in ours_items.items():
        if item not in ref_items:
            continue
        a, b = bool(rec["correct"]), bool(ref_items[item]["correct"])
        pairs["both right" if a and b else "both wrong" if not (a or b) else "TraceLock only" if a else
              "reference only"] += 1
        if a or not b:
            continue
        p = first_divergence(ours_tr[item].final, ref_tr[item].final, end_ids)
        if p is None or p not in table.get(item, {}):
            continue
        c = dict(table[item][p], item=item, position=p, token=int(ours_tr[item].final[p]),
                 reference_token=int(ref_tr[item].final[p]), steps=int(rec["steps"]))
        if tokenizer is not None:
            c["text"], c["reference_text"] = tokenizer.decode([c["token"]]), tokenizer.decode([c["reference_token"]])
            c["completion"], c["reference_completion"] = rec.get("completion"), ref_items[item].get("completion")
        first.append(c)
    every = [c for item in table.values() for c in item.values()]
    for c in first:
        rows.append({k: c[k] for k in ("item", "position", "window_place", "step", "committed_with", "confidence",
                                       "score", "tau", "own", "token", "reference_token")
                     } | ({"text": c["text"], "reference_text": c["reference_text"]} if "text" in c else {}))
    tokens = {}
    for c in first:
        key = c.get("text", str(c["token"]))
        tokens[key] = tokens.get(key, 0) + 1
    return dict(run=str(run), setting=setting, policy=policy, theta=theta, reference=reference, items=len(ours_items),
                pairs=pairs, lengths=lengths_by_pair(ours_items, ref_items, ours_tr, ref_tr),
                first_wrong=summarize(first, width), every_commit=summarize(every, width),
                first_wrong_tokens=dict(sorted(tokens.items(), key=lambda kv: -kv[1])), first_wrong_commits=rows,
                examples=[{k: c.get(k) for k in ("item", "position", "window_place", "step", "text",
                                                 "reference_text", "completion", "reference_completion")}
                          for c in first[:12]])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a `tracelock eval --out` folder (one task)")
    p.add_argument("--setting", required=True, help="GEN/WIDTH, e.g. 64/32")
    p.add_argument("--policy", required=True, help="the TraceLock policy's folder name, e.g. tracelock-theta-0.9")
    p.add_argument("--reference", default="confidence",
                   help="the reference policy's folder name, or the path of a policy folder of another eval run of "
                        "the same items and setting")
    p.add_argument("--theta", type=float, required=True, help="the TraceLock policy's theta")
    p.add_argument("--model", default=None, help="the run's model (to print tokens as text), e.g. testbed")
    p.add_argument("--out", type=Path, help="write the JSON here")
    args = p.parse_args(argv)
    tokenizer, end_ids = None, (0,)
    if args.model:
        import tracelock

        tokenizer = tracelock.load_tokenizer(args.model)
        end_ids = tracelock.load_model(args.model).spec.end_ids
    result = analyse(args.run, args.setting, args.policy, args.reference, args.theta, tokenizer, end_ids)
    if args.out:
        atomic_write_json(args.out, result)
    brief = {k: v for k, v in result.items() if k not in ("first_wrong_commits", "examples")}
    json.dump(brief, sys.stdout, indent=1, default=float)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
