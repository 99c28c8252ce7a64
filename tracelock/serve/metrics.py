"""The server's counters and gauges, rendered in Prometheus' text exposition format (version 0.0.4).

Written by two threads (the event loop counts requests, the decode thread counts steps), so every update and the
rendering take one lock. Metric names carry the ``tracelock_`` prefix and Prometheus' unit suffixes.
"""

import threading

# upper bounds (seconds) of the step-time histogram: a testbed step on a CPU is ~1-50 ms, an 8B step on a GPU ~5-100
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_HELP = {
    "requests_total": ("counter", "Requests answered, by endpoint and outcome (ok; error: a 4xx or a failed decode; "
                                  "refused: 429 or 503, the server full or shutting down; cancelled: the client "
                                  "went away)."),
    "prompt_tokens_total": ("counter", "Prompt tokens of the requests that were decoded."),
    "generated_tokens_total": ("counter", "Completion tokens sent (after end tokens, stop strings and max_tokens)."),
    "decode_steps_total": ("counter", "Decode steps run (one step advances every live row of one engine)."),
    "row_steps_total": ("counter", "Rows advanced, summed over steps (row_steps / steps = mean rows per step)."),
    "requests_running": ("gauge", "Requests holding a batch slot now."),
    "requests_waiting": ("gauge", "Requests waiting for a batch slot."),
    "batch_capacity": ("gauge", "Rows the decode thread may run at once (--max-batch)."),
    "batch_occupancy": ("gauge", "requests_running / batch_capacity."),
    "engines": ("gauge", "Decode engines allocated (one per decode setting and prompt bucket in use)."),
    "engines_built_total": ("counter", "Decode engines built (an idle engine of the same shape is reused instead)."),
    "step_cpu_seconds_total": ("counter", "CPU time of the decode thread in steps (its own torch threads only)."),
    "step_failures_total": ("counter", "Engine steps that raised (their rows start again, each alone)."),
    "step_seconds": ("histogram", "Wall time of one engine step."),
}


def _labels(labels: dict) -> str:
    return "" if not labels else "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class Metrics:
    """See the module docstring. ``inc``/``set`` take a metric name of `_HELP` and optional labels."""

    def __init__(self, capacity: int):
        self._lock = threading.Lock()
        self._values = {}  # (name, labels tuple) -> value
        self._buckets = [0] * (len(STEP_BUCKETS) + 1)  # the last one is +Inf
        self._step_sum = 0.0
        self.set("batch_capacity", capacity)
        for name in ("requests_running", "requests_waiting", "batch_occupancy", "engines", "prompt_tokens_total",
                     "generated_tokens_total", "decode_steps_total", "row_steps_total", "step_cpu_seconds_total",
                     "step_failures_total", "engines_built_total"):
            self.set(name, 0)
        self._capacity = capacity

    def inc(self, name: str, amount: float = 1, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self._values[(name, tuple(sorted(labels.items())))] = value

    def get(self, name: str, **labels) -> float:
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0)

    def set_batch(self, running: int, waiting: int, engines: int) -> None:
        with self._lock:
            self._values[("requests_running", ())] = running
            self._values[("requests_waiting", ())] = waiting
            self._values[("engines", ())] = engines
            self._values[("batch_occupancy", ())] = running / self._capacity

    def observe_step(self, seconds: float, rows: int, cpu_seconds: float = 0.0) -> None:
        with self._lock:
            key = ("step_cpu_seconds_total", ())
            self._values[key] = self._values.get(key, 0) + cpu_seconds
            for i, bound in enumerate(STEP_BUCKETS):
                if seconds <= bound:
                    self._buckets[i] += 1
                    break
            else:
                self._buckets[-1] += 1
            self._step_sum += seconds
            self._values[("decode_steps_total", ())] = self._values.get(("decode_steps_total", ()), 0) + 1
            self._values[("row_steps_total", ())] = self._values.get(("row_steps_total", ()), 0) + rows

    def render(self) -> str:
        """Every metric in Prometheus' text format."""
        with self._lock:
            values, buckets, step_sum = dict(self._values), list(self._buckets), self._step_sum
        lines = []
        for name, (kind, text) in _HELP.items():
            full = f"tracelock_{name}"
            lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}"]
            if kind == "histogram":
                total = 0
                for bound, count in zip([*map(str, STEP_BUCKETS), "+Inf"], buckets):
                    total += count
                    lines.append(f'{full}_bucket{{le="{bound}"}} {total}')
                lines += [f"{full}_sum {step_sum}", f"{full}_count {total}"]
                continue
            for (key, labels), value in sorted(values.items()):
                if key == name:
                    lines.append(f"{full}{_labels(dict(labels))} {value}")
        return "\n".join(lines) + "\n"
