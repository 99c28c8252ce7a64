"""A decode step's matrix products on one GPU: cuBLAS, torch.compile max-autotune and `linear_rows`' Triton kernel at
LLaDA-8B's and Dream-7B's shapes (the backbone's products: one per fused weight, and the LM head).

Per shape (``--shapes``) its four products, fused as the backbone will run them: q/k/v (Dream with its bias), o,
gate/up (``[2F, K]``) and down, at M = 1, 8, 32 rows (``--rows``), bf16, random N(0, 1/K) weights. Stages, each
guarded (an error is recorded in its place, the next stage runs) and skipped, with the reason, when the time budget
(``--budget`` seconds) has less left than it needs:

1. ``copy``: a device-to-device copy's GB/s, the floor measured in the same run beside the data sheet's bandwidth;
2. ``<shape>``: per product and M, cuBLAS (``F.linear``) and the Triton kernel (``ops.linear_rows``, autotuned, and
   each autotune config alone), each checked against the spec ``linear_rows_ref`` before it is timed: seconds per
   call, the bytes it must move (weights once, x, bias, out), GB/s and the share of the card's bandwidth and of the
   measured copy, TFLOP/s and the share of the bf16 tensor peak (the number to read at M = 32), the config the
   autotuner chose; and per M the four products' sum per layer and per step (x layers) against the weights' floor;
3. ``<shape>-epilogues``: the fused epilogues against cuBLAS plus separate torch ops: o and down with the residual
   (``F.linear(x, W) + r``), gate/up with silu x mul (``F.linear`` then ``silu(g) * u``), Dream's q/k/v bias;
4. ``max_autotune``: ``torch.compile(F.linear, mode="max-autotune-no-cudagraphs")`` at every product and M, checked
   and timed the same way, the largest M first (last: its template search takes seconds per shape; rows left when
   the budget runs out say so).

Timing: ``--calls`` launches captured in one CUDA graph and replayed (so host launch overhead stays out, as in the
engine's captured step), cycling through copies of the weights that together exceed twice the L2 cache (so every
call reads its weights from HBM, as each layer of a forward does); the mean per call over the replays.

``--dry-run``: the CPU at tiny shapes (no bandwidth; the Triton kernel under ``TRITON_INTERPRET=1``, else the
spec; eager timing; max-autotune replaced by ``torch.compile(backend="eager")`` at one shape, only to run the
code): tests/test_gpu_gemm_script.py. The JSON (``gpu-gemm.json``, ``gpu-gemm-dry-run.json``) is rewritten
atomically after every stage and every measured row.

    python bench/studies/gpu_gemm.py --out DIR [--shapes llada-8b dream-7b] [--rows 1 8 32] [--budget SECONDS] \
        [--dry-run]
"""

import argparse
import json
import math
import platform
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gpu_stages import Budget, bundle_from_env, ceilings, log, roofline, run_stage, sync, time_call  # noqa: E402

from tracelock import ops  # noqa: E402
from tracelock.atomic import atomic_write_text  # noqa: E402
from tracelock.kernels.ref import linear_rows_ref  # noqa: E402

# (family, (hidden, heads, kv heads, layers, mlp)) of the dry run's tiny shapes
TINY = {"llada-8b": ("llada", (64, 4, 4, 2, 96)), "dream-7b": ("dream", (56, 4, 2, 2, 80))}
# the bf16 tolerance of tests/test_kernel_linear_rows.py, relative to the output's scale
RTOL, ATOL = 1e-2, 1e-2


