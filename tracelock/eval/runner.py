"""`tracelock eval`: every policy on the same prompts, per setting, with per-item results and traces on disk.

Layout of a run folder (what `tracelock report` reads)::

    manifest.json                       task, model, policies, settings, n, seed, versions
    summary.json, summary.csv           one row per (setting, policy): metric, average steps, seconds per item
    runs/<setting>/<policy>/items-rank<r>.jsonl    one line per item: id, correct, steps, seconds, completion, tokens
    runs/<setting>/<policy>/traces/     the canonical trace store of those decodes (every step, with confidence)

Resumable: an item is done once its line is in the JSONL, which is appended (and fsynced) only after the batch's
traces are on disk; a torn last line from a crash is ignored and that item decoded again. Under torchrun, rank r
of K takes items r, r + K, ... and writes its own files; rank 0 merges them after a barrier. Each rank holds a lock
on the folder (``.lock-rank<r>``), so a second eval into it is refused rather than interleaved.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from tracelock.atomic import atomic_write_json, atomic_write_text, folder_lock, remove_stale_temps
from tracelock.eval.items import append_items, ensure_trailing_newline, folder_items, read_items

__all__ = ["PolicySpec", "Setting", "build_policy", "check_policies", "parse_policies", "parse_settings", "run_eval",
           "read_items", "folder_items", "metric_cell", "summary_table"]


def slug(text: str) -> str:
    """A folder name for a label: lower case, runs of other characters as one '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


# a policy token's keys that are decoding arguments of the runner (`fused_generate`'s), not the policy's own
RUNNER_KEYS = ("schedule", "cache", "refresh_every", "refresh_shift")


@dataclass
class PolicySpec:
    """One policy of the comparison. ``name`` "oracle" replays the first policy's final tokens (`OraclePolicy`)."""

    label: str
    name: str
    args: dict = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return slug(self.label)

    @property
    def policy_args(self) -> dict:
        """The policy's own keyword arguments (without the runner's `RUNNER_KEYS`)."""
        return {k: v for k, v in self.args.items() if k not in RUNNER_KEYS}


@dataclass
class Setting:
    gen_length: int
    width: int  # block size, or window size for a windowed policy

    @property
    def label(self) -> str:
        return f"{self.gen_length}/{self.width}"

    @property
    def slug(self) -> str:
        return f"{self.gen_length}-{self.width}"


def _value(text: str):
    """A spec's value, as every command reads one (`tracelock.policy_specs.spec_value`: JSON, ``none``, else text)."""
    from tracelock.policy_specs import spec_value

    return spec_value(text)


def parse_policies(text: str, option: str = "--policies") -> list[PolicySpec]:
    """``name[:key=value[:key=value]]`` comma-separated, e.g. ``confidence,threshold:tau=0.9,tracelock,oracle``;
    ``threshold:tau=0.9,0.7`` is one policy per value (`tracelock.policy_specs.expand_policy_list`, the one list
    grammar of every command).

    ``schedule=block|window|full`` is the runner's, not the policy's: e.g. ``tracelock:schedule=full`` is TraceLock
    without soft-crop (every generation position in one region). So are the KV cache's ``cache=prefix|dual``,
    ``refresh_every=S`` and ``refresh_shift=R`` (`fused_generate`'s arguments), e.g. ``threshold:tau=0.9:cache=prefix``.
    """
    from tracelock.policy_specs import expand_policy_list
    from tracelock.text import did_you_mean

    specs = []
    for label, name, pairs in expand_policy_list(text, option=option):
        args = {key: _value(value) for key, value in pairs}
        schedule, cache = args.get("schedule", "block"), args.get("cache", "prefix")
        if schedule not in ("block", "window", "full"):
            raise ValueError(f"{option}: schedule={schedule!r} in {label!r} must be block, window or full"
                             f"{did_you_mean(schedule, ('block', 'window', 'full'))}")
        if cache not in ("prefix", "dual"):
            raise ValueError(f"{option}: cache={cache!r} in {label!r} must be prefix or dual"
                             f"{did_you_mean(cache, ('prefix', 'dual'))}")
        specs.append(PolicySpec(label, name, args))
    if not specs:
        raise ValueError(f"{option} names no policy; e.g. {option} confidence,threshold:tau=0.9")
    if specs[0].name == "oracle":
        raise ValueError(f"{option}: oracle replays the first policy's tokens, so it cannot come first")
    if len({s.slug for s in specs}) != len(specs):
        raise ValueError(f"{option} repeats a policy: {text!r}")
    return specs


