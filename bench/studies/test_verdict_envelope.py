"""bench/studies/verdict_envelope.py (the shipped rule against the heuristics' envelope, pooled and Holm-adjusted) on
constructed records and on the committed verdict; bench/studies/holdout.py's draw (disjoint from every earlier one) and
the frozen protocol's points (each a policy that builds)."""

import json

import holdout  # bench/studies/ is on sys.path (its conftest.py)
import numpy as np
import verdict_envelope as ve


def test_curves_kinds_and_holm():
    assert ve.curve_of("held-64-16/threshold-tau-0.7-hold-end-true") == "threshold-hold-end-true"
    assert ve.curve_of("64-16/confidence-per-step-2-score-neg-entropy") == "confidence-score-neg-entropy"
    assert ve.kind_of("frechet-first-token-true") == "heuristic" and ve.kind_of("factor-hold-end-true") == "held"
    assert ve.kind_of("tracelock-hold-end-true-fallback-confidence") == "shipped"
    assert ve.kind_of("tracelock-controller-x-curve-tracelock-st") == "paper" and ve.kind_of("l2p") == "other"
    assert ve.knob_of("v-64-16/tracelock-theta-0.85-hold-end-true") == 0.85 and ve.knob_of("64-16/l2p") is None
    # the rules since Fast-dLLM and the gate: one curve per rule and form, whatever knob value
    assert ve.curve_of("64-16/eb-gamma-0.01-hold-end-true") == "eb-hold-end-true"
    assert ve.curve_of("64-16/hierarchy-tau-0.5-low-0.4") == ve.curve_of("64-16/hierarchy-low-0.2") == "hierarchy"
    assert ve.curve_of("64-16/klass-tau-0.3-kl-0.01-form-dream-first-token-true") == "klass-form-dream-first-token-true"
    assert ve.curve_of("64-16/pc-background-testbed-dream-steps-32") == "pc-background-testbed-dream"
    gate = ve.curve_of("64-16/gate-controller-testbed-math-base-eb-base-gamma-0.1")
    assert gate == "gate-controller-testbed-math-base-eb-base" and ve.kind_of(gate) == "gate"
    assert ve.kind_of("credit-first-token-true") == "heuristic" and ve.judged(gate, "gate")
    # Holm at 0.10 over 4: 0.01 <= 0.025, 0.03 <= 0.033, then 0.055 > 0.05 stops (0.06 <= 0.10 is never reached)
    assert ve.holm({"a": 0.01, "b": 0.03, "c": 0.06, "d": 0.055}) == {"a", "b"}
    assert ve.holm({"a": 0.01, "b": 0.03, "c": 0.06, "d": 0.04}) == {"a", "b", "c", "d"}


def _cell(tmp_path, family, lead):
    """A cell of 400 items: a threshold curve (50% in 10 steps, 70% in 20) and the shipped rule ``lead`` points
    above it at the same steps."""
    rng = np.random.default_rng(0)
    ids = [f"math:test:{i}" for i in range(400)]

    def point(acc, steps):
        correct = "".join("1" if x else "0" for x in rng.random(400) < acc)
        return dict(correct=correct, steps=[steps] * 400)

    points = {"64-16/threshold-tau-0.5": point(0.5, 10), "64-16/threshold-tau-0.9": point(0.7, 20),
              "v-64-16/tracelock-theta-0.5-hold-end-true-fallback-confidence": point(0.5 + lead, 10),
              "v-64-16/tracelock-theta-0.9-hold-end-true-fallback-confidence": point(0.7 + lead, 20)}
    folder = tmp_path / f"verdict-testbed-{family}"
    folder.mkdir()
    (folder / "cells-math-64-16.json").write_text(json.dumps(dict(ids=ids, points=points)))
    return folder


def test_a_clear_lead_wins_a_clear_lag_loses(tmp_path):
    folders = [_cell(tmp_path, "llada", 0.2), _cell(tmp_path, "dream", -0.2)]
    result = ve.analyse(folders, resamples=200)["comparisons"]["strongest"]
    assert result["cells"]["llada math 64/16"]["verdict"] == "win"
    assert result["cells"]["dream math 64/16"]["verdict"] == "loss"
    assert result["cells"]["llada math 64/16"]["holm"] == "win"  # p = 2 / 201 <= 0.10 / 2
    assert abs(result["pooled"]["all"]["gap"]) < 0.05 and result["tally"] == {"win": 1, "tie": 0, "loss": 1}


RESULTS = ve.Path(__file__).parents[1] / "results"


def _as_published(tmp_path) -> list:
    """The verdict's folders as they were published, before the fill: every record file but ``envelope-*``."""
    folders = []
    for family in ("llada", "dream"):
        folder = tmp_path / f"verdict-testbed-{family}"
        folder.mkdir()
        for f in (RESULTS / folder.name).glob("*.json"):
            if not f.name.startswith("envelope-"):
                (folder / f.name).write_bytes(f.read_bytes())
        folders.append(folder)
    return folders