def products(shape: str, dry_run: bool) -> tuple:
    """(layers, [the four products]) of a released shape (``tracelock.models.shapes.SHAPES``) or its tiny stand-in."""
    from tracelock.models.shapes import SHAPES

    family, (d, heads, kv, layers, mlp) = TINY[shape] if dry_run else SHAPES[shape][:2]
    kv_width, bias = 2 * kv * (d // heads), family == "dream"
    return layers, [dict(name="qkv", N=d + kv_width, K=d, bias=bias), dict(name="o", N=d, K=d, epilogue="residual"),
                    dict(name="gate_up", N=2 * mlp, K=d, epilogue="silu_mul"),
                    dict(name="down", N=d, K=mlp, epilogue="residual")]


class Inputs:
    """x [M, K], the weight [N, K] in ``copies`` copies (cycled by the timing), bias [N] or None, in bf16."""

    def __init__(self, M, N, K, bias, device, dtype, copies):
        g = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(M, K, generator=g, device=device).to(dtype)
        w = (torch.randn(N, K, generator=g, device=device) / K**0.5).to(dtype)
        self.weights = [w] + [w.clone() for _ in range(copies - 1)]
        self.bias = (torch.randn(N, generator=g, device=device) * 0.1).to(dtype) if bias else None

    def residual(self, N_out):
        return torch.randn(self.x.shape[0], N_out, device=self.x.device).to(self.x.dtype)


def weight_copies(weight_bytes: int, device) -> int:
    """Copies of a weight that together exceed twice the L2 cache, so back-to-back calls read it from HBM."""
    if device.type != "cuda":
        return 1
    return max(1, math.ceil(2 * torch.cuda.get_device_properties(device).L2_cache_size / weight_bytes))


def time_rotating(fn, weights, device, calls: int) -> float:
    """Mean seconds per ``fn(w)`` over ``weights`` cycled: ``calls`` launches in one CUDA graph, replayed (eager
    calls on a CPU)."""
    if device.type != "cuda":
        return time_call(lambda: [fn(w) for w in weights], device) / len(weights)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    sync(device)
    return time_call(graph.replay, device, calls=5, warmup=1) / calls


def checked(fn, ref: torch.Tensor) -> dict:
    """``fn()`` against the spec's output: its max abs error, and whether it is within the bf16 tolerance."""
    got = fn()
    err = (got.float() - ref.float()).abs()
    scale = max(ref.float().abs().max().item(), 1.0)
    close = (err <= ATOL * scale + RTOL * ref.float().abs()).all()
    ok = bool(got.shape == ref.shape and got.isfinite().all() and close)
    return dict(max_abs_err=err.max().item(), matches_spec=ok)


def measure(name, fn, inputs, ref, io, device, ctx) -> dict:
    """One variant of a product: checked against the spec, then (only if it matches) timed against the roofline."""
    try:
        row = dict(variant=name, **checked(lambda: fn(inputs.weights[0]), ref))
        if not row["matches_spec"]:
            return dict(row, error="differs from linear_rows_ref; not timed")
        seconds = time_rotating(fn, inputs.weights, device, ctx["calls"])
        # again after hundreds of calls: a split tile's counter left unreset would show here, not in the first call
        row["matches_spec_after_timing"] = checked(lambda: fn(inputs.weights[-1]), ref)["matches_spec"]
        row.update(roofline(io["bytes"], io["flops"], seconds, ctx["bandwidth"], ctx["flop_rate"]))
        if ctx["flop_rate"]:
            row["tensor_peak_share"] = row["tflop_per_s"] * 1e12 / ctx["flop_rate"]
        if ctx.get("copy_gb_per_s"):
            row["copy_share"] = row["gb_per_s"] / ctx["copy_gb_per_s"]
        return row
    except Exception as err:  # recorded in the row; the next variant runs
        return dict(variant=name, error=f"{type(err).__name__}: {err}"[:500])


def io_of(M, N, K, N_out, elt, bias=False, residual=False) -> dict:
    """What a product must move at least (weights once, x, bias, residual, out) and its FLOPs."""
    moved = (N * K + M * K + N * bias + M * N_out * (1 + residual)) * elt
    return dict(bytes=moved, flops=2 * M * N * K)


def _triton_choice() -> str | None:
    from tracelock.kernels.linear_rows import _linear_rows_kernel

    best = getattr(_linear_rows_kernel, "best_config", None)
    return None if best is None else str(best)


def shape_stage(shape, rows, device, ctx) -> dict:
    """cuBLAS and the Triton kernel (autotuned, and each config) at every product of ``shape`` and M; the rows go
    into ``ctx["result"][shape]`` as they are measured, each saved (a run cut off keeps them)."""
    from tracelock.kernels.linear_rows import CONFIGS, linear_rows_triton

    layers, prods = products(shape, ctx["dry_run"])
    out = ctx["result"][shape] = dict(layers=layers, impl=ctx["impl"], table=[], per_step={})
    for p in prods:
        for M in rows:
            inputs = Inputs(M, p["N"], p["K"], p.get("bias", False), device, ctx["dtype"], ctx["copies"](p))
            b = inputs.bias
            ref = linear_rows_ref(inputs.x, inputs.weights[0], b)
            io = io_of(M, p["N"], p["K"], p["N"], inputs.x.element_size(), b is not None)
            row = dict(product=p["name"], M=M, N=p["N"], K=p["K"], bias=b is not None, **io)
            row["cublas"] = measure("cublas", partial(F.linear, inputs.x, bias=b), inputs, ref, io, device, ctx)
            row["triton"] = measure("triton", partial(ops.linear_rows, inputs.x, bias=b, impl=ctx["impl"]), inputs,
                                    ref, io, device, ctx)
            if ctx["impl"] == "triton":
                row["triton"]["config"] = _triton_choice()
                row["each_config"] = [
                    dict(measure(f"cfg{i}", partial(linear_rows_triton, inputs.x, bias=b, config=i), inputs, ref, io,
                                 device, ctx), config=str(c)) for i, c in enumerate(CONFIGS)]
            out["table"].append(row)
            ctx["progress"]()
            log(shape, p["name"], M, {k: row[k].get("seconds", row[k].get("error")) for k in ("cublas", "triton")})
    for M in rows:
        mine = [r for r in out["table"] if r["M"] == M]
        weights = sum(r["N"] * r["K"] for r in mine) * 2
        step = dict(weight_bytes_per_layer=weights)
        for variant in ("cublas", "triton"):
            if all("seconds" in r[variant] for r in mine):
                step[f"{variant}_seconds_per_layer"] = per_layer = sum(r[variant]["seconds"] for r in mine)
                step[f"{variant}_seconds_per_step"] = per_layer * layers
        if ctx["bandwidth"]:
            step["floor_seconds_per_step"] = weights * layers / ctx["bandwidth"]
            for variant in ("cublas", "triton"):
                if f"{variant}_seconds_per_step" in step:
                    step[f"{variant}_over_floor"] = step[f"{variant}_seconds_per_step"] / step["floor_seconds_per_step"]
        out["per_step"][f"M{M}"] = step
    return out


def _linear_add(x, r, w):
    return F.linear(x, w) + r


def _linear_silu_mul(x, w):
    y = F.linear(x, w)
    return F.silu(y[:, : w.shape[0] // 2]) * y[:, w.shape[0] // 2:]


def epilogue_stage(shape, rows, device, ctx) -> dict:
    """Each fused epilogue against cuBLAS plus separate torch ops, at every M."""
    _, prods = products(shape, ctx["dry_run"])
    out = []
    for p in prods:
        epi = "bias" if p.get("bias") else p.get("epilogue")
        if epi is None:
            continue
        for M in rows:
            N_out = p["N"] // 2 if epi == "silu_mul" else p["N"]
            inputs = Inputs(M, p["N"], p["K"], epi == "bias", device, ctx["dtype"], ctx["copies"](p))
            x, b = inputs.x, inputs.bias
            r = inputs.residual(N_out) if epi == "residual" else None
            act = "silu_mul" if epi == "silu_mul" else None
            ref = linear_rows_ref(x, inputs.weights[0], b, r, act)
            io = io_of(M, p["N"], p["K"], N_out, x.element_size(), b is not None, r is not None)
            unfused = {"residual": partial(_linear_add, x, r), "silu_mul": partial(_linear_silu_mul, x),
                       "bias": partial(F.linear, x, bias=b)}[epi]
            row = dict(product=p["name"], epilogue=epi, M=M, N=p["N"], K=p["K"], **io)
            row["cublas_unfused"] = measure("cublas_unfused", unfused, inputs, ref, io, device, ctx)
            fused = partial(ops.linear_rows, x, bias=b, residual=r, activation=act, impl=ctx["impl"])
            row["triton_fused"] = measure("triton_fused", fused, inputs, ref, io, device, ctx)
            if "seconds" in row["cublas_unfused"] and "seconds" in row["triton_fused"]:
                row["fused_speedup"] = row["cublas_unfused"]["seconds"] / row["triton_fused"]["seconds"]
            out.append(row)
            log(shape, p["name"], epi, M, row.get("fused_speedup"))
    return dict(table=out)


def max_autotune_stage(shapes, rows, device, ctx, budget) -> dict:
    """torch.compile's max-autotune of ``F.linear`` at every product and M (one compile each), while the budget lasts;
    in a dry run ``backend="eager"`` at the first product only (the code path, not inductor)."""
    # the largest M first (its share of the tensor peak is the figure asked for), both shapes before a smaller M
    plan = [(shape, p, M) for M in sorted(rows, reverse=True) for shape in shapes
            for p in products(shape, ctx["dry_run"])[1]]
    if ctx["dry_run"]:
        plan = [next(item for item in plan if item[0] == shape) for shape in shapes]
    out = []
    for shape, p, M in plan:
        row = dict(shape=shape, product=p["name"], M=M, N=p["N"], K=p["K"])
        if budget.left() < 30:
            out.append(dict(row, skipped=f"time budget: {budget.left():.0f} s left"))
            continue
        torch._dynamo.reset()
        kw = dict(backend="eager") if ctx["dry_run"] else dict(mode="max-autotune-no-cudagraphs", dynamic=False)
        linear = torch.compile(lambda x, w, b: F.linear(x, w, b), **kw)
        inputs = Inputs(M, p["N"], p["K"], p.get("bias", False), device, ctx["dtype"], ctx["copies"](p))
        x, b = inputs.x, inputs.bias
        io = io_of(M, p["N"], p["K"], p["N"], x.element_size(), b is not None)
        row["max_autotune"] = measure("max_autotune", partial(linear, x, b=b), inputs,
                                      linear_rows_ref(x, inputs.weights[0], b), io, device, ctx)
        out.append(row)
        log("max_autotune", shape, p["name"], M, row["max_autotune"].get("seconds"))
    # the four products' sum per layer where all four were timed (the shape stages' per_step, for this variant)
    per_layer = {}
    for shape in shapes:
        for M in rows:
            mine = [r for r in out if r["shape"] == shape and r["M"] == M and "seconds" in r.get("max_autotune", {})]
            if len(mine) == len(products(shape, ctx["dry_run"])[1]):
                per_layer[f"{shape}-M{M}"] = sum(r["max_autotune"]["seconds"] for r in mine)
    return dict(table=out, seconds_per_layer=per_layer)


def copy_stage(device, bandwidth) -> dict:
    """A device-to-device copy of 1 GiB (read + write), the bandwidth a kernel can hope for (a CPU: 16 MiB)."""
    n = (1 << 30 if device.type == "cuda" else 1 << 24) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device)
    out = dict(bytes=4 * n, seconds=seconds, gb_per_s=4 * n / seconds / 1e9)
    if bandwidth:
        out["datasheet_share"] = out["gb_per_s"] * 1e9 / bandwidth
    return out


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the JSON (created)")
    parser.add_argument("--shapes", nargs="+", default=["llada-8b", "dream-7b"], choices=["llada-8b", "dream-7b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32], help="M, the rows per call (1 8 32)")
    parser.add_argument("--calls", type=int, default=50, help="launches per captured graph (50)")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds the stages may take; a stage that needs more than is left is skipped (300)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (default: off)")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU")
    from tracelock import _triton

    budget = Budget(args.budget)
    device = torch.device("cuda" if not args.dry_run else "cpu")
    card, bandwidth, flop_rate = ceilings(device)
    dtype = torch.bfloat16
    impl = "triton" if device.type == "cuda" or _triton.triton_interpret else "torch"
    ctx = dict(dry_run=args.dry_run, impl=impl, dtype=dtype, calls=args.calls, bandwidth=bandwidth,
               flop_rate=flop_rate, copies=lambda p: weight_copies(p["N"] * p["K"] * 2, device))
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else
                  platform.processor() or platform.machine(), card=card, bandwidth=bandwidth, bf16_peak=flop_rate,
                  torch=torch.__version__, triton=_triton.triton_version, git_sha=git_sha(), impl=impl,
                  dtype=str(dtype), rows=args.rows, calls_per_graph=args.calls, budget_seconds=args.budget,
                  timing="CUDA graph of back-to-back calls, weights cycled past L2" if device.type == "cuda" else
                  "eager (CPU dry run)")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        result.update(sm_count=props.multi_processor_count, l2_bytes=props.L2_cache_size)
    path = Path(args.out) / f"gpu-gemm{'-dry-run' if args.dry_run else ''}.json"

    def save():
        atomic_write_text(path, json.dumps(result, indent=2, default=str) + "\n")

    save()
    ctx.update(result=result, progress=lambda: (save(), bundle_from_env()))
    run_stage(result, "copy", lambda: copy_stage(device, bandwidth), save, budget, 5)
    ctx["copy_gb_per_s"] = result["copy"].get("gb_per_s")
    for shape in args.shapes:
        run_stage(result, shape, lambda s=shape: shape_stage(s, args.rows, device, ctx), save, budget, 40)
    for shape in args.shapes:
        run_stage(result, f"{shape}-epilogues", lambda s=shape: epilogue_stage(s, args.rows, device, ctx), save,
                  budget, 20)
    run_stage(result, "max_autotune", lambda: max_autotune_stage(args.shapes, args.rows, device, ctx, budget), save,
              budget, 30)
    log("wrote", path)
    return result


if __name__ == "__main__":
    main()
