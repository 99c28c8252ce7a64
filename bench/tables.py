"""Markdown tables from one `pytest bench/ --benchmark --benchmark-json=FILE` run (ratios within that run only).

usage: python bench/tables.py FILE
"""

import json
import sys


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def _ms2(seconds: float) -> str:
    """Two decimals under 10 ms (the loop's per-step times)."""
    return f"{seconds * 1e3:,.2f} ms" if seconds < 0.01 else _ms(seconds)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rows(benchmarks: list, prefix: str) -> list:
    return [b for b in benchmarks if b["group"].startswith(prefix)]


def decode_table(benchmarks: list) -> list:
    """One row per policy: fused and reference seconds per sample, their ratio, steps, tokens/s, the metric."""
    by_policy = {}
    for b in _rows(benchmarks, "decode-"):
        by_policy.setdefault(b["extra_info"]["policy"], {})[b["extra_info"]["runner"]] = b
    lines = ["| policy | schedule | fused s/sample | reference s/sample | reference / fused | mean steps | "
             "tokens/s (fused) | metric |", "|---|---|---|---|---|---|---|---|"]
    for policy, runs in by_policy.items():
        fused, ref = runs.get("fused"), runs.get("reference")
        info = (fused or ref)["extra_info"]
        n = info["items"]
        f_med = fused["stats"]["median"] if fused else None
        r_med = ref["stats"]["median"] if ref else None
        lines.append(
            f"| {policy} | {info['schedule']} {info['width']} | {_ms(f_med / n) if f_med else '-'} | "
            f"{_ms(r_med / n) if r_med else '-'} | {f'{r_med / f_med:.2f}x' if f_med and r_med else '-'} | "
            f"{info['mean_steps']:.1f} | {_fmt(info['gen_tokens'] / f_med if f_med else None, ',.1f')} | "
            f"{_fmt(info['metric'], '.1%')} |")
    return lines if len(lines) > 2 else []


def step_table(benchmarks: list) -> list:
    rows = {b["extra_info"]["row"]: b for b in _rows(benchmarks, "step-")}
    if not {"bare-forward", "tracelock"} <= set(rows):
        return []
    n = rows["tracelock"]["extra_info"]["forwards"]
    bare, step = rows["bare-forward"]["stats"]["median"] / n, rows["tracelock"]["stats"]["median"] / n
    return [f"| per step (forwards: {n}) | bare forward | TraceLock step | TraceLock / bare |",
            "|---|---|---|---|", f"| median | {_ms(bare)} | {_ms(step)} | {step / bare:.2f}x |"]


def kernel_table(benchmarks: list) -> list:
    lines = ["| op and shape | impl | median | GB/s | TFLOP/s | share of ceiling (bytes / FLOPs) |",
             "|---|---|---|---|---|---|"]
    for b in sorted((b for b in benchmarks if b["group"].split("-")[0] in
                     ("window_logits_stats", "tap_project", "commit_step")), key=lambda b: (b["group"], b["name"])):
        i = b["extra_info"]
        share = (f"{i['bandwidth_share']:.0%} / {i['flop_share']:.0%}" if "bandwidth_share" in i else "-")
        lines.append(f"| {b['group']} | {i['impl']} | {_ms(b['stats']['median'])} | "
                     f"{_fmt(i.get('gb_per_s'), ',.1f')} | {_fmt(i.get('tflop_per_s'), ',.3f')} | {share} |")
    return lines if len(lines) > 2 else []


def store_table(benchmarks: list) -> list:
    lines = ["| store | traces | bytes per trace | reference release / this | read all back |", "|---|---|---|---|---|"]
    for b in _rows(benchmarks, "trace-store"):
        i = b["extra_info"]
        lines.append(f"| {i['store']} | {i['traces']} | {i['bytes_per_trace']:,.0f} | "
                     f"{i['reference_release_ratio']:,.0f}x | {_ms(b['stats']['median'])} |")
    return lines if len(lines) > 2 else []


