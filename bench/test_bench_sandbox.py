"""The sandbox (`tracelock.sandbox`): what one sandboxed run costs over a plain subprocess of the same interpreter
(group ``sandbox-run``), and what `check_many`'s workers buy (``sandbox-check-many``): four jobs that each sleep
0.5 s (concurrency alone; 4 workers ideally 4x) and HumanEval's first 32 canonical solutions (CPU-bound: at most the
machine's cores). tests/test_sandbox.py checks the behaviour (statuses, limits, the jobs all running at once); the
seconds are measured here, not asserted. Each row checks its results before it times; without --benchmark that
checked run is all. extra_info: the isolation this machine permits, ``overhead_seconds`` (sandboxed minus plain,
medians) and ``speedup`` (the 1-worker row's median over this row's).
"""

import subprocess
import sys

import pytest

from tracelock import sandbox
from tracelock.eval.humaneval import humaneval_run_many, load_problems

SOURCE = "print('hello')"
SLEEP_JOBS = [(f"import time\ndef f():\n    time.sleep(0.5)\n    return {i}\n",
               f"def check(candidate):\n    assert candidate() == {i}\n", "f") for i in range(4)]
HUMANEVAL_ITEMS = 32
MEDIANS = {}  # (group, baseline row) -> median seconds, for the rows after it


def _plain():
    # the sandbox's own interpreter flags (-S -s -B -P), no limits, namespaces or scrubbed environment
    return subprocess.run([sys.executable, "-S", "-s", "-B", "-P", "-c", SOURCE], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("row", ["plain", "sandboxed"])
def test_run(benchmark, machine, row):
    run = _plain if row == "plain" else lambda: sandbox.run_python(SOURCE)
    features = sandbox.probe_isolation()
    # check before timing: the program ran and said hello
    done = run()
    assert (done.returncode, done.stdout) == (0, "hello\n"), done.stderr
    benchmark.group = "sandbox-run"
    benchmark.extra_info.update(machine, row=row, isolation=features if row == "sandboxed" else None)
    if benchmark.disabled:
        return  # smoke run: the checked run above was this very call; --benchmark times it
    benchmark.pedantic(run, rounds=20, warmup_rounds=1)
    median = benchmark.stats.stats.median
    if row == "plain":
        MEDIANS["run", "plain"] = median
    elif MEDIANS.get(("run", "plain")):
        benchmark.extra_info.update(overhead_seconds=median - MEDIANS["run", "plain"])


CHECK_MANY = [("sleep-4x0.5s", 1), ("sleep-4x0.5s", 4), (f"humaneval-{HUMANEVAL_ITEMS}", 1),
              (f"humaneval-{HUMANEVAL_ITEMS}", 2)]


@pytest.mark.parametrize("jobs,workers", CHECK_MANY, ids=[f"{j}-workers{w}" for j, w in CHECK_MANY])
def test_check_many(benchmark, machine, jobs, workers):
    if jobs.startswith("sleep"):
        def run():
            return sandbox.check_many(SLEEP_JOBS, workers=workers)
    else:
        problems = load_problems()[:HUMANEVAL_ITEMS]

        def run():
            return humaneval_run_many(problems, [p["canonical_solution"] for p in problems], workers=workers)
    # check before timing: every job passed its tests
    results = run()
    assert [r.status for r in results] == ["ok"] * len(results), [r.stderr for r in results if r.status != "ok"]
    benchmark.group = f"sandbox-check-many-{jobs}"
    benchmark.extra_info.update(machine, jobs=jobs, count=len(results), workers=workers,
                                isolation=sandbox.probe_isolation())
    if benchmark.disabled:
        return  # smoke run: the checked run above was this very call; --benchmark times it
    benchmark.pedantic(run, rounds=3, warmup_rounds=0)  # the checked run above was the warm-up
    median = benchmark.stats.stats.median
    if workers == 1:
        MEDIANS[jobs, 1] = median
    elif MEDIANS.get((jobs, 1)):
        benchmark.extra_info.update(speedup=MEDIANS[jobs, 1] / median)
