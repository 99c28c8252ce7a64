"""Kill anywhere: every long job is SIGKILLed at points spread over its run (just before a rename, just after one,
at a time in between; under torchrun in one rank while the other goes on), then the same command runs again and the
result is compared with an uninterrupted run: byte-identical where the job is deterministic, else equal as data
(same items, none lost, none duplicated, no torn record), and no temporary or lock file left behind.

Real subprocesses and real SIGKILLs (`tests/faults.py`); tiny sizes. ``TRACELOCK_FAULT_POINTS`` (default 1) sets the
spread kill points per job, to which the last commit point (a data file renamed, its JSON record not yet) is added:
two kills per job by default (NOTE: 4.0 CPU-minutes for the file, 7 minutes on the shared 2-core test machine);
``-s`` prints one line per kill.
"""

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import faults  # tests/faults.py, loaded once by conftest.py
import pytest

import tracelock
from tracelock.models import write_tiny_checkpoint
from tracelock.testing import fresh_controller

POINTS = int(os.environ.get("TRACELOCK_FAULT_POINTS", "1"))
PROMPTS = ["What is 2 + 3 ?", "add 4 and 5", "x", "hello there", "count to ten", "why", "seven", "list three"]
COLLECT = ["--gen-length", "8", "--block", "4", "--batch-size", "3", "--shard-size", "2", "--fraction", "0.5",
           "--confidence", "--min-tokens", "2"]
TRAIN = ["--steps", "6", "--batch-size", "4", "--eval-every", "2", "--lr", "1e-3", "--dropout", "0", "--width", "32",
         "--layers", "1", "--heads", "2", "--ffn", "48", "--device", "cpu"]
# settings that hold the run's own folder, which differs between the runs compared
PATHS = ("out", "mix_cache")
# the whole recipe at its smallest, on the bundled model (a random checkpoint's traces are all filtered out)
FIT = ["--model", "testbed", "--prompts", "testbed:math", "--limit", "6", "--round-limit", "3", "--val-limit", "3",
       "--steps", "4", "--round-steps", "2", "--rounds", "1", "--base", "frechet:delta=0,0.9:hold_end=true", "--veto",
       "0,0.5", "--accept", "1", "--batch-size", "6", "--gen-length", "16", "--block", "8"]
TESTBED = ["--steps", "4", "--ar-steps", "2", "--batch-size", "4", "--d-model", "32", "--n-layers", "4",
           "--n-heads", "2", "--mlp", "64", "--vocab-size", "400", "--tokenizer-corpus", "300", "--save-every", "2",
           "--threads", "1"]


@dataclass
class Job:
    args: object  # (world, out) -> the command's arguments
    compare: object  # (reference folder, folder) -> verdict dict (records, lost, duplicated, torn, differ, bytes)
    needs: tuple = ()  # jobs whose reference output this one reads
    resume: tuple = ()  # extra arguments of the second run (the same command otherwise)
    nproc: int = 1
    rank: int | None = None  # the rank killed under torchrun
    reference: str | None = None  # compare with another job's reference (torchrun against one process)


@dataclass
class World:
    root: Path
    model: Path
    prompts: Path
    controller: Path
    references: dict = field(default_factory=dict)

    def ref(self, name: str) -> Path:
        return self.references[name][0]


def _store(ref, got):
    return dict(faults.compare_store(ref, got), bytes=faults.same_bytes(ref, got, ["rank*.safetensors"]))


def _cache(ref, got):
    return dict(faults.compare_cache(ref, got), bytes=faults.same_bytes(ref, got, ["shard-*.npy"]))


def _eval_folder(ref, got):
    """An `eval` run folder: every (setting, policy) folder's items (timings left out) and traces."""
    parts, differ = [], []
    for folder in sorted(p for p in (ref / "runs").glob("*/*") if p.is_dir()):
        rel = folder.relative_to(ref)
        parts.append(faults.compare_jsonl(folder / "items-rank0.jsonl", got / rel / "items-rank0.jsonl",
                                          ignore=("seconds",)))
        parts.append(faults.compare_store(folder / "traces", got / rel / "traces"))
    rows = [json.loads((d / "summary.json").read_text())["rows"] for d in (ref, got)]
    strip = [[{k: v for k, v in r.items() if k != "seconds_per_item"} for r in rs] for rs in rows]
    differ += ["summary.json"] if strip[0] != strip[1] else []
    verdict = faults.add_up(*parts)
    verdict["differ"] += len(differ)
    return dict(verdict, bytes=faults.same_bytes(ref, got, ["runs/*/*/controller_steps-*.safetensors"]))


