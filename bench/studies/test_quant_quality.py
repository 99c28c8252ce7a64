"""bench/studies/quant_quality.py on two constructed eval folders: the paired difference, its interval, identical
tokens."""

import json

import numpy as np
import quant_quality  # bench/studies/ is on sys.path (its conftest.py)


def _run(root, fmt, flips):
    """An eval-shaped folder: 200 items, correct on the even ones, except that ``flips`` items turn wrong and
    decode to other tokens."""
    task = root / "testbed-math-validation"
    (task / "runs" / "64-16" / "threshold-tau-0.9").mkdir(parents=True)
    (task / "manifest.json").write_text(json.dumps({"quantize": fmt}))
    with open(task / "runs" / "64-16" / "threshold-tau-0.9" / "items-rank0.jsonl", "w") as f:
        for i in range(200):
            flipped = i in flips
            f.write(json.dumps(dict(id=f"math:validation:{i}", correct=(i % 2 == 0) and not flipped,
                                    steps=20 + flipped, tokens=[i, 9 if flipped else 1])) + "\n")


def test_a_paired_comparison_of_two_runs(tmp_path, capsys):
    _run(tmp_path / "full", None, set())
    _run(tmp_path / "int8", "int8", {0, 2, 4, 6})  # four right answers lost: -2 points
    assert quant_quality.main([str(tmp_path / "full"), str(tmp_path / "int8"), "--out", str(tmp_path / "q.json")]) == 0
    cell = json.loads((tmp_path / "q.json").read_text())["cells"]["testbed-math-validation 64-16 threshold-tau-0.9"]
    assert cell["n"] == 200 and cell["format"] == "int8" and cell["accuracy_full"] == 0.5
    assert np.isclose(cell["difference"], -0.02) and cell["interval"][0] < -0.02 < cell["interval"][1] <= 0
    assert np.isclose(cell["identical_tokens"], 0.98) and np.isclose(cell["steps_quant"] - cell["steps_full"], 0.02)
    assert cell["records"]["identical"].count("0") == 4
    assert "| -2.0 [" in capsys.readouterr().out


def test_no_difference_has_a_zero_interval():
    same = np.array([1, 0, 1, 1, 0] * 20)
    assert quant_quality.paired_difference(same, same) == dict(difference=0.0, interval=[0.0, 0.0])
