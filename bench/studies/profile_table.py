"""A torch.profiler trace of one decode step as a table: per kernel its time, calls, the bytes its launching op reads
where they follow from the recorded inputs, GB/s and shares; and the same as markdown (bench/studies/gpu_step.py)."""

from collections import defaultdict

# bytes per element of the dtype names torch.profiler records
DTYPE_BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "long int": 8, "int": 4, "bool": 1,
               "unsigned char": 1, "signed char": 1, "short int": 2}
# ops whose bytes are their tensor inputs': matrix products and attention (what a decode step reads is weights,
# the KV cache and activations; outputs of these ops are small next to their inputs at decode shapes)
READ_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product",
            "aten::_flash_attention", "aten::_efficient_attention", "aten::_scaled_mm", "aten::_weight_int8pack_mm")
TOP_ROWS = 25


def input_bytes(evt, default_size: int = 2) -> int | None:
    """Bytes of an op's tensor inputs from the profiler's recorded shapes and dtypes (a torch whose events carry no
    dtypes: ``default_size`` bytes each, the model's dtype, as a matrix product's and attention's inputs are); None
    when the shapes were not recorded."""
    shapes = getattr(evt, "input_shapes", None)
    if not shapes:
        return None
    dtypes = getattr(evt, "input_dtypes", None) or []
    if len(dtypes) != len(shapes):
        dtypes = [None] * len(shapes)
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        if isinstance(shape, list | tuple) and shape and all(isinstance(n, int) for n in shape):
            if dtype is not None and dtype not in DTYPE_BYTES:
                return None
            numel = 1
            for n in shape:
                numel *= n
            total += numel * (default_size if dtype is None else DTYPE_BYTES[dtype])
    return total


def kernel_rows(events, known_bytes: dict, default_size: int = 2) -> tuple[list, str]:
    """([row per kernel name], what a row is): the device kernels of a profile (CUDA), else its CPU leaf ops (a dry
    run). Each row: name, calls, seconds, bytes (None where not derivable: every call must be the longest kernel of
    a ``READ_OPS`` op with recorded inputs, or the name must contain a key of ``known_bytes``), ops (launching ops).
    ``default_size``: bytes per input element where the profiler recorded no dtypes (`input_bytes`)."""
    from torch.autograd import DeviceType

    device = [e for e in events if e.device_type == DeviceType.CUDA]
    rows = defaultdict(lambda: dict(calls=0, seconds=0.0, bytes=0, bytes_calls=0, ops=set()))
    if device:
        for e in device:
            row = rows[e.name]
            row["calls"] += 1
            row["seconds"] += e.time_range.elapsed_us() / 1e6
        # the op that launched each kernel: the CPU event the profiler hands the kernel to
        for e in events:
            if e.device_type != DeviceType.CPU or not getattr(e, "kernels", None):
                continue
            op_bytes = input_bytes(e, default_size) if e.name.startswith(READ_OPS) else None
            # an op of several kernels (a split-K GEMM and its reduction) reads its inputs in its longest one
            main = max(e.kernels, key=lambda k: k.duration)
            for k in e.kernels:
                if k.name in rows:
                    rows[k.name]["ops"].add(e.name)
            if op_bytes is not None and main.name in rows:
                rows[main.name]["bytes"] += op_bytes
                rows[main.name]["bytes_calls"] += 1
        what = "CUDA kernels"
    else:
        for e in events:  # every op's own time (its children's not counted): they sum to the step's CPU time
            if e.device_type == DeviceType.CPU and not e.is_async and e.name.startswith("aten::"):
                row = rows[e.name]
                row["calls"] += 1
                row["seconds"] += e.self_cpu_time_total / 1e6
                op_bytes = input_bytes(e, default_size) if e.name.startswith(READ_OPS) else None
                if op_bytes is not None:
                    row["bytes"] += op_bytes
                    row["bytes_calls"] += 1
                row["ops"].add(e.name)
        what = "CPU aten ops, self time (dry run)"
    out = []
    for name, row in rows.items():
        known = next((b for key, b in known_bytes.items() if key in name), None)
        if known is not None:
            nbytes = known * row["calls"]
        else:
            nbytes = row["bytes"] if row["bytes_calls"] == row["calls"] else None
        out.append(dict(name=name, calls=row["calls"], seconds=row["seconds"], bytes=nbytes, ops=sorted(row["ops"])))
    out.sort(key=lambda r: -r["seconds"])
    return out, what


def kernel_table(rows: list, bandwidth: float | None, top: int = TOP_ROWS) -> dict:
    """The profile's summary and its top ``top`` rows with GB/s and shares; the rest folded into one row."""
    total = sum(r["seconds"] for r in rows) or 1e-30
    table = []
    for r in rows:
        gbs = r["bytes"] / r["seconds"] / 1e9 if r["bytes"] and r["seconds"] > 0 else None
        table.append(dict(r, share_of_step=r["seconds"] / total, gb_per_s=gbs,
                          bandwidth_share=gbs * 1e9 / bandwidth if gbs and bandwidth else None))
    rest = table[top:]
    table = table[:top]
    if rest:
        table.append(dict(name=f"other ({len(rest)} kernels)", calls=sum(r["calls"] for r in rest),
                          seconds=sum(r["seconds"] for r in rest), bytes=None, ops=[],
                          share_of_step=sum(r["share_of_step"] for r in rest), gb_per_s=None, bandwidth_share=None))
    known = [r for r in rows if r["bytes"]]
    return dict(kernel_seconds=sum(r["seconds"] for r in rows), launches=sum(r["calls"] for r in rows),
                distinct=len(rows), bytes_known=sum(r["bytes"] for r in known),
                seconds_with_bytes=sum(r["seconds"] for r in known), table=table)


def markdown(title: str, summary: dict) -> str:
    """A profile's table as markdown."""
    def fmt(x, spec):
        return "" if x is None else format(x, spec)

    lines = [f"### {title}", "",
             f"{summary['rows']}: {summary['kernel_seconds'] * 1e3:.3f} ms in {summary['launches']} calls of "
             f"{summary['distinct']} names; the step's wall time under the profiler "
             f"{summary['wall_seconds'] * 1e3:.3f} ms",
             "", "| kernel | calls | ms | share of kernel time | MB read | GB/s | share of bandwidth | launched by |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary["table"]:
        name = r["name"] if len(r["name"]) <= 70 else r["name"][:67] + "..."
        mb = fmt(r["bytes"] / 1e6 if r["bytes"] else None, ".1f")
        lines.append(f"| `{name}` | {r['calls']} | {r['seconds'] * 1e3:.3f} | {r['share_of_step']:.1%} | {mb} | "
                     f"{fmt(r['gb_per_s'], '.0f')} | {fmt(r['bandwidth_share'], '.0%')} | {', '.join(r['ops'][:2])} |")
    return "\n".join(lines) + "\n"