def test_the_filled_verdict_reads_as_the_docs_say():
    """The README's tallies from the committed records, every cell filled up to the frozen protocol's grid: against
    the published heuristics 5 wins, 2 ties, 9 losses, pooled +1.2 points; with the held threshold 3, 3, 10, pooled
    -4.4; against every heuristic (factor and Fréchet included) 1, 3, 12, pooled -6.0."""
    folders = [RESULTS / f"verdict-testbed-{f}" for f in ("llada", "dream")]
    result = ve.analyse(folders, resamples=200)["comparisons"]
    tallies = {k: tuple(result[k]["tally"][v] for v in ("win", "tie", "loss")) for k in ve.COMPARISONS}
    assert tallies == {"published": (5, 2, 9), "control": (3, 3, 10), "strongest": (1, 3, 12)}
    pooled = {k: round(100 * result[k]["pooled"]["all"]["gap"], 1) for k in ve.COMPARISONS}
    assert pooled == {"published": 1.2, "control": -4.4, "strongest": -6.0}
    # the shipped rule at the theta points the verdict first read (0.7-0.95): the low-step points cost the most
    narrow = ve.analyse(folders, resamples=200, knobs=(0.7, 0.95))["comparisons"]["strongest"]
    assert narrow["tally"] == {"win": 2, "tie": 8, "loss": 6} and round(100 * narrow["pooled"]["all"]["gap"], 1) == -2.0


def test_the_holdout_reads_as_the_docs_say():
    """The clean hold-out, read once by the frozen protocol's analysis (bench/results/holdout-envelope.json, which
    tests/test_docs.py recomputes from the records): against the strongest envelope the shipped rule has 0 wins,
    5 ties, 11 losses (Holm the same), pooled -4.8 points: the protocol's goal (at least 8 wins, no loss, the pooled
    interval above zero) is not met."""
    result = json.loads((RESULTS / "holdout-envelope.json").read_text())
    assert result["resamples"] == 2000 and result["learned"] == "shipped"
    comparisons = result["comparisons"]
    tallies = {k: tuple(comparisons[k]["tally"][v] for v in ("win", "tie", "loss")) for k in ve.COMPARISONS}
    assert tallies == {"published": (8, 3, 5), "control": (4, 3, 9), "strongest": (0, 5, 11)}
    assert comparisons["strongest"]["tally_holm"] == {"win": 0, "tie": 5, "loss": 11}
    pooled = {k: round(100 * comparisons[k]["pooled"]["all"]["gap"], 1) for k in ve.COMPARISONS}
    assert pooled == {"published": 3.6, "control": -2.7, "strongest": -4.8}
    protocol = json.loads((RESULTS / "holdout" / "protocol.json").read_text())
    assert "at least 8 of the 16 cells" in protocol["goal"]
    strongest = comparisons["strongest"]
    met = (strongest["tally"]["win"] >= 8 and strongest["tally"]["loss"] == 0
           and strongest["pooled"]["all"]["interval"][0] > 0)
    assert not met


def test_the_verdict_as_published_before_the_fill(tmp_path):
    """docs/frontier.md's first reading, on the records as they stood before the fill: 9 wins, 5 ties, 2 losses
    against the published heuristics; 2, 11, 3 with the held threshold in the envelope, pooled -1.3 points."""
    result = ve.analyse(_as_published(tmp_path), resamples=200)["comparisons"]
    assert result["published"]["tally"] == {"win": 9, "tie": 5, "loss": 2}
    assert result["control"]["tally"] == {"win": 2, "tie": 11, "loss": 3}
    assert round(100 * result["control"]["pooled"]["all"]["gap"], 1) == -1.3


def test_the_hold_alone_from_the_verdict_as_published(tmp_path):
    """The hold's share (docs/frontier.md), before the fill: the held threshold alone (plain form) beats the
    published envelope in 7 of the shipped rule's 9 winning cells (code at widths 32 and 64, LLaDA math at 128/64),
    loses in every 64/16 cell, and pools to +8.4 points, the shipped rule's margin."""
    folders = _as_published(tmp_path)
    shipped = ve.analyse(folders, resamples=200)["comparisons"]["published"]["cells"]
    held = ve.analyse(folders, resamples=200, learned="held-threshold")
    assert list(held["comparisons"]) == ["published"]
    cells = held["comparisons"]["published"]["cells"]
    wins = {k for k, r in shipped.items() if r["verdict"] == "win"}
    assert len(wins) == 9 and len({k for k in wins if cells[k]["verdict"] == "win"}) == 7
    assert all(r["verdict"] == "loss" for k, r in cells.items() if k.endswith("64/16"))
    assert round(100 * held["comparisons"]["published"]["pooled"]["all"]["gap"], 1) == 8.4