def _files(patterns, json_ignoring=None):
    """Deterministic jobs: every file byte-identical (``patterns``), and JSON files equal but for timings."""
    def compare(ref, got):
        differ = faults.same_bytes(ref, got, patterns)
        for name, keys in (json_ignoring or {}).items():
            a, b = (_drop(json.loads((d / name).read_text()), keys) for d in (ref, got))
            differ += [name] if a != b else []
        return dict(records=len(patterns) + len(json_ignoring or {}), lost=0, duplicated=0, torn=0,
                    differ=len(differ), bytes=differ)
    return compare


def _drop(obj, keys):
    if isinstance(obj, dict):
        return {k: _drop(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [_drop(v, keys) for v in obj]
    return obj


def _self_train(ref, got):
    parts = [faults.compare_store(ref / "traces", got / "traces"), faults.compare_cache(ref / "cache", got / "cache"),
             _files(["controller/*.safetensors", "controller/best.json", "controller/encoder.json",
                     "controller/metrics.json", "controller/history.json"],
                    {"controller/state.json": PATHS})(ref, got)]
    verdict = faults.add_up(*parts)
    return dict(verdict, bytes=parts[2]["bytes"])


def _fit(ref, got):
    """`fit`: its trace stores and caches as data, its controllers, encoder and gate byte for byte, its validation
    decodes item by item, and the same choice."""
    parts = [faults.compare_store(ref / "pool" / "traces", got / "pool" / "traces"),
             faults.compare_store(ref / "round-1" / "traces", got / "round-1" / "traces", paths=(ref, got)),
             faults.compare_cache(ref / "pool" / "cache", got / "pool" / "cache"),
             faults.compare_cache(ref / "onpolicy", got / "onpolicy"),
             _files(["pool/encoder/*", "round-*/best.*", "round-*/metrics.json", "round-*/history.json",
                     "controller/*"])(ref, got)]
    for folder in sorted((ref / "validation").glob("*/runs/*/*")):
        rel = folder.relative_to(ref)
        parts.append(faults.compare_jsonl(folder / "items-rank0.jsonl", got / rel / "items-rank0.jsonl",
                                          ignore=("seconds",)))
    verdict = faults.add_up(*parts)
    choices = [json.loads((d / "fit.json").read_text())["choice"] for d in (ref, got)]
    verdict["differ"] += choices[0] != choices[1]
    return dict(verdict, bytes=parts[4]["bytes"])


JOBS = {
    "collect": Job(lambda w, out: ["collect", "--model", w.model, "--prompts", w.prompts, *COLLECT, "--out", out],
                   _store),
    "collect-torchrun": Job(lambda w, out: ["collect", "--model", w.model, "--prompts", w.prompts, *COLLECT,
                                            "--out", out], lambda r, g: faults.compare_store(r, g), nproc=2, rank=1,
                            reference="collect"),
    "featurize": Job(lambda w, out: ["featurize", "--traces", w.ref("collect"), "--model", w.model, "--encoder",
                                     w.controller, "--out", out, "--shard-mb", "0.004", "--batch-size", "4"],
                     _cache, needs=("collect",)),
    "train": Job(lambda w, out: ["train", "--cache", w.ref("featurize"), "--out", out, *TRAIN, "--encoder",
                                 w.controller],
                 _files(["*.safetensors", "best.json", "encoder.json", "metrics.json", "history.json"],
                        {"state.json": PATHS}), needs=("featurize",), resume=("--resume",)),
    "train-l2p": Job(lambda w, out: ["train-l2p", "--traces", w.ref("collect"), "--model", w.model, "--block", "4",
                                     "--out", out, "--epochs", "300", "--batch-size", "4"],
                     _files(["*.safetensors"], {"block-4.json": ("seconds",)}), needs=("collect",)),
    "eval": Job(lambda w, out: ["eval", "--model", w.model, "--task", "testbed:math", "--limit", "4", "--policies",
                                "confidence,threshold:tau=0.9,tracelock:theta=0.6,oracle", "--settings", "16/4",
                                "--controller", w.controller, "--batch-size", "2", "--workers", "1", "--out", out],
                _eval_folder),
    "paper-tables": Job(lambda w, out: ["paper-tables", "--model", w.model, "--controller", w.controller, "--tasks",
                                        "testbed:math", "--gen-lengths", "8", "--widths", "4", "--limit", "2",
                                        "--batch-size", "2", "--workers", "1", "--out", out],
                        lambda r, g: dict(_eval_folder(r / "testbed-math", g / "testbed-math"),
                                          bytes=faults.same_bytes(r, g, ["tables.md"]))),
    "testbed-train": Job(lambda w, out: ["testbed-train", "--out", out, *TESTBED],
                         _files(["*.safetensors", "tokenizer*.json", "config.json", "generation_config.json"],
                                {"train_state.json": ("seconds", *PATHS)}), resume=("--resume",)),
    "self-train": Job(lambda w, out: ["self-train", "--model", w.model, "--controller", w.controller, "--cache",
                                      w.ref("featurize"), "--prompts", "testbed:math", "--num", "4", "--out", out,
                                      "--gen-length", "16", "--window", "8", "--steps", "2", "--batch-size", "8",
                                      "--alpha", "0.3"], _self_train, needs=("featurize",)),
    "fit": Job(lambda w, out: ["fit", *FIT, "--out", out], _fit),
    "rl": Job(lambda w, out: ["rl", "--model", w.model, "--controller", w.controller, "--prompts", "testbed:math",
                              "--num", "6", "--gen-length", "16", "--window", "8", "--prompts-per-step", "2",
                              "--save-every", "1", "--lr", "1e-3", "--eta", "0.3", "--steps", "3", "--out", out],
              _files(["*.safetensors", "history.jsonl", "best.json", "encoder.*"])),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model = write_tiny_checkpoint(root / "llada", family="llada", seed=3)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    fresh_controller(tracelock.load_model(model), folder=root / "controller")
    return World(root, model, prompts, root / "controller")


def _reference(world: World, name: str):
    """The job's uninterrupted run (once per module), and the jobs it reads first."""
    if name not in world.references:
        job = JOBS[name]
        for need in job.needs:
            _reference(world, need)
        out = world.root / "reference" / name
        run = faults.run(job.args(world, out), log_dir=world.root / "logs" / name, nproc=job.nproc)
        assert run.finished, run.stderr[-3000:]
        world.references[name] = (out, run)
    return world.references[name]


@pytest.mark.parametrize("name", list(JOBS))
def test_kill_anywhere_then_resume_gives_the_uninterrupted_result(world, name):
    job = JOBS[name]
    for need in job.needs:
        _reference(world, need)
    ref_run = _reference(world, name)[1]
    kills = faults.spread(ref_run, POINTS, rank=job.rank or 0)
    ref_out = _reference(world, job.reference or name)[0]  # torchrun's result against one process's
    lines, bad = [], []
    for i, kill in enumerate(kills):
        out = world.root / name / f"kill{i}"
        shutil.rmtree(out, ignore_errors=True)
        args = job.args(world, out)
        landed = faults.kill_and_resume(args, out, kill, log_dir=world.root / "logs" / f"{name}-{i}", rank=job.rank,
                                        nproc=job.nproc, resume_args=[*args, *job.resume])
        verdict = dict(job.compare(ref_out, out), leftovers=faults.leftovers(out))
        lines.append(f"{name} kill {kill} ({'fired' if landed['fired'] else 'finished first'}, after "
                     f"{landed['renames_before']} renames, last {Path(landed['last'] or '-').name}): {verdict}")
        if verdict["lost"] or verdict["duplicated"] or verdict["torn"] or verdict["differ"] or verdict["leftovers"]:
            bad.append(lines[-1])
    print("\n" + "\n".join(lines))
    assert bad == []
    assert sum("(fired" in line for line in lines) >= len(kills) - 1, "the kills mostly came after the job ended"