def cache_table(benchmarks: list) -> list:
    """One row per (policy, cache): seconds per sample, the uncached row / this, steps, refreshes, the metric."""
    rows = [(b["extra_info"], b["stats"]["median"]) for b in _rows(benchmarks, "cache-")]
    plain = {i["policy"]: t for i, t in rows if i["cache"] == "none"}
    lines = ["| policy | cache | s/sample | no cache / this | mean steps | mean refreshes | tokens/s | metric |",
             "|---|---|---|---|---|---|---|---|"]
    for i, t in rows:
        speedup = plain.get(i["policy"])
        lines.append(f"| {i['policy']} | {i['cache']} | {_ms(t / i['items'])} | "
                     f"{f'{speedup / t:.2f}x' if speedup else '-'} | {i['mean_steps']:.1f} | "
                     f"{i['mean_refreshes']:.1f} | {i['gen_tokens'] / t:,.1f} | {_fmt(i['metric'], '.1%')} |")
    return lines if len(lines) > 2 else []


def throughput_table(benchmarks: list) -> list:
    lines = ["| throughput | prompts | batch size | batches | padding | tokens/s |", "|---|---|---|---|---|---|"]
    for b in _rows(benchmarks, "throughput-"):
        i = b["extra_info"]
        lines.append(f"| {i['policy']} + {i['cache']} cache | {i['prompts']} | {i['batch_size']} | {i['batches']} | "
                     f"{i['padding']:.0%} | {i['tokens'] / b['stats']['median']:,.1f} |")
    return lines if len(lines) > 2 else []


PEER_ROWS = ["fastdllm", "tracelock-eager-B1", "tracelock-compiled-B1", "tracelock-eager-B", "tracelock-compiled-B"]


def peer_table(benchmarks: list) -> list:
    """One row per (rule, row) of test_bench_peers.py: time per item, Fast-dLLM / this, steps (NFE for Fast-dLLM),
    the agreement with tracelock's eager tokens, the first call (compiles for the compiled rows)."""
    groups = {}
    for b in _rows(benchmarks, "peer-"):
        groups.setdefault(b["group"], []).append(b)
    lines = ["| rule | row | s/item | Fast-dLLM / this | mean steps (NFE) | equal tokens | first call (wall) |",
             "|---|---|---|---|---|---|---|"]
    for rows in groups.values():
        rows.sort(key=lambda b: next(i for i, r in enumerate(PEER_ROWS) if b["extra_info"]["row"].startswith(r)))
        peer = next((b for b in rows if b["extra_info"]["row"] == "fastdllm"), None)
        for b in rows:
            i, t = b["extra_info"], b["stats"]["median"] / b["extra_info"]["items"]
            ratio = f"{peer['stats']['median'] / peer['extra_info']['items'] / t:.2f}x" if peer else "-"
            lines.append(f"| {i['rule']} | {i['row']} | {_ms2(t)} | {ratio} | {_fmt(i['mean_steps'], '.1f')} | "
                         f"{i['agreement']:.1%} | {_ms(i['first_call_seconds'])} |")
    return lines if len(lines) > 2 else []


def loop_table(benchmarks: list) -> list:
    """The loop's own cost per step (test_bench_loop.py, micro backbone): eager vs compiled per rule and batch."""
    groups = {}
    for b in _rows(benchmarks, "loop-micro-"):
        groups.setdefault(b["group"], {})[b["extra_info"]["loop"]] = b
    lines = ["| rule | batch | forwards | eager loop per step | compiled per step | eager / compiled |",
             "|---|---|---|---|---|---|"]
    for runs in groups.values():
        eager, compiled = runs.get("eager"), runs.get("compiled")
        i = (eager or compiled)["extra_info"]
        per = {k: b["stats"]["median"] / i["forwards"] for k, b in runs.items()}
        ratio = f"{per['eager'] / per['compiled']:.2f}x" if len(per) == 2 else "-"
        lines.append(f"| {i['rule']} | {i['items']} | {i['forwards']} | {_ms2(per['eager']) if eager else '-'} | "
                     f"{_ms2(per['compiled']) if compiled else '-'} | {ratio} |")
    return lines if len(lines) > 2 else []


def main(path: str) -> None:
    data = json.load(open(path))
    benchmarks = data["benchmarks"]
    info = next((b["extra_info"] for b in benchmarks if "machine" in b["extra_info"]), {})
    print(f"Machine: {info.get('gpu') or info.get('machine')} ({info.get('cpus')} CPUs, {info.get('threads')} "
          f"threads), torch {info.get('torch')}, triton {info.get('triton')}, git {info.get('git')}, "
          f"{data.get('datetime', '')[:10]}\n")
    for table in (decode_table, step_table, kernel_table, store_table, cache_table, throughput_table, peer_table,
                  loop_table):
        lines = table(benchmarks)
        if lines:
            print("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
