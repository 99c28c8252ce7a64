"""bench/studies/rl_step_cost.py on constructed eval folders: points paired by item id, each controller judged
against the held threshold at matched steps, a curve with no shared step range said so, and the committed result."""

import json

import numpy as np
import rl_step_cost  # bench/studies/ is on sys.path (its conftest.py)


def _run(folder, slug, acc, steps, rng):
    run = folder / "runs" / "64-16" / slug
    run.mkdir(parents=True)
    ids = [f"math:validation:{i}" for i in range(200)]
    rows = [dict(id=i, correct=bool(c), steps=steps) for i, c in zip(ids, rng.random(200) < acc)]
    rng.shuffle(rows)  # the reader pairs by id, not by line
    (run / "items-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_controllers_against_the_held_threshold(tmp_path):
    rng = np.random.default_rng(0)
    for tau, (acc, steps) in {"0.7": (0.5, 10), "0.9": (0.6, 20)}.items():
        _run(tmp_path / "base", f"threshold-tau-{tau}-hold-end-true", acc, steps, rng)
    for theta, (acc, steps) in {"0.7": (0.8, 10), "0.9": (0.9, 20)}.items():
        _run(tmp_path / "base", f"tracelock-theta-{theta}", acc, steps, rng)
    for theta, (acc, steps) in {"0.7": (0.6, 30), "0.9": (0.7, 40)}.items():
        _run(tmp_path / "rl", f"tracelock-controller-work-rl59-math-b0-c0-theta-{theta}", acc, steps, rng)
    for theta, (acc, steps) in {"0.7": (0.2, 10), "0.9": (0.3, 20)}.items():
        _run(tmp_path / "rl", f"tracelock-controller-work-rl59-math-b0-c0.25-theta-{theta}", acc, steps, rng)
    result = rl_step_cost.analyse([tmp_path / "base", tmp_path / "rl"], resamples=100)
    rows = result["against_held_threshold"]
    assert rows["shipped"]["gap_interval"][0] > 0.1 and rows["rl, step price 0.25"]["gap_interval"][1] < -0.1
    assert rows["rl, no step price"]["gap"] is None  # 30-40 steps against 10-20: nothing to match
    assert len(result["items"]) == 200 and len(result["records"]) == 8


def test_the_committed_result_reads_as_documented():
    saved = json.loads((rl_step_cost.Path(__file__).parents[1] / "results" / "rl-step-cost-validation.json")
                       .read_text())
    rows = saved["against_held_threshold"]
    assert round(100 * rows["shipped"]["gap"], 1) == 0.8 and round(100 * rows["rl, step price 0.25"]["gap"], 1) == -6.3
    assert len(saved["items"]) == 300 and all(len(r["correct"]) == 300 for r in saved["records"].values())
