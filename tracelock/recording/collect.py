"""``tracelock collect``: decode prompts with the trace schedule, filter the rows, store canonical traces.

Runs as one process or under ``torchrun``: rank i of K takes items i, i + K, ... and writes its own shards and
done record (`tracelock.traces.store`); gloo is initialised only to wait for every rank at the end, after which
rank 0 merges the index and writes ``summary.json``. A re-run with the same arguments resumes: items listed in any
done record are skipped, and a batch with an unfinished item is decoded again whole, so its rows see exactly the
batch they saw before and the finished store holds the same traces as an uninterrupted run. Traces do not depend
on the batch layout for deterministic policies at temperature 0 (batch == single, `tests/test_decode.py`), so K
ranks and one process store the same traces; sampled policies depend on the layout. Each rank holds a lock on the
folder (``.lock-rank<r>``): a second collect into it is refused. `tests/test_faults.py` kills it anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from tracelock.atomic import atomic_write_json, folder_lock, remove_stale_temps
from tracelock.text import read_prompt_rows
from tracelock.traces.filters import TraceFilterConfig, code_reasons, text_reason
from tracelock.traces.store import TraceWriter, build_index, done_records, store_bytes_per_trace, stored_ids

SETTINGS, SUMMARY = "collect.json", "summary.json"
# testing hook: exit the process hard (no cleanup, like a kill) once it has written this many shards
_EXIT_AFTER_SHARDS = "TRACELOCK_COLLECT_EXIT_AFTER_SHARDS"


@dataclass
class Item:
    id: str
    prompt: str
    meta: dict  # task, split, index, source: copied into the trace's meta
    example: object = None  # the testbed Example (scoring, code tests), None for JSONL prompts


def load_items(spec: str, num: int | None, seed: int = 0) -> list[Item]:
    """Items of testbed tasks, ``testbed:math,testbed:code`` (or ``testbed:math,code``; ``@SPLIT`` after a name picks
    the split of them all, default "train"; ``num`` per task), or of a JSONL file with one
    ``{"prompt": ..., "id": optional}`` per line (the first ``num`` when given)."""
    if num is not None and num < 1:
        raise ValueError(f"--limit {num} must be >= 1")
    if spec.startswith("testbed:"):
        from tracelock.tasks import held_out

        names, split = _testbed_tasks(spec)
        if num is None:
            raise ValueError(f"--limit is required with {spec!r}: how many items per task")
        return [Item(f"{task}:{split}:{seed}:{i}", ex.prompt, dict(task=task, split=split, index=i, source=spec), ex)
                for task in names for i, ex in enumerate(held_out(task, split, num, seed=seed))]
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"--prompts {spec!r} is neither testbed:TASKS nor an existing JSONL file")
    items = []
    for row in read_prompt_rows(path):
        item_id = row.get("id", f"{path.stem}:{len(items)}")
        items.append(Item(str(item_id), row["prompt"], dict(task="jsonl", index=len(items), source=str(path))))
    items = items[:num] if num else items
    ids = [it.id for it in items]
    if len(set(ids)) != len(ids):
        raise ValueError(f'{path}: "id" values repeat ({sorted(i for i in set(ids) if ids.count(i) > 1)[:5]}); '
                         "ids must be unique")
    return items


def _testbed_tasks(spec: str) -> tuple[list[str], str]:
    """``testbed:math,testbed:code@validation`` (or ``testbed:math,code@validation``) -> (["math", "code"],
    "validation")."""
    from tracelock.cli_options import split_tasks

    names, splits = [], set()
    for task in split_tasks(spec):
        name, _, split = task.removeprefix("testbed:").partition("@")
        names.append(name)
        splits |= {split} if split else set()
    if len(splits) > 1:
        raise ValueError(f"--prompts {spec!r} names several splits ({sorted(splits)}); collect one split at a time")
    return names, splits.pop() if splits else "train"


def model_fingerprint(path) -> str:
    """sha256 over the config and, per weight file, its name, size and first 4 MiB: cheap even for 8B weights,
    and a retrained or different checkpoint changes it."""
    from tracelock.models.loading import resolve_path

    folder = resolve_path(path)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            h.update(f"{f.name}:{f.stat().st_size}".encode() + fh.read(4 << 20))
    return h.hexdigest()[:16]


def _row_seed(seed: int, item_id: str) -> int:
    """The step-sampling seed of an item: fixed by the item, whatever batch or rank decodes it."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{item_id}".encode()).digest()[:8], "big")


