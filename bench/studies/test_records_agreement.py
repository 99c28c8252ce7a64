"""bench/studies/records_agreement.py on the committed verdict records: a file against itself agrees everywhere; a
changed item and another folder for the controller are found."""

import json
from pathlib import Path

import pytest
from records_agreement import agreement, main  # bench/studies/ is on sys.path (its conftest.py)

RECORDS = Path(__file__).parents[1] / "results" / "verdict-testbed-llada" / "records.json"


def test_agreement_counts_the_items_that_differ(tmp_path):
    cell = json.loads(RECORDS.read_text())["testbed:math"]["64/16"]
    n = len(cell["ids"])
    same = agreement(cell, cell)
    assert len(same) == len(cell["points"]) and all(v["same_correct"] == v["same_steps"] == n for v in same.values())
    other = json.loads(json.dumps(cell))
    label = next(k for k in other["points"] if k.startswith("tracelock:theta=0.9:"))
    p = other["points"].pop(label)
    flipped = ("1" if p["correct"][0] == "0" else "0") + p["correct"][1:]
    other["points"][label.replace("controller=/", "controller=/elsewhere/")] = dict(p, correct=flipped)
    got = agreement(other, cell)["tracelock:theta=0.9:curve=TraceLock-ST"]
    assert got["same_correct"] == n - 1 and got["same_steps"] == n
    other["ids"] = other["ids"][::-1]
    with pytest.raises(ValueError, match="another draw"):
        agreement(other, cell)
    main([str(RECORDS), str(RECORDS), "testbed:math", "64/16", "--out", str(tmp_path / "a.json")])
    assert json.loads((tmp_path / "a.json").read_text())["points"]["threshold:tau=0.9"]["same_correct"] == n
