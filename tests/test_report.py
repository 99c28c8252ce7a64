"""`tracelock report` end to end on a small run folder this file decodes for real (a micro checkpoint, 4 prompts,
gen_length 16, two settings, confidence / threshold / TraceLock with a fresh controller): valid PNGs, the summary
table and the divergence numbers in report.md, and clear errors for a bad RUN_DIR."""

import json
import struct

import numpy as np
import pytest

import tracelock
from tracelock.cli import main
from tracelock.eval.diagnostics import ControllerStepRecorder, divergence_over_items, write_controller_steps
from tracelock.eval.report import captioned_summary_table, write_report
from tracelock.models import write_tiny_checkpoint
from tracelock.recording.recorder import TraceRecorder, record
from tracelock.testing import fresh_controller, random_prompts
from tracelock.traces.store import TraceWriter, iter_traces

pytestmark = pytest.mark.usefixtures("one_thread")
G = 16
POLICIES = [dict(label="confidence 1/step", slug="confidence-1-step", name="confidence", args={}),
            dict(label="threshold 0.9", slug="threshold-0-9", name="threshold", args={"tau": 0.9}),
            dict(label="tracelock", slug="tracelock", name="tracelock", args={"theta": 0.6})]
SETTINGS = [dict(label="16/4", slug="16-4", gen_length=G, block=4, window=None),
            dict(label="16/8", slug="16-8", gen_length=G, block=8, window=None)]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tracelock_policy(model):
    controller, enc = fresh_controller(model)
    return tracelock.policies.tracelock.TraceLockPolicy(controller, enc, theta=0.6)


