"""The fused backbone on the CPU, before and after, in one run: the bundled models (testbed, testbed-dream), the
eager loop and the compiled engine, B = 1 (one prompt at a time) and B = n (one batch), Fast-dLLM's threshold 0.9
with the dual cache, gen 64 in blocks of 16, one thread.

``before`` is the source tree of the commit before the backbone was fused (`BEFORE`, exported with ``git archive``
under .pytest_cache, its kernels folder linked in as ``tracelock.kernels`` and this checkout's C++ extension copied
in: csrc is unchanged between the two), ``after`` this checkout; each runs in a worker process of its own
(bench/backbone_worker.py). Before timing, both decode once and their tokens must be equal. Rounds are timed through
the worker's pipe (wall clock); ``extra_info`` holds each round's process CPU time (its median is the number to read
on a shared machine). The smoke run (no ``--benchmark``) checks one cell; the others need ``--benchmark``.
"""

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "9025a21"  # the parent of f346723, "backbone step fused"
WORKER = Path(__file__).with_name("backbone_worker.py")


@pytest.fixture(scope="session")
def trees(request) -> dict:
    """{"before": the exported tree, "after": this checkout}."""
    folder = Path(request.config.cache.mkdir(f"backbone-before-{BEFORE}"))
    if not (folder / "tracelock" / "__init__.py").exists():
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE], capture_output=True)
        if archive.returncode:
            pytest.skip(f"git archive {BEFORE} failed (not a git checkout?): {archive.stderr[-300:]!r}")
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
        (folder / "tracelock" / "kernels").symlink_to(folder / "kernels")
        for ext in (ROOT / "tracelock").glob("_C*.so"):
            shutil.copy2(ext, folder / "tracelock" / ext.name)
    return {"before": str(folder), "after": str(ROOT)}


class Worker:
    def __init__(self, tree: str, model: str, batch: int, items: int, compiled: bool):
        argv = [sys.executable, str(WORKER), "--tree", tree, "--model", model, "--batch", str(batch), "--items",
                str(items)] + (["--compiled"] if compiled else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree)
        self.ready = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker ended (rc {self.proc.wait()})")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


CELLS = [(m, c, b) for m in ("testbed", "testbed-dream") for c in (False, True) for b in ("B1", "Bn")]


@pytest.mark.parametrize("tree", ["before", "after"])
@pytest.mark.parametrize("model,compiled,batch", CELLS,
                         ids=[f"{m}-{'compiled' if c else 'eager'}-{b}" for m, c, b in CELLS])
def test_fused_backbone(request, benchmark, machine, trees, model, compiled, batch, tree):
    if benchmark.disabled and (model, compiled, batch, tree) != ("testbed", False, "B1", "after"):
        pytest.skip("the smoke run checks one cell (before and after); the others run with --benchmark")
    items = request.config.getoption("--bench-items") if not benchmark.disabled else 2
    B = 1 if batch == "B1" else items
    ours = Worker(trees[tree], model, B, items, compiled)
    other = Worker(trees["after" if tree == "before" else "before"], model, B, items, compiled)
    try:
        for w, name in ((ours, tree), (other, "after" if tree == "before" else "before")):  # each imports its tree
            assert Path(w.ready["tracelock"]).resolve().is_relative_to(Path(trees[name]).resolve()), w.ready
        # check before timing: both trees decode the same tokens with the same steps
        mine, theirs = ours.ask("check"), other.ask("check")
        other.close()
        assert (mine["sha256"], mine["steps"]) == (theirs["sha256"], theirs["steps"]), (tree, model, batch)
        if benchmark.disabled:
            return
        cpu = []

        def round_():
            cpu.append(ours.ask("round")["cpu_seconds"])

        benchmark.group = f"fused-backbone-{model}-{'compiled' if compiled else 'eager'}-B{B}-gen64-block16"
        benchmark.pedantic(round_, rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1)
        benchmark.extra_info.update(machine, tree=tree, commit=BEFORE if tree == "before" else machine.get("git"),
                                    items=items, batch=B, compiled=compiled, first_call_seconds=mine["seconds"],
                                    cpu_seconds_per_round=cpu, cpu_seconds_per_item=statistics.median(cpu) / items,
                                    mean_steps=sum(mine["steps"]) / len(mine["steps"]))
    finally:
        for w in (ours, other):
            if w.proc.poll() is None:
                w.proc.kill()
