"""`tracelock eval` end to end on a micro checkpoint: the run folder, resume after a torn write, refused resumes,
torchrun with gloo (same results as one process), a TraceLock row with its controller steps, and `tracelock report`
on the result; the spec parsers and the tasks' prompts and scoring."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tracelock
from tracelock.eval.runner import parse_policies, parse_settings, read_items, run_eval, schedule_of, slug
from tracelock.eval.tasks import GSM8KTask, QATask, humaneval_completion, make_task
from tracelock.models import write_tiny_checkpoint
from tracelock.testing import fresh_controller
from tracelock.traces.store import iter_traces

pytestmark = pytest.mark.usefixtures("one_thread")
GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"  # ../shared
POLICIES = "confidence,confidence:steps=8,tracelock:theta=0.6,oracle"
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model_dir = write_tiny_checkpoint(root / "llada", family="llada", seed=3)
    fresh_controller(tracelock.load_model(model_dir), folder=root / "controller")
    return root, model_dir


def _run(setup, out, **kw):
    root, model_dir = setup
    args = dict(n=5, batch_size=2, controller=root / "controller", workers=1)
    return run_eval(model_dir, "testbed:math", parse_policies(kw.pop("policies", POLICIES)),
                    parse_settings(kw.pop("settings", "16/4,16/8")), out, **{**args, **kw})


@pytest.fixture(scope="module")
def reference(setup):
    out = setup[0] / "reference"
    return out, _run(setup, out)


def test_run_folder(reference):
    out, rows = reference
    assert [(r["setting"], r["policy"]) for r in rows] == [
        (s, p) for s in ("16/4", "16/8") for p in POLICIES.split(",")]
    assert json.loads((out / "summary.json").read_text())["rows"] == rows
    assert (out / "summary.csv").read_text().count("\n") == 1 + len(rows)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["n"] == 5 and [p["schedule"] for p in manifest["policies"]] == ["block", "block", "window",
                                                                                     "block"]
    for row in rows:
        folder = out / "runs" / row["setting"].replace("/", "-") / slug(row["policy"])
        items = read_items(folder / "items-rank0.jsonl")
        traces = {t.meta["id"]: t for t in iter_traces(folder / "traces")}
        assert len(items) == 5 and set(items) == set(traces)
        for item_id, rec in items.items():
            assert rec["steps"] == traces[item_id].num_steps and rec["tokens"] == traces[item_id].final.tolist()
            assert isinstance(rec["correct"], bool)
        assert row["avg_steps"] == sum(r["steps"] for r in items.values()) / 5
        assert row["metric"] == sum(r["correct"] for r in items.values()) / 5
        # the controller's per-step scores sit beside the TraceLock traces only
        assert bool(list(folder.glob("controller_steps-*.safetensors"))) == row["policy"].startswith("tracelock")
    by = {(r["setting"], r["policy"]): r for r in rows}
    assert by[("16/4", "confidence")]["avg_steps"] == 16  # one token per step
    assert by[("16/4", "confidence:steps=8")]["avg_steps"] == 8  # two per step
    # the oracle commits what already equals the reference's final tokens: never more steps than it
    assert by[("16/4", "oracle")]["avg_steps"] <= by[("16/4", "confidence")]["avg_steps"]


def test_resume_skips_done_items_and_redoes_a_torn_line(setup, reference, tmp_path):
    import shutil

    ref_out, ref_rows = reference
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    items = out / "runs" / "16-8" / "confidence-steps-8" / "items-rank0.jsonl"
    text = items.read_text()
    items.write_text(text[:text.rindex("\n", 0, len(text) - 1) + 1] + text.splitlines()[-1][:20])  # torn append
    before = {p: p.stat().st_mtime_ns for p in out.rglob("items-rank0.jsonl")}
    rows = _run(setup, out)
    assert rows == [dict(r, seconds_per_item=rows[i]["seconds_per_item"]) for i, r in enumerate(ref_rows)]
    changed = [p for p in out.rglob("items-rank0.jsonl") if p.stat().st_mtime_ns != before[p]]
    assert changed == [items]  # only the torn item was decoded again
    assert len(items.read_text().splitlines()) == 5 and len(read_items(items)) == 5
    assert len(list(iter_traces(items.parent / "traces"))) == 5


def test_resume_refuses_other_arguments_and_policies_grow(setup, reference, tmp_path):
    out, _ = reference
    with pytest.raises(ValueError, match=r"other n, seed.*same arguments to resume"):
        _run(setup, out, n=3, seed=1)
    grown = _run(setup, out, policies=POLICIES + ",random", settings="16/4")
    assert [r["policy"] for r in grown][-1] == "random"
    assert "random" in [p["label"] for p in json.loads((out / "manifest.json").read_text())["policies"]]


def test_spec_errors(setup, tmp_path):
    with pytest.raises(ValueError, match="'nope' is not a policy"):
        parse_policies("confidence,nope")
    with pytest.raises(ValueError, match="must look like key=value"):
        parse_policies("threshold:0.9")
    with pytest.raises(ValueError, match="oracle replays the first policy"):
        parse_policies("oracle,confidence")
    with pytest.raises(ValueError, match="must look like GEN/WIDTH"):
        parse_settings("128x32")
    with pytest.raises(ValueError, match="--tasks: 'gsm8k' is not a task spec"):
        make_task("gsm8k")
    with pytest.raises(ValueError, match="needs --controller"):
        run_eval(setup[1], "testbed:math", parse_policies("tracelock"), parse_settings("16/4"), tmp_path, n=2)
    # a row that names its own controller needs no --controller (the frontier's per-curve controllers)
    own = parse_policies(f"tracelock:controller={setup[0] / 'controller'}")
    rows = run_eval(setup[1], "testbed:math", own, parse_settings("16/4"), tmp_path / "own", n=2, workers=1)
    assert rows[0]["policy"].startswith("tracelock") and rows[0]["n"] == 2
    assert parse_policies("threshold:tau=0.9")[0].args == {"tau": 0.9}
    with pytest.raises(ValueError, match="cache='both' in 'threshold:cache=both' must be prefix or dual"):
        parse_policies("threshold:cache=both")
    cached = parse_policies("threshold:tau=0.9:cache=dual:refresh_every=4")[0]
    assert cached.policy_args == {"tau": 0.9}
    assert schedule_of(cached, parse_settings("16/4")[0], "auto") == {"block": 4, "cache": "dual", "refresh_every": 4}


def test_torchrun_two_ranks_match_one_process(setup, reference):
    root, model_dir = setup
    out = root / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "tracelock",
           "eval", "--model", str(model_dir), "--tasks", "testbed:math", "--policies", "confidence,oracle",
           "--settings", "16/4", "--limit", "5", "--batch-size", "2", "--workers", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert "| confidence" in proc.stdout
    rows = json.loads((out / "summary.json").read_text())["rows"]
    ref = {(r["setting"], r["policy"]): r for r in reference[1]}
    for r in rows:
        assert (r["metric"], r["avg_steps"], r["n"]) == (ref[r["setting"], r["policy"]]["metric"],
                                                         ref[r["setting"], r["policy"]]["avg_steps"], 5)
    folder = out / "runs" / "16-4" / "confidence"
    assert {p.name for p in folder.glob("items-rank*.jsonl")} == {"items-rank0.jsonl", "items-rank1.jsonl"}
    assert len(list(iter_traces(folder / "traces"))) == 5


def test_report_on_an_eval_run(reference, tmp_path):
    from tracelock.eval.report import write_report

    out, _ = reference
    md = write_report(out, tmp_path / "report").read_text()
    assert "| 16/4 |" in md
    pngs = {p.name for p in (tmp_path / "report").glob("*.png")}
    assert {"acceptance.png", "score-confidence.png", "threshold.png"} <= pngs


def test_gsm8k_task_scores_gold_solutions(tmp_path):
    if not GSM8K_TEST.exists():
        pytest.skip("GSM8K test split not available")
    task = GSM8KTask(str(GSM8K_TEST))
    items = task.items(50)
    assert len(items) == 50 and items[0].prompt.endswith("'#### <number>'.")
    assert all(task.score(items, [it.reference for it in items]))
    assert not any(task.score(items, ["#### 0.123456"] * 50))


def test_qa_task_reads_alpaca_records(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"instruction": "Name a colour.", "output": "Red."}) + "\n"
                    + json.dumps({"instruction": "Translate", "input": "chat"}) + "\n")
    items = QATask(str(path)).items(None)
    assert [it.prompt for it in items] == ["Name a colour.", "Translate\n\nchat"]
    assert [it.reference for it in items] == ["Red.", None]
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="qa.jsonl:1 needs the string field\\(s\\) 'instruction'"):
        QATask(str(path)).items(None)


def test_humaneval_replies_in_chat_form_are_scored():
    task = make_task("humaneval")
    items = task.items(3)
    assert "def check" not in items[0].prompt and "```python" in items[0].prompt
    assert "def check" in make_task("humaneval-with-tests").items(1)[0].prompt
    replies = []
    for it in items:
        p = it.reference
        whole = p["prompt"] + p["canonical_solution"]
        replies += [f"Here it is:\n```python\n{whole}```\nDone.", p["canonical_solution"], "    return None\n"]
    triples = [it for it in items for _ in range(3)]
    assert task.score(triples, replies, workers=2) == [True, True, False] * 3
    problem = items[0].reference
    assert humaneval_completion(problem, "    return 1\n") == "    return 1\n"
    assert humaneval_completion(problem, f"def {problem['entry_point']}(x):\n    return 1\n").startswith("\ndef ")


def test_paper_tables_one_command(setup, tmp_path):
    from tracelock.eval.paper_tables import plan, run_tables
    from tracelock.l2p import L2PFilter
    from tracelock.l2p.filter import FilterConfig

    root, model_dir = setup
    layout = plan([8], [2, 4])
    assert layout["settings"] == ["8/2", "8/4"] and layout["generalisation"] == [("8/2", "8/4")]
    eos = tracelock.load_model(model_dir).spec.eos_id
    for block in (2, 4):  # Learn2PD: one (untrained) filter per width
        L2PFilter(FilterConfig(block=block, hidden=block, eos_id=eos)).save(tmp_path / "l2p")
    text = run_tables(model_dir, root / "controller", ["testbed:math"], tmp_path / "out", l2p=tmp_path / "l2p",
                      lengths=[8], widths=[2, 4], limit=2, batch_size=2, workers=1)
    assert (tmp_path / "out" / "tables.md").read_text() == text
    main, general, ablation = text.split("### ")[1:]
    assert main.count("| testbed:math |") == 5 and "| testbed:math | tracelock | " in main
    assert "-" not in main.split("| testbed:math | confidence | ")[1].split("\n")[0].replace(" / ", "")
    assert "8/2 -> 4" in general and "| testbed:math | 8/2 |" in ablation
    # Learn2PD's generalised cell is its block-2 filter at block 4
    assert "-" not in general.split("| testbed:math | l2p | ")[1].split("\n")[0].replace(" -> ", "")
    manifest = json.loads((tmp_path / "out" / "testbed-math" / "manifest.json").read_text())
    schedules = {p["label"]: p["schedule"] for p in manifest["policies"]}
    assert schedules == {"random": "block", "confidence": "block", "threshold:tau=0.9": "block", "l2p": "block",
                         "tracelock": "window", "tracelock:schedule=full": "full", "tracelock:static_tau=0.0": "window",
                         "tracelock:schedule=full:static_tau=0.0": "full", "l2p:filter_block=2": "block"}
    rows = json.loads((tmp_path / "out" / "tables.json").read_text())["rows"]["testbed:math"]
    full = {r["policy"]: r for r in rows if r["setting"] == "8/2"}["tracelock:schedule=full"]
    assert full["n"] == 2 and full["avg_steps"] <= 8
    with pytest.raises(ValueError, match="multiple of 4"):
        plan([10], [2])


def test_qa_run_is_ranked_and_critiqued_by_an_http_judge(setup, tmp_path, server):
    from chat_server import ranking_candidates  # tests/chat_server.py, loaded by conftest.py

    from tracelock.eval.judge_backends import HTTPJudge
    from tracelock.eval.judge_prompts import CRITIC_SYSTEM
    from tracelock.eval.judging import make_judge

    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in [
        {"instruction": "Name a colour.", "output": "red"}, {"instruction": "Say hi."},
        {"instruction": "Count to three.", "output": "1 2 3"}]))

    def reply(body):  # a judge that prefers longer answers; every critic verdict is "correct"
        if body["messages"][0]["content"] == CRITIC_SYSTEM:
            return json.dumps({"verdict": "correct", "reason": "ok"})
        scores = {cid: min(10, len(answer)) for cid, answer in ranking_candidates(body).items()}
        return json.dumps({"scores": scores, "reason": "r"})

    server.script = [reply] * 100
    judge = HTTPJudge(f"http://127.0.0.1:{server.server_port}/v1", "judge-model", timeout_s=5.0)
    out = tmp_path / "qa-run"
    policies = parse_policies("confidence,confidence:steps=4")
    rows = run_eval(setup[1], f"qa:{qa}", policies, parse_settings("8/4"), out, n=3, batch_size=3, workers=1,
                    judge=judge)
    assert len(server.requests) == 3 + 2 * 2  # three rankings, a critic call per referenced item and policy
    completions = {p.label: read_items(out / "runs" / "8-4" / p.slug / "items-rank0.jsonl") for p in policies}
    ids = list(completions["confidence"])
    by_hand = {label: 0.0 for label in completions}
    for i in ids:  # fractional ranks of min(10, len) per prompt, by hand
        score = {label: min(10, len(recs[i]["completion"])) for label, recs in completions.items()}
        for label in score:
            better = sum(v > score[label] for v in score.values())
            tied = sum(v == score[label] for v in score.values())
            by_hand[label] += (better + (tied + 1) / 2) / len(ids)
    assert {r["policy"]: r["metric"] for r in rows} == pytest.approx(by_hand)
    assert all(r["critic_rate"] == 1.0 and r["metric_name"] == "avg rank" for r in rows)
    summary = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["metric"] for r in summary] == [r["metric"] for r in rows]
    # resumed with the same judge: nothing is decoded or judged again, the judgement is read back
    again = run_eval(setup[1], f"qa:{qa}", policies, parse_settings("8/4"), out, n=3, batch_size=3, workers=1,
                     judge=judge)
    assert len(server.requests) == 7 and again == rows
    with pytest.raises(ValueError, match="--judge-model NAME"):
        make_judge(url="http://127.0.0.1:9/v1")
    with pytest.raises(ValueError, match="exactly one of them"):
        make_judge()