def test_the_hold_alone_with_the_fill_picks_the_readmes_rule():
    """The README's "which rule", from the filled records: the held threshold alone against the published envelope
    wins on Dream code at widths 32 and 64 and on LLaDA math 128/64, loses in every 64/16 cell and on LLaDA math
    64/32 and 128/32 (where the plain rule ships), and pools to +4.4 points."""
    folders = [RESULTS / f"verdict-testbed-{f}" for f in ("llada", "dream")]
    held = ve.analyse(folders, resamples=200, learned="held-threshold")["comparisons"]["published"]
    verdicts = {k: r["verdict"] for k, r in held["cells"].items()}
    wins = {"dream code 64/32", "dream code 128/32", "dream code 128/64", "llada math 128/64"}
    losses = {f"{f} {t} 64/16" for f in ("llada", "dream") for t in ("math", "code")}
    losses |= {"llada math 64/32", "llada math 128/32"}
    expected = {**dict.fromkeys(wins, "win"), **dict.fromkeys(losses, "loss")}
    assert {k: verdicts[k] for k in expected} == expected
    assert round(100 * held["pooled"]["all"]["gap"], 1) == 4.4


def test_the_holdout_draw_is_disjoint_from_every_earlier_one():
    from tracelock.tasks import draw

    got = holdout.draw(50, seed=1)
    for task in holdout.TASKS:
        places = {int(i.rsplit(":", 1)[1]) for i in got["ids"][task]}
        assert len(places) == 50 and not places & set(range(holdout.FIRST))
        assert not places & {i for i, _ in draw(task, "test", 500, seed=2026)}
        assert not places & {i for i, _ in draw(task, "test", 300, seed=0)}
    committed = json.loads((holdout.HOLDOUT / "items.json").read_text())
    assert committed["seed"] == 5959 and all(len(committed["ids"][t]) == committed["n"] for t in holdout.TASKS)


def test_a_later_holdout_draws_from_a_larger_pool_and_leaves_out_the_earlier_ones():
    first = holdout.HOLDOUT / "items.json"
    got = holdout.draw(300, seed=3, pool=4000, exclude=(first,))
    earlier = json.loads(first.read_text())["ids"]
    assert got["pool"] == 4000 and got["excluded_files"] == ["bench/results/holdout/items.json"]
    for task in holdout.TASKS:
        places = {int(i.rsplit(":", 1)[1]) for i in got["ids"][task]}
        assert len(places) == 300 and max(places) < 4000 and not set(got["ids"][task]) & set(earlier[task])
        assert not places & holdout.earlier_items(task)
    # the larger pool opens with the shared one, so an id names the same problem in both
    assert holdout.pool_items("math", 2100)[:5] == holdout.pool_items("math", 2000)[:5]


def test_the_frozen_protocol_builds():
    from tracelock.eval.runner import check_policies, parse_policies, parse_settings

    protocol = json.loads((holdout.HOLDOUT / "protocol.json").read_text())
    for family, fam in protocol["families"].items():
        for setting in protocol["settings"]:
            specs = [p for s in holdout.cell_specs(protocol, family, setting) for p in parse_policies(s)]
            check_policies(specs, parse_settings(setting), "auto", controller=fam["controller"], l2p=None)
            assert sum(ve.kind_of(ve.curve_of(f"x/{p.slug}")) == "shipped" for p in specs) == 12


def test_two_processes_share_a_holdout_cell_and_decode_each_policy_once(tmp_path):
    """Two real processes on one cell: the second finds the first policy held (the first process waits there until
    both are up), takes the next one, and between them every policy is decoded exactly once."""
    import subprocess
    import sys
    import textwrap
    import time
    from pathlib import Path

    code = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(Path(holdout.__file__).parent)!r})
        import holdout
        work = Path({str(tmp_path)!r})
        (work / f"up-{{os.getpid()}}").touch()

        def decode(policy):
            done = work / policy / "done"
            if done.exists():  # the runner's own skip of items already decoded
                return
            deadline = time.monotonic() + 60
            while len(list(work.glob("up-*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(work / "log", "a") as f:
                f.write(f"{{os.getpid()}} {{policy}}\\n")
            time.sleep(0.3)
            done.write_text("")

        holdout.decode_shared([f"p{{i}}" for i in range(6)], lambda policy: work / policy, decode, poll=0.05)
    """)
    first = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "p0" / ".holdout-lock").exists():  # the first process holds p0
            assert first.poll() is None and time.monotonic() < deadline, "the first process never took p0"
            time.sleep(0.05)
        second = subprocess.Popen([sys.executable, "-c", code])
        assert second.wait(timeout=120) == 0
    finally:
        assert first.wait(timeout=120) == 0
    lines = [line.split() for line in (tmp_path / "log").read_text().splitlines()]
    assert sorted(policy for _, policy in lines) == [f"p{i}" for i in range(6)]  # each once, none lost
    by_pid = {}
    for pid, policy in lines:
        by_pid.setdefault(pid, []).append(policy)
    assert len(by_pid) == 2 and by_pid[str(first.pid)][0] == "p0" and by_pid[str(second.pid)][0] == "p1"
    assert not list(tmp_path.glob("p*/.holdout-lock"))  # each lock is gone on a clean exit