def _decode(model, prompts, ids, policy, setting, folder):
    """Traces of one (setting, policy), and for TraceLock the controller-step file beside them."""
    schedule = dict(block=setting["block"])
    if policy["name"] != "tracelock":
        return record(model, prompts, policy=policy["name"], policy_args=policy["args"], gen_length=G,
                      keep_confidence=True, metas=[{"id": i} for i in ids], **schedule)
    pol = _tracelock_policy(model)
    traces = TraceRecorder(model.spec, prompts, G, keep_confidence=True)
    with ControllerStepRecorder(pol, G, ids) as steps:
        canvas, _ = tracelock.fused_generate(model, prompts, policy=pol, gen_length=G, **schedule,
                                             observer=lambda s: (traces(s), steps(s)))
    write_controller_steps(folder / "controller_steps.safetensors", steps)
    return traces.traces(canvas, [{"id": i} for i in ids])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder as `tracelock eval` writes it, decoded for real."""
    model = tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("llada"), family="llada", seed=3))
    run = tmp_path_factory.mktemp("run")
    prompts = random_prompts(model, lengths=(9, 5, 12, 7))
    ids = [f"item-{k}" for k in range(len(prompts))]
    rows = []
    for setting in SETTINGS:
        for k, policy in enumerate(POLICIES):
            folder = run / "runs" / setting["slug"] / policy["slug"]
            folder.mkdir(parents=True)
            traces = _decode(model, prompts, ids, policy, setting, folder)
            with TraceWriter(folder / "traces", shard_size=3) as writer:
                for t in traces:
                    writer.add(t)
            # a made-up score that differs between policies on some items (the grids show those first)
            correct = [(j + k) % 2 == 0 for j in range(len(ids))]
            (folder / "items-rank0.jsonl").write_text("".join(
                json.dumps(dict(id=i, correct=c, steps=t.num_steps, seconds=0.01, completion="")) + "\n"
                for i, c, t in zip(ids, correct, traces)))
            rows.append(dict(setting=setting["label"], policy=policy["label"], metric=float(np.mean(correct)),
                             metric_name="accuracy", avg_steps=float(np.mean([t.num_steps for t in traces])),
                             seconds_per_item=0.01, n=len(ids)))
    manifest = dict(task="testbed-math", model="micro", n=len(ids), seed=0, policies=POLICIES, settings=SETTINGS,
                    controller=None)
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "summary.json").write_text(json.dumps({"rows": rows}))
    return run


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_report_end_to_end(run_dir, tmp_path):
    out = tmp_path / "report"
    assert main(["report", str(run_dir), "--out", str(out), "--every", "4", "--items", "2"]) == 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["acceptance.png", "divergence-confidence-1-step-vs-threshold-0-9.png",
                    "divergence-confidence-1-step-vs-tracelock.png", "grid-16-4-0.png", "grid-16-4-1.png",
                    "score-confidence.png", "threshold.png"]
    for name in pngs:
        width, height = _png_size(out / name)
        assert width > 200 and height > 200
    md = (out / "report.md").read_text()
    for name in pngs:
        assert f"]({name})" in md
    # the summary table: one row per setting, "accuracy % / avg steps" per policy
    summary = json.loads((run_dir / "summary.json").read_text())["rows"]
    first = next(r for r in summary if r["setting"] == "16/8" and r["policy"] == "tracelock")
    assert "| setting | confidence 1/step | threshold 0.9 | tracelock |" in md
    row = next(line for line in md.splitlines() if line.startswith("| 16/8 |"))
    assert row.split(" | ")[-1] == f"{100 * first['metric']:.1f} / {first['avg_steps']:.1f} |"
    # confidence decodes one position per step: G steps per item in both settings
    assert row.split(" | ")[1].endswith(f"/ {G:.1f}")
    # the divergence table holds what divergence_over_items computes
    folder = run_dir / "runs" / "16-4"
    div = divergence_over_items(list(iter_traces(folder / "confidence-1-step" / "traces")),
                                list(iter_traces(folder / "tracelock" / "traces")), every=4)
    section = md[md.index("## Trace divergence: confidence 1/step vs tracelock"):]
    section = section[section.index("Setting 16/4"):]
    for k, s in enumerate(div.step):
        cells = [100 * getattr(div, m)[k] for m in ("mask_sym_diff", "mask_jaccard", "common_token_diff",
                                                     "committed_jaccard")]
        assert f"| {s} | " + " | ".join("n/a" if np.isnan(v) else f"{v:.1f}" for v in cells) + " |" in section
    # the last step: every item fully committed, the masked sets' Jaccard undefined
    assert div.step[-1] == G and div.items == 4 and np.isnan(div.mask_jaccard[-1])
    assert "## Notes" not in md


def test_report_pair_and_missing_parts(run_dir, tmp_path):
    out = write_report(run_dir, tmp_path / "r", pair="threshold 0.9, tracelock", every=16, items=1).parent
    assert sorted(p.name for p in out.glob("divergence-*.png")) == ["divergence-threshold-0-9-vs-tracelock.png"]
    assert len(list(out.glob("grid-*.png"))) == 1
    # a copy without one trace store and without the controller steps: the rest is still drawn, with notes
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(run_dir, partial)
    shutil.rmtree(partial / "runs" / "16-8" / "threshold-0-9" / "traces")
    for f in partial.glob("runs/*/tracelock/controller_steps.safetensors"):
        f.unlink()
    md = write_report(partial, items=0).read_text()
    assert "no trace store at" in md and "threshold 0.9 at 16/8" in md
    assert "no `controller_steps.safetensors` for tracelock at 16/4" in md
    assert not (partial / "report" / "score-confidence.png").exists()
    assert (partial / "report" / "acceptance.png").stat().st_size > 0


def test_captioned_summary_table_formats(run_dir):
    manifest = json.loads((run_dir / "manifest.json").read_text())
    rows = [dict(setting="16/4", policy="tracelock", metric=2.5, metric_name="avg rank", avg_steps=9.25)]
    table = captioned_summary_table(manifest, rows)
    assert table.startswith("Cells: avg rank / average steps per item.")
    assert "| 16/4 | n/a | n/a | 2.50 / 9.2 |" in table and "| 16/8 | n/a | n/a | n/a |" in table


def test_report_errors(run_dir, tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "RUN_DIR" in err and "is not a folder" in err and "run `tracelock eval" in err
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no manifest.json: not a `tracelock eval` run folder"):
        write_report(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"--pair 'tracelock,nobody' must be two different policy labels.*"
                                         r"'confidence 1/step', 'threshold 0.9', 'tracelock'"):
        write_report(run_dir, tmp_path / "r", pair="tracelock,nobody")
    with pytest.raises(ValueError, match="--every=0 must be a positive int"):
        write_report(run_dir, tmp_path / "r", every=0)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    (bad / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="manifest.json is not valid JSON"):
        write_report(bad)
    (bad / "manifest.json").write_text(json.dumps({"policies": []}))
    with pytest.raises(ValueError, match="needs a non-empty 'policies' list"):
        write_report(bad)