def parse_settings(text: str) -> list[Setting]:
    """``GEN/WIDTH`` comma-separated, e.g. ``128/32,256/64``."""
    from tracelock.cli_options import check_settings

    return [Setting(gen, width) for gen, width in check_settings(text)]


def schedule_kind(policy: PolicySpec, schedule: str) -> str:
    """"block", "window" or "full" (the whole generation region, no soft-crop) for a policy.

    TraceLock decodes in a sliding window and the baselines in semi-AR blocks (the paper's protocol) unless
    ``schedule`` forces one for all; a policy's own ``schedule=`` argument wins over both.
    """
    if "schedule" in policy.args:
        return policy.args["schedule"]
    return schedule if schedule != "auto" else ("window" if policy.name == "tracelock" else "block")


def schedule_of(policy: PolicySpec, setting: Setting, schedule: str) -> dict:
    """The schedule keywords of `fused_generate` for a policy at a setting: ``block=`` / ``window=`` (none for
    "full") and the KV cache's, when the policy's token sets them."""
    kind = schedule_kind(policy, schedule)
    cache = {k: policy.args[k] for k in RUNNER_KEYS[1:] if k in policy.args}
    return cache if kind == "full" else {kind: setting.width, **cache}


def _oracle_reference(spec, prompts, finals):
    """[B, P + G] reference canvases in `fused_generate`'s left-padded layout of ``prompts``."""
    import torch

    P = max(map(len, prompts))
    return torch.tensor([[spec.pad_id] * (P - len(p)) + list(p) + list(f) for p, f in zip(prompts, finals)])


def _decode_chunk(model, policy, prompts, gen_length, sched, seed, metas, controller_file):
    """(traces, seconds per item) of one batch; with ``controller_file`` also the controller's per-step scores
    and thresholds (`tracelock.eval.diagnostics.ControllerStepRecorder`), written there before returning."""
    from tracelock.eval.diagnostics import ControllerStepRecorder, write_controller_steps
    from tracelock.generate import fused_generate
    from tracelock.recording.recorder import TraceRecorder

    traces_rec = TraceRecorder(model.spec, prompts, gen_length, keep_confidence=True, seed=seed)
    scores = ControllerStepRecorder(policy, gen_length, [m["id"] for m in metas]) if controller_file else None
    with scores or contextlib.nullcontext():
        observer = traces_rec if scores is None else (lambda step: (traces_rec(step), scores(step)))
        canvas, stats = fused_generate(model, prompts, policy=policy, gen_length=gen_length, seed=seed,
                                       observer=observer, **sched)
    if scores is not None:
        write_controller_steps(controller_file, scores)
    metas = [dict(m, gen_length=gen_length, seed=seed, family=model.spec.family) for m in metas]
    return traces_rec.traces(canvas, metas), stats.seconds / len(prompts)


def _policy_kwargs(policy: PolicySpec, model, controller, l2p) -> dict:
    """The policy's arguments as a spec gives them, with TraceLock's controller and Learn2PD's filters (the command's
    --controller / --l2p) and the model they are checked against."""
    args = policy.policy_args
    if policy.name == "tracelock":
        return {"controller": controller, "model": model, **args}
    if policy.name in ("l2p", "l2p-hidden"):
        return {"filters": l2p, "model": model, **args}
    return args


def build_policy(policy: PolicySpec, model, *, controller=None, l2p=None, gen_length=None):
    """The `Policy` object of a spec (`tracelock.policies.resolve_policy`; ``per_step`` as ``steps`` when
    ``gen_length`` is known); TraceLock's controller and Learn2PD's filters (one per block size) are read from their
    folders once, here."""
    from tracelock.policies import resolve_policy

    return resolve_policy(policy.name, _policy_kwargs(policy, model, controller, l2p), gen_length=gen_length)


