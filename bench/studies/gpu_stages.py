"""What every GPU session script shares: stages guarded and time-budgeted, the cards' ceilings, kernel timing and the
roofline (bench/studies/gpu_step.py, bench/studies/gpu_race.py)."""

import argparse
import contextlib
import io
import os
import tarfile
import time
import traceback
from pathlib import Path

import torch

# (HBM bytes/s, dense bf16 FLOP/s) from NVIDIA's data sheets; the first name the device name contains wins
CEILINGS = [("H100 PCIe", 2.0e12, 756e12), ("H100", 3.35e12, 989e12), ("H200", 4.8e12, 989e12)]


def log(*args):
    print(*args, flush=True)


class Budget:
    """The seconds left of ``seconds`` from now."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def bundle(folder, archive) -> int:
    """Pack every file under ``folder`` into the gzipped tar ``archive``, written beside it and renamed into place
    (a kill leaves the previous archive whole); returns the number of files. The GPU session's one result file."""
    folder, archive = Path(folder), Path(archive)
    data = io.BytesIO()
    # a dry run's micro checkpoints are inputs, not results
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not any(
        part.startswith("micro-") for part in p.relative_to(folder).parts))
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(folder)))
    tmp = archive.with_name(f".{archive.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data.getvalue())
    os.replace(tmp, archive)
    return len(files)


def bundle_from_env() -> None:
    """`bundle` the session's work folder into its archive when the session set ``SESSION_WORK`` and
    ``SESSION_ARCHIVE`` (bench/studies/step_session.py): every stage's save lands in the archive at once."""
    work, archive = os.environ.get("SESSION_WORK"), os.environ.get("SESSION_ARCHIVE")
    if work and archive:
        bundle(work, archive)


def run_stage(result: dict, name: str, fn, save, budget: Budget, need: float) -> None:
    """``result[name] = fn()``, or the error it raised (beside what the stage put in ``result[name]`` itself as it
    went), or why it was skipped (less than ``need`` seconds left); then ``save()`` and, in a GPU session, the
    archive rewritten. A failing stage (out of memory included) leaves the next ones their chance."""
    if budget.left() < need:
        result[name] = dict(skipped=f"time budget: {budget.left():.0f} s left, the stage needs about {need:.0f} s")
    else:
        start = time.perf_counter()
        try:
            out = fn()
        except Exception as err:  # recorded in the JSON; the next stage runs
            partial = result.get(name) if isinstance(result.get(name), dict) else {}
            out = dict(partial, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-3000:])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        result[name] = dict(out, stage_seconds=time.perf_counter() - start)
    log(name, _brief(result[name]))
    save()
    bundle_from_env()


def _brief(out):
    """``out`` without its tables, markdown and traceback (what the log shows; the JSON has everything)."""
    if not isinstance(out, dict):
        return out
    return {k: _brief(v) for k, v in out.items() if k not in ("table", "markdown", "traceback")}


def ceilings(device) -> tuple:
    """(card, bytes/s, FLOP/s) of a known GPU, else (None, None, None)."""
    if device.type != "cuda":
        return None, None, None
    name = torch.cuda.get_device_name(device)
    return next(((n, bw, fl) for n, bw, fl in CEILINGS if n in name), (None, None, None))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def study_parser(doc: str, budget: float, out: str = "folder for the JSON (created)") -> argparse.ArgumentParser:
    """The options every GPU study takes: --out, --shape, --budget (seconds, default ``budget``) and --dry-run."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", required=True, help=out)
    parser.add_argument("--shape", default="llada-8b", choices=["llada-8b", "dream-7b"],
                        help="the released shape (default: llada-8b)")
    parser.add_argument("--budget", type=float, default=budget,
                        help=f"seconds the stages may take; a stage that needs more than is left is skipped "
                        f"({budget:g})")
    parser.add_argument("--dry-run", action="store_true", help="CPU, micro checkpoint, tiny shapes (default: off)")
    return parser


def timed_steps(engine, device, around=contextlib.nullcontext):
    """Step ``engine`` (its prompts admitted) until it is done, each step synced, timed and run inside ``around()``
    (a profiler, say): yields (kind, seconds, context) per step, kind "refresh" or "cached"
    (`DecodeEngine.last_step`) and context what ``around()`` entered."""
    while True:
        sync(device)
        with around() as context:
            start = time.perf_counter()
            ran = engine.step()
            sync(device)
            seconds = time.perf_counter() - start
        if not ran:
            return
        yield ("cached" if engine.last_step[1] == 0 else "refresh"), seconds, context


def step_times(engine, device, warmup: int = 0, limit: int | None = None) -> dict:
    """{"cached": [...], "refresh": [...]} seconds of `timed_steps`, the first ``warmup`` steps untimed and at most
    ``limit`` timed."""
    times = {"cached": [], "refresh": []}
    for i, (kind, seconds, _) in enumerate(timed_steps(engine, device)):
        if i >= warmup:
            times[kind].append(seconds)
        if limit is not None and i + 1 >= warmup + limit:
            break
    return times


def time_call(fn, device, calls: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` over ``calls`` back-to-back calls (CUDA events on a GPU) after ``warmup``;
    on a CPU (a dry run) one warm-up and two calls."""
    if device.type != "cuda":
        calls, warmup = 2, 1
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def roofline(bytes_moved: float, flops: float, seconds: float, bandwidth, flop_rate) -> dict:
    """Achieved GB/s and TFLOP/s; on a known card the roofline time, which bound sets it, and the share reached."""
    out = dict(seconds=seconds, bytes=bytes_moved, flops=flops, gb_per_s=bytes_moved / seconds / 1e9,
               tflop_per_s=flops / seconds / 1e12)
    if bandwidth:
        memory, compute = bytes_moved / bandwidth, flops / flop_rate
        out.update(roofline_seconds=max(memory, compute), bound="memory" if memory >= compute else "compute",
                   roofline_share=max(memory, compute) / seconds)
    return out

