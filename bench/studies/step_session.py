"""The GPU session of the fused backbone step, in one command that cannot lose what it measured
(bench/studies/gpu_step_session.sh runs it on the device; ``--dry-run`` on a CPU at tiny shapes).

Every stage writes under a work folder outside ``--out``; after every stage, and after every cell a measuring script
saves (`gpu_stages.run_stage`), the whole folder is packed into ``<out>/session.tar.gz`` (written beside it, then
renamed: a kill at any moment leaves the last archive whole). ``<out>`` holds three files: the archive,
``session.json`` (each stage's status, seconds, exit code) and ``session.log`` (the console). Stages, in order, each
under its own timeout, none started when the session's budget cannot fit its minimum:

======================  ======  ==========================================================================
stage                   budget  what
======================  ======  ==========================================================================
install                 30 s    the package (no extension) and the peer's einops, from wheels; skipped when importable
machine                 25 s    versions, the GPU, ``tracelock env`` (every Triton kernel's self-check, natively)
kernel-tests            120 s   tests/test_kernel_*.py natively, one pytest per file, each file's JUnit report kept
backbone                140 s   gpu_backbone.py at LLaDA-8B: the floor with the KV reads, each variant checked
                                against the torch spec before it is timed, the choice of the CUDA default
race                    110 s   gpu_race.py at LLaDA-8B: Fast-dLLM's own dual-cache code against the engine, k 2, 4
gemm                    50 s    gpu_gemm.py at LLaDA-8B: cuBLAS, the Triton weight-streaming product, max-autotune
======================  ======  ==========================================================================

475 s in all, under the device's 600 s per command with room for the machine's start-up of the tools.

    python bench/studies/step_session.py --out DIR [--work DIR] [--peer DIR] [--budget 480] [--dry-run]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_stages import bundle  # noqa: E402  (bench/studies/gpu_stages.py: no tracelock import)

ROOT = Path(__file__).resolve().parents[2]
STUDIES = Path(__file__).resolve().parent
# (stage, budget seconds, the least it may start with)
STAGES = [("install", 30, 10), ("machine", 25, 5), ("kernel-tests", 120, 20), ("backbone", 140, 40),
          ("race", 110, 30), ("gemm", 50, 15)]
BUDGET = 480
# the kernels the backbone and the head run first (a file cut off by the stage's end loses only the rest)
FIRST = ["add_rms_norm", "rope_qkv", "silu_mul", "linear_rows", "window_stats", "commit_step", "tap_project"]
PER_FILE = 45


class Session:
    """The work folder, the archive, the log, and each stage's record."""

    def __init__(self, out: Path, work: Path, budget: float):
        self.out, self.work, self.end = out, work, time.monotonic() + budget
        out.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "session.log", "a", buffering=1)
        self.record = dict(budget_seconds=budget, started=time.strftime("%Y-%m-%d %H:%M:%S"), stages={})
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                        SESSION_WORK=str(work), SESSION_ARCHIVE=str(out / "session.tar.gz"))

    def left(self) -> float:
        return self.end - time.monotonic()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def save(self) -> None:
        text = json.dumps(self.record, indent=2) + "\n"
        (self.work / "session.json").write_text(text)
        tmp = self.out / ".session.json.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.out / "session.json")
        bundle(self.work, self.out / "session.tar.gz")

    def run(self, argv: list, timeout: float, out_file: Path, env: dict | None = None) -> dict:
        """``argv`` with its output in ``out_file`` (then the log), killed at ``timeout`` seconds. It stays in the
        session's process group: whatever kills the session kills it too."""
        start = time.monotonic()
        with open(out_file, "w") as sink:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env or self.env, stdout=sink, stderr=subprocess.STDOUT,
                                    text=True)
            try:
                rc, timed_out = proc.wait(timeout=timeout), False
            except subprocess.TimeoutExpired:
                proc.kill()
                rc, timed_out = proc.wait(), True
        text = out_file.read_text(errors="replace")
        self.log.write(text)
        print(text[-3000:], end="", flush=True)
        return dict(rc=rc, seconds=round(time.monotonic() - start, 1), timed_out=timed_out)


def install(s: Session, args, timeout: float) -> dict:
    if args.dry_run:
        return dict(skipped="dry run: the package is installed here")
    done = {}
    ok = subprocess.run([sys.executable, "-c", "import tracelock.kernels"], cwd=ROOT).returncode == 0
    if not ok:
        env = dict(s.env, TRACELOCK_BUILD_EXT="0")
        done["package"] = s.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                                 "--no-index", "-e", "."], timeout * 0.6, s.work / "pip-package.txt", env)
    wheels = ROOT / "bench" / ".peers" / "wheels"
    if args.peer and wheels.is_dir() and subprocess.run([sys.executable, "-c", "import einops"]).returncode:
        done["einops"] = s.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                                str(wheels), "einops"], max(5.0, timeout * 0.3), s.work / "pip-einops.txt")
    return done or dict(skipped="already importable")