def check_policies(policies: list, settings: list, schedule: str, *, controller=None, l2p=None) -> None:
    """Build and set up every policy at every setting without the model: a bad name, argument or value (``tau=2``,
    ``steps`` that do not split into the blocks) fails before a model loads or a point decodes, with the token that
    holds it named."""
    from tracelock.policies import POLICIES, resolve_policy

    for setting in settings:
        for policy in policies:
            if policy.name == "oracle":
                continue
            kind = schedule_kind(policy, schedule)
            regions = setting.gen_length // setting.width if kind == "block" else 1
            try:
                if kind == "block" and setting.gen_length % setting.width:
                    raise ValueError(f"the block {setting.width} does not divide the generation length "
                                     f"{setting.gen_length}; give a GEN/WIDTH setting whose WIDTH divides GEN")
                if kind == "window" and getattr(POLICIES.get(policy.name), "reads_vocab", False):
                    raise ValueError(f"policy {policy.name!r} keeps a memory per slot of a block, which a sliding "
                                     "window moves: decode it in blocks (schedule=block in its spec, or --schedule "
                                     "block / auto), not in a window")
                resolve_policy(policy.name, _policy_kwargs(policy, None, controller, l2p),
                               gen_length=setting.gen_length, num_regions=regions)
            except (ValueError, TypeError) as err:  # the label names the policy
                message = str(err).removeprefix(f"policy {policy.name!r}: ")
                raise type(err)(f"{policy.label} at {setting.label}: {message}") from None


def _decode_policy(model, tokenizer, task, items, policy, setting, folder, *, rank, batch_size, seed, schedule,
                   controller, first_folder, workers, l2p=None, uncontained=False):
    """Decode this rank's not-yet-done ``items`` with one policy at one setting; append results and traces.
    ``uncontained``: the code answers run without containment (the user's opt-in): each record says so."""
    from tracelock.policies.oracle import OraclePolicy
    from tracelock.progress import progress_bar
    from tracelock.text import decode_answer, encode_prompt
    from tracelock.traces.store import TraceWriter, stored_ids

    folder.mkdir(parents=True, exist_ok=True)
    items_path = folder / f"items-rank{rank}.jsonl"
    ensure_trailing_newline(items_path)
    done = folder_items(folder)  # every rank's: a resume may run with another world size
    todo = [it for it in items if it.id not in done]
    if not todo:
        return
    writer = TraceWriter(folder / "traces", prefix=f"rank{rank}", shard_size=batch_size)
    in_store = stored_ids(folder / "traces")  # every rank's, as the writer has just rewritten its own record
    reference = folder_items(first_folder) if policy.name == "oracle" else None
    if policy.name != "oracle":
        pol = build_policy(policy, model, controller=controller, l2p=l2p, gen_length=setting.gen_length)
    sched = schedule_of(policy, setting, schedule)
    bar = progress_bar(total=len(items), initial=len(items) - len(todo), desc=f"{setting.label} {policy.label}")
    for start in range(0, len(todo), batch_size):
        chunk = todo[start:start + batch_size]
        prompts = [encode_prompt(tokenizer, it.prompt) for it in chunk]
        if policy.name == "oracle":  # its reference is the batch's own rows of the first policy's canvases
            pol = OraclePolicy(_oracle_reference(model.spec, prompts, [reference[it.id]["tokens"] for it in chunk]))
        scores_file = (folder / f"controller_steps-rank{rank}-{len(done) + start:05d}.safetensors"
                       if policy.name == "tracelock" else None)
        metas = [dict(id=it.id, policy=policy.label, setting=setting.label, **sched) for it in chunk]
        traces, seconds = _decode_chunk(model, pol, prompts, setting.gen_length, sched, seed, metas, scores_file)
        completions = [decode_answer(tokenizer, t.final.tolist(), model.spec.end_ids) for t in traces]
        correct = task.score(chunk, completions, workers=workers)
        for t in traces:
            if t.meta["id"] not in in_store:
                writer.add(t)
        writer.flush()  # traces first: an item is done only once its line is appended below
        append_items(items_path, [dict(id=it.id, correct=c, steps=int(t.num_steps), seconds=seconds,
                                        completion=text, tokens=t.final.tolist(),
                                        **({"uncontained_code": True} if uncontained else {}))
                                   for it, t, text, c in zip(chunk, traces, completions, correct)])
        bar.update(len(chunk))
    bar.close()
    writer.close(write_index=False)


def summarize(folder: Path, setting: str, policy: str, metric_name: str) -> dict:
    """The summary row of one (setting, policy) folder."""
    records = list(folder_items(folder).values())
    scored = [r["correct"] for r in records if r["correct"] is not None]
    n = len(records)
    return dict(setting=setting, policy=policy, metric_name=metric_name,
                metric=sum(scored) / len(scored) if scored else None, n=n,
                avg_steps=sum(r["steps"] for r in records) / n if n else None,
                seconds_per_item=sum(r["seconds"] for r in records) / n if n else None)


def metric_cell(row: dict | None) -> str:
    """``metric / average steps`` of a summary row: shares as percent, ranks with two decimals."""
    if row is None:
        return "n/a"
    if row["metric"] is None:
        return f"unjudged / {row['avg_steps']:.1f}"
    value = f"{row['metric']:.2f}" if "rank" in row["metric_name"] else f"{100 * row['metric']:.1f}"
    return f"{value} / {row['avg_steps']:.1f}"


