"""bench/studies/matched_runs.py on constructed eval folders: curves grouped by folder name, the verdict against the
heuristics, and the per-item records written with --records (common items only, in id order)."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("matched_runs", Path(__file__).with_name("matched_runs.py"))
matched_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matched_runs)


def folder(root, run, policy, rows):
    """An eval policy folder ``root/run/runs/64-16/policy`` with items (id, correct, steps)."""
    f = root / run / "runs" / "64-16" / policy
    f.mkdir(parents=True)
    (f / "items-rank0.jsonl").write_text("".join(json.dumps(dict(id=i, correct=c, steps=s)) + "\n"
                                                 for i, c, s in rows))
    return str(f)


def test_a_learned_curve_above_the_heuristics_and_its_records(tmp_path, capsys):
    ids = [f"q{i}" for i in range(6)]
    # the heuristic: 50% at 10 steps, 100% at 20; the learned curve: 100% at 10 steps
    h1 = folder(tmp_path, "a", "threshold-tau-0.7", [(i, n < 3, 10) for n, i in enumerate(ids)])
    h2 = folder(tmp_path, "a", "threshold-tau-0.9", [(i, True, 20) for i in ids])
    t1 = folder(tmp_path, "b", "tracelock-theta-0.9", [(i, True, 10) for i in reversed(ids)])
    out = tmp_path / "records.json"
    assert matched_runs.main(["--records", str(out), h1, h2, "--", t1]) == 0
    v = json.loads(capsys.readouterr().out)["tracelock"]
    assert v["points"] == [[10.0, 100.0]]
    assert v["gap"] == pytest.approx(0.5)  # over 10 to 10 steps: the heuristics' 50% against 100%
    assert v["steps_to_target"] == pytest.approx(10.0)
    rec = json.loads(out.read_text())
    assert rec["ids"] == ids  # in id order, whatever order the items were decoded in
    assert rec["points"]["a/threshold-tau-0.7"] == dict(correct="111000", steps=[10] * 6)
    assert set(rec["points"]) == {"a/threshold-tau-0.7", "a/threshold-tau-0.9", "b/tracelock-theta-0.9"}


def test_records_keep_the_items_every_folder_holds(tmp_path):
    a = folder(tmp_path, "a", "confidence", [("x", True, 4), ("y", False, 5)])
    b = folder(tmp_path, "b", "confidence", [("y", True, 3), ("z", True, 3)])
    assert matched_runs.records([a, b]) == dict(ids=["y"], points={"a/confidence": dict(correct="0", steps=[5]),
                                                                   "b/confidence": dict(correct="1", steps=[3])})


def test_bad_command_lines_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="usage"):
        matched_runs.main(["x"])
    with pytest.raises(SystemExit, match="--records needs"):
        matched_runs.main(["--records"])