def machine(s: Session, args, timeout: float) -> dict:
    folder = s.work / "machine"
    folder.mkdir(exist_ok=True)
    probe = ("import sys, torch; print(sys.version.split()[0], torch.__version__, "
             "torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')")
    out = dict(versions=s.run([sys.executable, "-c", probe], timeout / 3, folder / "versions.txt"))
    if shutil.which("nvidia-smi"):
        out["gpu"] = s.run(["nvidia-smi", "-L"], 5, folder / "nvidia-smi.txt")
    out["env"] = s.run([sys.executable, "-m", "tracelock", "env"], timeout * 2 / 3, folder / "tracelock-env.txt")
    return out


def kernel_files(dry_run: bool) -> list:
    found = {p.stem.removeprefix("test_kernel_"): p for p in sorted((ROOT / "tests").glob("test_kernel_*.py"))}
    order = [n for n in FIRST if n in found] + [n for n in found if n not in FIRST]
    return [found[n] for n in (order[:2] if dry_run else order)]


def kernel_tests(s: Session, args, timeout: float) -> dict:
    """One pytest per kernel test file, its JUnit report and output kept and bundled as it finishes."""
    folder = s.work / "kernel-tests"
    folder.mkdir(exist_ok=True)
    end, out = time.monotonic() + timeout, {}
    env = dict(s.env, TRACELOCK_SKIP_AUTOTUNE="1")
    if not args.dry_run:
        env.pop("TRITON_INTERPRET", None)
    for path in kernel_files(args.dry_run):
        left = end - time.monotonic()
        if left < 5:
            out[path.name] = dict(skipped=f"stage budget: {left:.0f} s left")
            continue
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={folder / path.stem}.xml",
                str(path.relative_to(ROOT))] + (["-k", "matches", "-x"] if args.dry_run else [])
        out[path.name] = s.run(argv, min(left, PER_FILE), folder / f"{path.stem}.txt", env)
        s.record["stages"]["kernel-tests"] = dict(files=out)
        s.save()
    return dict(files=out)


def study(script: str, extra: list):
    def stage(s: Session, args, timeout: float) -> dict:
        folder = s.work / script.removeprefix("gpu_")
        argv = [sys.executable, str(STUDIES / f"{script}.py"), "--out", str(folder), "--budget",
                str(max(5, int(timeout) - 12))] + (["--dry-run"] if args.dry_run else [])
        folder.mkdir(parents=True, exist_ok=True)
        return s.run(argv + extra(args), timeout, folder / "console.txt")

    return stage


RUNS = {
    "install": install,
    "machine": machine,
    "kernel-tests": kernel_tests,
    "backbone": study("gpu_backbone", lambda a: ["--shape", "llada-8b", "--batches"] +
                      (["1", "2"] if a.dry_run else ["1", "32"])),
    "race": study("gpu_race", lambda a: ["--shape", "llada-8b", "--per-step"] + (["2"] if a.dry_run else ["2", "4"]) +
                  (["--peer-fastdllm", a.peer] if a.peer else [])),
    "gemm": study("gpu_gemm", lambda a: ["--shapes", "llada-8b", "--rows"] + (["1"] if a.dry_run else
                                                                             ["1", "8", "32"])),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results/gpu-step-session"),
                        help="what comes back: the archive, session.json, session.log (default: $OUT)")
    parser.add_argument("--work", default=None, help="the stages' folder (default: a new temporary folder)")
    parser.add_argument("--peer", default=None, help="Fast-dLLM checkout for the race (default: none)")
    parser.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for all stages ({BUDGET})")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, a few kernel tests")
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="tracelock-session-"))
    s = Session(Path(args.out), work, args.budget)
    s.record.update(dry_run=args.dry_run, peer=args.peer, stage_budgets={n: b for n, b, _ in STAGES})
    s.save()
    for name, budget, least in STAGES:
        timeout = min(budget, s.left())
        s.say(f"\n=== {name} ({time.strftime('%T')}, {timeout:.0f} s)")
        if timeout < least:
            s.record["stages"][name] = dict(skipped=f"session budget: {s.left():.0f} s left, the stage needs {least} s")
        else:
            start = time.monotonic()
            s.record["stages"][name] = dict(RUNS[name](s, args, timeout), stage_seconds=round(
                time.monotonic() - start, 1))
        s.say(f"{name}: {json.dumps(s.record['stages'][name])[:400]}")
        s.save()
    s.say("=== done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