def summary_table(rows: list, settings: list[str], policies: list[str]) -> str:
    """The paper-style table as markdown: a row per setting, a column per policy, cells `metric_cell`."""
    cells = {(r["setting"], r["policy"]): r for r in rows}
    lines = [f"| setting | {' | '.join(policies)} |", "|---" * (len(policies) + 1) + "|"]
    lines += [f"| {s} | {' | '.join(metric_cell(cells.get((s, p))) for p in policies)} |" for s in settings]
    return "\n".join(lines)


def _write_summary(out: Path, rows: list, sandbox: dict | None = None) -> None:
    atomic_write_json(out / "summary.json", dict(rows=rows, **({"sandbox": sandbox} if sandbox else {})))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["setting", "policy", "metric_name", "metric", "avg_steps",
                                             "seconds_per_item", "n", "top_two_rate", "critic_rate"], restval="")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out / "summary.csv", buf.getvalue())


def _check_manifest(out: Path, manifest: dict) -> None:
    """A resumed run must ask for what the folder holds."""
    path = out / "manifest.json"
    if not path.exists():
        atomic_write_json(path, manifest)
        return
    old = json.loads(path.read_text())
    keys = ("task", "model", "model_fingerprint", "n", "seed", "schedule", "controller", "l2p", "quantize")
    changed = [k for k in keys if old.get(k) != manifest.get(k)]
    if changed:
        raise ValueError(f"{out} holds a run with other {', '.join(changed)} "
                         f"({', '.join(f'{k}={old.get(k)!r}' for k in changed)}); pass another --out or the same "
                         "arguments to resume it")
    # a run that once let its generated code go uncontained stays marked so
    if "sandbox" in manifest and (old.get("sandbox") or {}).get("opt_in") is not True:
        old["sandbox"] = manifest["sandbox"]
    # policies and settings may grow between runs: the manifest lists the union, in first-seen order
    for key in ("policies", "settings"):
        known = {json.dumps(x, sort_keys=True) for x in old[key]}
        old[key] += [x for x in manifest[key] if json.dumps(x, sort_keys=True) not in known]
    atomic_write_json(path, old)


def run_eval(model_path, task_spec: str, policies: list, settings: list, out, *, n=None, seed=0, batch_size=32,
             schedule="auto", controller=None, l2p=None, rank=0, world_size=1, dtype="float32", device="cpu",
             quantize=None, workers=2, judge=None, progress=None) -> list | None:
    """Decode ``n`` of ``task_spec``'s items (a random draw with ``seed``) with every policy at every setting into
    ``out``.

    Returns the summary rows on rank 0 (None elsewhere). A judged task (QA) is ranked by ``judge`` (a
    `tracelock.eval.judge.Judge`, see `tracelock.eval.judging`) on rank 0 after decoding; without one its rows
    hold ``metric=None`` (unjudged) unless an earlier call judged them. ``quantize`` ("int8", ...) loads the model
    with quantized weights (`tracelock.models.quantize`); a run folder holds one format.
    """
    import torch

    from tracelock.models import load_model, load_tokenizer
    from tracelock.models.quantize import check_quantize

    if schedule not in ("auto", "block", "window"):
        raise ValueError(f"schedule={schedule!r} must be auto, block or window")
    quantize = check_quantize(quantize, device, getattr(torch, dtype))  # before the folder records it
    _check_arguments(policies, settings, schedule, batch_size, controller=controller, l2p=l2p)
    out = Path(out)
    task, items, sandbox = _open_task(task_spec, n, seed)
    manifest = _manifest(model_path, task_spec, task, len(items), policies, settings, seed=seed, schedule=schedule,
                         controller=controller, l2p=l2p, dtype=dtype, quantize=quantize, sandbox=sandbox)
    # one writer per rank and folder: a second eval into the same --out is refused, not interleaved
    with folder_lock(out, f"lock-rank{rank}"):
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            _check_manifest(out, manifest)
        if world_size > 1:
            torch.distributed.barrier()
        model = load_model(model_path, dtype=getattr(torch, dtype), device=device, quantize=quantize)
        tokenizer = load_tokenizer(model_path)
        mine = items[rank::world_size]
        for setting in settings:
            for policy in policies:
                folder = out / "runs" / setting.slug / policy.slug
                _decode_policy(model, tokenizer, task, mine, policy, setting, folder, rank=rank, batch_size=batch_size,
                               seed=seed, schedule=schedule, controller=controller, l2p=l2p, workers=workers,
                               first_folder=out / "runs" / setting.slug / policies[0].slug,
                               uncontained=bool(sandbox and not sandbox["contained"]))
        if world_size > 1:
            torch.distributed.barrier()
        if rank != 0:
            return None
        return _finish_run(out, task, policies, settings, judge=judge, seed=seed, progress=progress)