def _check_settings(out: Path, settings: dict, rank: int) -> None:
    path = out / SETTINGS
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise ValueError(f"{out} holds a collection with other settings ({', '.join(diff)}: "
                             f"{[old.get(k) for k in diff]} there, {[settings.get(k) for k in diff]} now); "
                             "resume with the same arguments or use a new --out")
    elif rank == 0:
        atomic_write_json(path, settings)


def _filter_reasons(items, traces, completions, end_ids, config: TraceFilterConfig) -> list:
    from tracelock.tasks import code_program
    from tracelock.text import answer_ids

    reasons = [text_reason(answer_ids(t.final.tolist(), end_ids), config) for t in traces]
    code = [i for i, (it, r) in enumerate(zip(items, reasons)) if r is None and it.meta.get("task") == "code"]
    programs = [code_program(items[i].example, completions[i]) for i in code]
    tests = [(items[i].example.target, items[i].example.entry_point) for i in code]
    for i, r in zip(code, code_reasons(programs, tests, config)):
        reasons[i] = r
    return reasons


def check_decoding(policy: str, policy_args: dict | None, gen_length: int, block, window) -> None:
    """The schedule, the policy and its values at this setting, checked without the model (a bad spec failed only
    after the model had loaded); the messages speak the command line's options."""
    from tracelock.decode.schedule import validate_schedule
    from tracelock.policies import resolve_policy

    try:
        validate_schedule(gen_length, block, window)
    except ValueError as err:  # its message speaks fused_generate's keywords
        raise ValueError(str(err).replace("gen_length=", "--gen-length ").replace("block=", "--block ")
                         .replace("window=", "--window ")) from None
    resolve_policy(policy, policy_args, gen_length=gen_length, num_regions=gen_length // block if block else 1)


def collect(model_path, prompts: str, out, *, num=None, gen_length=64, block=None, window=None,
            policy="confidence", policy_args=None, fraction=1.0, keep_confidence=False, stop_at_eot=False,
            batch_size=16, seed=0, shard_size=64, filters: TraceFilterConfig | None = None, rank=0, world_size=1,
            dtype="float32", device="cpu") -> dict | None:
    """Collect canonical traces of ``prompts`` (see `load_items`) into the store folder ``out``.

    With neither ``block`` nor ``window`` the schedule is the paper's fine block schedule (block 8; with the
    default confidence policy, one token per step). Under torchrun pass ``rank``/``world_size`` with gloo already
    initialised. Returns the summary on rank 0 (None on other ranks).
    """
    import torch

    from tracelock.models import load_model, load_tokenizer
    from tracelock.progress import progress_bar
    from tracelock.recording.recorder import Recording
    from tracelock.text import decode_answer, encode_prompt

    start = time.perf_counter()
    if block is None and window is None:
        block = 8
    _check_arguments(policy, policy_args, gen_length, block, window, batch_size=batch_size, fraction=fraction)
    filters = filters or TraceFilterConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    items = load_items(prompts, num, seed)
    settings = dict(model=str(model_path), model_fingerprint=model_fingerprint(model_path), prompts=prompts, num=num,
                    gen_length=gen_length, block=block, window=window, policy=policy, policy_args=policy_args or {},
                    fraction=fraction, confidence=keep_confidence, stop_at_eot=stop_at_eot, seed=seed,
                    filters=asdict(filters), dtype=dtype)
    # one writer per rank and folder: a second collect into the same --out is refused, not interleaved
    with folder_lock(out, f"lock-rank{rank}"):
        _check_settings(out, settings, rank)
        model = load_model(model_path, dtype=getattr(torch, dtype), device=device)
        tokenizer = load_tokenizer(model_path)
        end_ids = model.spec.end_ids

        writer = TraceWriter(out, shard_size=shard_size, prefix=f"rank{rank}", on_shard=_exit_hook())
        done = writer.done_ids() | stored_ids(out, exclude=writer.prefix)
        seconds_before = writer.extra.get("seconds", 0.0)
        mine = items[rank::world_size]
        recording = Recording(model, policy=policy, gen_length=gen_length, block=block, window=window,
                              policy_args=policy_args, fraction=fraction, seed=seed, keep_confidence=keep_confidence,
                              stop_at_eot=stop_at_eot)  # the policy built once, not per chunk
        common = dict(model=settings["model"], model_fingerprint=settings["model_fingerprint"], seed=seed)
        bar = progress_bar(total=len(mine), desc="collect")
        for first in range(0, len(mine), batch_size):
            chunk = mine[first:first + batch_size]
            if all(it.id in done for it in chunk):
                bar.update(len(chunk))
                continue
            traces = recording.run([encode_prompt(tokenizer, it.prompt) for it in chunk], batch_size=len(chunk),
                                   row_seeds=[_row_seed(seed, it.id) for it in chunk],
                                   metas=[dict(common, id=it.id, **it.meta) for it in chunk])
            completions = [decode_answer(tokenizer, t.final.tolist(), end_ids) for t in traces]
            reasons = _filter_reasons(chunk, traces, completions, end_ids, filters)
            writer.extra["seconds"] = seconds_before + time.perf_counter() - start
            _store_batch(writer, chunk, traces, completions, reasons, done, filters)
            bar.update(len(chunk))
        bar.close()
        writer.extra["seconds"] = seconds_before + time.perf_counter() - start
        writer.close(write_index=False)
        if world_size > 1:
            torch.distributed.barrier()
        if rank != 0:
            return None
        summary = _summarize(out, len(items), settings, world_size)
        remove_stale_temps(out)  # every rank is done: a temporary file left now is a killed writer's
        return summary


def _check_arguments(policy: str, policy_args, gen_length: int, block, window, *, batch_size: int,
                     fraction: float) -> None:
    """`collect`'s decoding options, checked before the folder is made or the model loads."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    check_decoding(policy, policy_args, gen_length, block, window)
    if not 0 < fraction <= 1:
        raise ValueError(f"--fraction {fraction} must lie in (0, 1]: the share of each row's steps to record")


def _exit_hook():
    """The writer's ``on_shard`` for the testing hook: exit hard (like a kill) once as many shards are written as
    the ``TRACELOCK_COLLECT_EXIT_AFTER_SHARDS`` environment variable says (never when it is unset)."""
    shards_written, exit_after = [0], int(os.environ.get(_EXIT_AFTER_SHARDS, "0"))

    def on_shard(entry):
        shards_written[0] += 1
        if shards_written[0] == exit_after:
            os._exit(86)

    return on_shard


def _store_batch(writer: TraceWriter, chunk: list, traces: list, completions: list, reasons: list, done: set,
                 filters: TraceFilterConfig) -> None:
    """A decoded batch into the writer: items done before are left alone, filtered rows are recorded as skipped
    (with their reason), and kept rows are stored, marked ``correct`` where the item can be scored."""
    from tracelock.tasks import score

    for it, trace, text, reason in zip(chunk, traces, completions, reasons):
        if it.id in done:
            continue
        if reason is not None:
            writer.skip(it.id, reason)
            continue
        if it.example is not None and it.meta["task"] != "code":
            trace.meta["correct"] = bool(score(it.example, text))
        elif it.example is not None and filters.enabled and filters.run_tests:
            trace.meta["correct"] = True  # a kept code answer passed its hidden tests
        writer.add(trace)


def _summarize(out: Path, num_items: int, settings: dict, world_size: int) -> dict:
    index = build_index(out)
    records = done_records(out)
    filtered = Counter(r for rec in records.values() for r in rec["skipped"].values())
    kept = index["num_traces"]
    summary = dict(items=num_items, decoded=kept + sum(filtered.values()), kept=kept, filtered=dict(filtered),
                   bytes=index["bytes"], bytes_per_trace=store_bytes_per_trace(out) if kept else None,
                   shards=len(index["shards"]),
                   seconds=max((rec["extra"].get("seconds", 0.0) for rec in records.values()), default=0.0),
                   seconds_per_writer={p: rec["extra"].get("seconds") for p, rec in records.items()},
                   world_size=world_size, settings=settings)
    atomic_write_json(out / SUMMARY, summary)
    return summary


def run_collect(args) -> int:
    """The CLI: reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK, initialises gloo only when WORLD_SIZE > 1."""
    from tracelock.distributed import torchrun_group
    from tracelock.policy_specs import policy_and_args

    filters = TraceFilterConfig(min_tokens=args.min_tokens, run_tests=not args.no_tests, enabled=not args.no_filters)
    policy, policy_args = policy_and_args(args.policy, args.policy_arg)
    with torchrun_group(args.device) as (rank, world, device):
        summary = collect(args.model, args.prompts, args.out, num=args.limit, gen_length=args.gen_length,
                          block=args.block, window=args.window, policy=policy, policy_args=policy_args,
                          fraction=args.fraction,
                          keep_confidence=args.confidence, stop_at_eot=args.stop_at_eot, batch_size=args.batch_size,
                          seed=args.seed, shard_size=args.shard_size, filters=filters, rank=rank, world_size=world,
                          dtype=args.model_dtype, device=device)
    if summary is not None:
        print(f"collected {summary['kept']} traces of {summary['decoded']} decoded items "
              f"(filtered: {summary['filtered'] or 'none'}), {summary['bytes_per_trace'] or 0:.0f} bytes per trace, "
              f"{summary['seconds']:.1f} s; store in {args.out}")
    return 0


def add_parsers(sub) -> None:
    from tracelock.cli_options import (
        add_batch_size,
        add_device,
        add_model,
        add_model_dtype,
        add_policy,
        add_prompt_limit,
        add_schedule,
    )
    from tracelock.cli_values import MAX_BATCH, MAX_GEN_LENGTH, bounded_int, seed_int

    p = sub.add_parser("collect", help="decode prompts, filter, store canonical traces (resumable; torchrun-ready)")
    add_model(p)
    p.add_argument("--prompts", required=True,
                   help="testbed tasks as `tracelock eval` names them, testbed:math,testbed:code (testbed:math,code "
                        "too; @validation or @test after a name picks that split, default train), or a JSONL file "
                        'of {"prompt": ..., "id": optional}')
    add_prompt_limit(p)
    p.add_argument("--out", required=True, help="store folder (re-running with the same arguments resumes)")
    add_schedule(p, gen_length=64, block_default="8 when no --window is given", window_default="blocks, no window",
                 block_fallback=8)
    add_policy(p, default="confidence", extra="default: confidence, one token per step")
    p.add_argument("--fraction", type=float, default=1.0, help="share of each row's steps to record, in (0, 1]")
    p.add_argument("--confidence", action="store_true", help="also store the proposals' confidences (fp16)")
    p.add_argument("--stop-at-eot", action="store_true", help="a committed end token finishes the row")
    add_batch_size(p, default=16)
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the testbed items, decoding and step sampling")
    p.add_argument("--shard-size", type=bounded_int(MAX_BATCH, "traces held before a shard is written"), default=64,
                   help="traces per shard")
    p.add_argument("--min-tokens", type=bounded_int(MAX_GEN_LENGTH, "generated positions", minimum=0),
                   default=TraceFilterConfig.min_tokens, help="shorter answers are dropped")
    p.add_argument("--no-tests", action="store_true", help="do not run code answers against their hidden tests")
    p.add_argument("--no-filters", action="store_true", help="keep every decoded row")
    add_model_dtype(p)
    add_device(p, torchrun=True)
    p.set_defaults(func=run_collect)