def _check_arguments(policies: list, settings: list, schedule: str, batch_size: int, *, controller, l2p) -> None:
    """`run_eval`'s policies and batch size, checked before anything loads: the folders a policy needs, then
    every policy built at every setting (`check_policies`)."""
    if any(p.name == "tracelock" and "controller" not in p.policy_args for p in policies) and controller is None:
        raise ValueError("a tracelock policy needs --controller DIR (a `tracelock train --out` folder, or testbed / "
                         "testbed-dream for a bundled model's shipped controller) or its own controller=DIR")
    if any(p.name in ("l2p", "l2p-hidden") and "filters" not in p.args for p in policies) and l2p is None:
        raise ValueError("an l2p policy needs --l2p DIR (a `tracelock train-l2p --out` folder) or filters=DIR in "
                         "its token")
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size} must be >= 1")
    check_policies(policies, settings, schedule, controller=controller, l2p=l2p)


def _open_task(task_spec: str, n, seed: int) -> tuple:
    """(task, its ``n`` items drawn with ``seed``, the sandbox record or None). A task that runs generated code
    fails closed here, before anything loads or decodes, unless it is contained or the user opted out."""
    from tracelock.eval.tasks import make_task

    task = make_task(task_spec, seed=seed)
    items = task.items(n)
    sandbox = None
    if task.runs_code:  # fail closed before anything loads or decodes: the error names the opt-in
        from tracelock.sandbox import require_containment, sandbox_record

        require_containment()
        sandbox = sandbox_record()
    return task, items, sandbox


def _manifest(model_path, task_spec: str, task, n: int, policies: list, settings: list, *, seed, schedule,
              controller, l2p, dtype, quantize, sandbox) -> dict:
    """What ``manifest.json`` records of a run (`_check_manifest` compares a resumed run's)."""
    import torch

    from tracelock.recording.collect import model_fingerprint

    return dict(task=task_spec, metric_name=task.metric_name, model=str(model_path),
                model_fingerprint=model_fingerprint(model_path), n=n, seed=seed, schedule=schedule,
                controller=None if controller is None else str(controller),
                l2p=None if l2p is None else str(l2p), dtype=dtype,
                **({"quantize": quantize} if quantize else {}),
                policies=[dict(label=p.label, slug=p.slug, name=p.name, args=p.args,
                               schedule=schedule_kind(p, schedule)) for p in policies],
                settings=[dict(label=s.label, slug=s.slug, gen_length=s.gen_length, width=s.width)
                          for s in settings],
                versions=dict(torch=torch.__version__), **({"sandbox": sandbox} if sandbox else {}))


def _finish_run(out: Path, task, policies: list, settings: list, *, judge, seed, progress) -> list:
    """Rank 0, once every rank has decoded: judge (when asked), index the traces, write the summary of everything
    the folder holds; returns the rows of this call's settings and policies."""
    from tracelock.traces.store import build_index

    if judge is not None:
        from tracelock.eval.judging import judge_run

        judge_run(out, judge, seed=seed, progress=progress)
    for setting in settings:  # one index over every rank's shards
        for policy in policies:
            if (out / "runs" / setting.slug / policy.slug / "traces").exists():
                build_index(out / "runs" / setting.slug / policy.slug / "traces")
    # summary.json covers every (setting, policy) the folder holds, also those of earlier calls
    manifest = json.loads((out / "manifest.json").read_text())
    rows = [summarize(out / "runs" / s["slug"] / p["slug"], s["label"], p["label"], task.metric_name)
            for s in manifest["settings"] for p in manifest["policies"]
            if (out / "runs" / s["slug"] / p["slug"]).exists()]
    if task.judged:
        from tracelock.eval.judging import apply_judgements

        rows = apply_judgements(out, rows, manifest["settings"])
    _write_summary(out, rows, manifest.get("sandbox"))
    remove_stale_temps(out, recursive=True)  # every rank is done: what is left is a killed writer's
    wanted = {(s.label, p.label) for s in settings for p in policies}
    return [r for r in rows if (r["setting"], r["policy"]) in wanted]
