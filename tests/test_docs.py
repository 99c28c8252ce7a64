"""The README and docs/: short, self-contained (no link leaves the repository), and their examples run as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _block(text: str, after: str, lang: str) -> str:
    """The first ```lang block after the line ``after``."""
    tail = text[text.index(after):]
    match = re.search(rf"```{lang}\n(.*?)```", tail, re.S)
    assert match, f"no {lang} block after {after!r}"
    return match.group(1)


def test_readme_is_a_short_user_page_with_the_ci_block():
    text = README.read_text()
    assert len(text.splitlines()) < 250
    ci = _block(text, "<!-- ci: tests -->", "bash")
    assert 'pip install -c constraints.txt --no-build-isolation -e ".[test]"' in ci
    assert re.search(r"pytest -q .*bench/", ci)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_point_nowhere_outside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text and "/work/" not in text
    assert not re.search(r"\bissue\b", text, re.I), f"{page.name} refers to an issue"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if target.startswith(("http://", "https://")):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_readme_python_quick_start_runs_on_the_bundled_model(tmp_path):
    code = _block(README.read_text(), "## Quick start in Python", "python")
    assert 'LLM(model="testbed")' in code
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    answer, steps = done.stdout.strip().rsplit("\n", 1)
    # the bundled model solves it: 9 + 4
    assert answer.strip().endswith("#### 13")
    assert re.fullmatch(r"\d+ steps for 64 positions, finish reason: stop", steps)
    # what the README says it prints
    assert _block(README.read_text(), "It prints", "text").strip() == done.stdout.strip()
    assert "Warning" not in done.stderr  # no Python warning on the way


def _draw(script: str, out: Path) -> str:
    """Run a docs/ drawing script into ``out``; its stdout. The picture it draws is a PNG."""
    done = subprocess.run([sys.executable, str(ROOT / "docs" / script), str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return done.stdout


def test_the_quality_picture_is_drawn_from_the_results(tmp_path):
    _draw("quality_vs_steps.py", tmp_path / "figure.png")
    assert (ROOT / "docs" / "quality-vs-steps.png").exists()


def test_the_frontier_picture_and_tables_are_drawn_from_the_results(tmp_path):
    detailed = _draw("frontier_results.py", tmp_path / "frontier.png").strip()
    assert (ROOT / "docs" / "frontier.png").exists()
    # the superseded first-N table on the history page is the script's output, number for number
    assert detailed in (ROOT / "docs" / "history.md").read_text()


@pytest.mark.parametrize(("family", "png"), [("llada", "verdict.png"), ("dream", "verdict-dream.png")])
def test_the_verdict_pictures_are_drawn_from_the_committed_records(tmp_path, family, png):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "studies" / "verdict_figure.py"),
                           str(ROOT / "bench" / "results" / f"verdict-testbed-{family}"), str(tmp_path / png)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (ROOT / "docs" / png).exists()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_verdict_tables_are_recomputed_from_the_committed_records(family):
    """Every TraceLock-ST cell of the verdict (the paper's commit rule), in the README (the gap, in the paper rule's
    column) and in docs/frontier.md (the gap and the steps to the heuristics' best), is what `python -m
    tracelock.eval.matched` computes from bench/results/verdict-testbed-<family> (its records, 1000 paired resamples,
    seed 0): all 16 cells."""
    from tracelock.eval.matched import _interval_cell, recompute_matched

    result = recompute_matched(ROOT / "bench" / "results" / f"verdict-testbed-{family}")
    readme = README.read_text().splitlines()
    frontier = (ROOT / "docs" / "frontier.md").read_text().splitlines()
    model = {"llada": "LLaDA", "dream": "Dream"}[family]
    cells = 0
    for task, settings in result["tasks"].items():
        name = task.split(":")[1]
        for setting, d in settings.items():
            v = d["matched"]["TraceLock-ST"]
            gap = _interval_cell(v["gap"], v["gap_interval"], 100, sign=True)
            row = next(line for line in readme if line.startswith(f"| {model} | {setting} | "))
            paper = row.split(" | ")[4].strip(" |").split(" / ")  # "math / code", the gaps without their intervals
            assert paper[0 if name == "math" else 1] == gap.split(" [")[0], (task, setting, row)
            row = next(line for line in frontier if line.startswith(f"| {model}-family | {name} | {setting} | {gap}"))
            steps = v["steps_to_target"]
            assert (_interval_cell(steps, v["steps_to_target_interval"]) if steps is not None else "| never") in row
            cells += 1
    assert cells == 8


SHIPPED_RULE_CELLS = [(family, f"{task}-{setting}") for family in ("llada", "dream")
                      for setting in ("64-16", "64-32", "128-32", "128-64") for task in ("math", "code")]


def _cell_curves(records: Path) -> dict:
    """{curve: ([0/1 per item per point], [steps per item per point])} of a `bench/studies/matched_runs.py --records`
    file: the tracelock points are one curve ("tracelock"), the heuristics group by their policy name without its
    knob."""
    import json

    curves = {}
    for name, p in json.loads(records.read_text())["points"].items():
        policy = name.split("/", 1)[1]
        kind = "tracelock" if policy.startswith("tracelock") else re.sub(r"-(tau|per-step)-[0-9.]+", "", policy)
        curves.setdefault(kind, ([], []))[0].append([float(c == "1") for c in p["correct"]])
        curves[kind][1].append(p["steps"])
    return curves


def _shipped_gap(family: str, name: str) -> tuple:
    """(the tracelock curve's gap at matched steps as the docs print it, the other curves' names, the tracelock
    curve) of bench/results/verdict-testbed-<family>/<name>.json."""
    from tracelock.eval.matched import Curve, _interval_cell, verdict

    curves = _cell_curves(ROOT / "bench" / "results" / f"verdict-testbed-{family}" / f"{name}.json")
    shipped = Curve("shipped", *curves.pop("tracelock"))
    v = verdict(shipped, [Curve(k, *c) for k, c in curves.items()])
    return _interval_cell(v["gap"], v["gap_interval"], 100, sign=True), set(curves), shipped


def _frontier_rows(start: str) -> list:
    return [line for line in (ROOT / "docs" / "frontier.md").read_text().splitlines() if line.startswith(start)]


@pytest.mark.parametrize(("family", "cell"), SHIPPED_RULE_CELLS)
def test_the_shipped_rule_cells_are_recomputed_from_the_committed_records(family, cell):
    """Each test cell of the shipped commit rule as first published (docs/frontier.md's table) is the gap at matched
    steps of bench/results/verdict-testbed-<family>/variant-<cell>.json: its four points (theta 0.7, 0.8, 0.9, 0.95)
    against the verdict's heuristics (one per step at 1/2/4 tokens, Fast-dLLM's tau in each of the family's forms),
    paired by item: all 16 cells."""
    gap, heuristics, shipped = _shipped_gap(family, f"variant-{cell}")
    forms = {"llada": {"confidence", "threshold"},
             "dream": {"confidence-score-neg-entropy", "threshold", "threshold-first-token-true-curve-fast-dllm-dream"}}
    assert heuristics == forms[family] and shipped.n_items == 500 and len(shipped.correct) == 4
    task, gen, width = cell.split("-")
    model = {"llada": "LLaDA", "dream": "Dream"}[family]
    rows = _frontier_rows(f"| {model} | {task} {gen}/{width} |")
    assert len(rows) == 1 and f"| {gap}" in rows[0].replace("**", ""), (gap, rows)


def _envelope_readings(tmp_path, prefix: str) -> dict:
    """`bench/studies/verdict_envelope.py` (2,000 resamples, as the docs print it) on the committed
    bench/results/<prefix>-testbed-<family>/ folders: {"whole": every point, "narrow": the shipped rule at theta
    0.7-0.95 only}, each the script's whole JSON."""
    import json

    out = {}
    folders = [str(ROOT / "bench" / "results" / f"{prefix}-testbed-{f}") for f in ("llada", "dream")]
    for name, extra in (("whole", []), ("narrow", ["--knobs", "0.7", "0.95"])):
        path = tmp_path / f"{prefix}-{name}.json"
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "studies" / "verdict_envelope.py"), *folders,
                               "--resamples", "2000", "--out", str(path), *extra],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        out[name] = json.loads(path.read_text())
    return out


@pytest.fixture(scope="module")
def filled_verdict(tmp_path_factory) -> dict:
    readings = _envelope_readings(tmp_path_factory.mktemp("verdict"), "verdict")
    return {k: v["comparisons"] for k, v in readings.items()}


def _gap_cell(row: dict) -> str:
    lo, hi = row["interval"]
    text = f"{100 * row['gap']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    return f"**{text}**" if row["verdict"] == "win" else text


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_filled_verdict_tables_are_recomputed_from_the_committed_records(filled_verdict, family):
    """The README's table (published / strongest per task) and docs/frontier.md's filled table (published, control,
    strongest, strongest at theta 0.7-0.95, each with its plain and Holm verdicts) are what verdict_envelope.py reads
    from the committed records: all 16 cells."""
    whole, narrow = filled_verdict["whole"], filled_verdict["narrow"]
    model = {"llada": "LLaDA", "dream": "Dream"}[family]
    readme = README.read_text().splitlines()
    for setting in ("64/16", "64/32", "128/32", "128/64"):
        row = next(line for line in readme if line.startswith(f"| {model} | {setting} | ")).split(" | ")
        for column, task in ((2, "math"), (3, "code")):
            key = f"{family} {task} {setting}"
            assert row[column] == f"{_gap_cell(whole['published']['cells'][key])} / " \
                                  f"{_gap_cell(whole['strongest']['cells'][key])}", (key, row)
            cells = [whole[c]["cells"][key] for c in ("published", "control", "strongest")]
            cells.append(narrow["strongest"]["cells"][key])
            said = [r["verdict"] if r["verdict"] == r["holm"] else f"{r['verdict']}, Holm {r['holm']}" for r in cells]
            want = " | ".join(f"{_gap_cell(r)}: {v}" for r, v in zip(cells, said, strict=True))
            assert _frontier_rows(f"| {model} | {task} {setting} (filled) | {want} |"), (key, want)


@pytest.fixture(scope="module")
def holdout_reading(tmp_path_factory) -> dict:
    """The hold-out's readings; the protocol's ("whole") must reproduce the committed
    bench/results/holdout-envelope.json."""
    import json

    readings = _envelope_readings(tmp_path_factory.mktemp("holdout"), "holdout")
    assert readings["whole"] == json.loads((ROOT / "bench" / "results" / "holdout-envelope.json").read_text())
    return {k: v["comparisons"] for k, v in readings.items()}


def test_the_holdout_table_is_recomputed_from_the_committed_records(holdout_reading):
    """docs/frontier.md's hold-out table (published, control, strongest, strongest at theta 0.7-0.95, plain and Holm
    verdicts; tallies and pooled gaps) is what verdict_envelope.py reads from the committed hold-out records."""
    whole, narrow = holdout_reading["whole"], holdout_reading["narrow"]
    columns = [whole[c] for c in ("published", "control", "strongest")] + [narrow["strongest"]]
    for family, model in (("llada", "LLaDA"), ("dream", "Dream")):
        for setting in ("64/16", "64/32", "128/32", "128/64"):
            for task in ("math", "code"):
                cells = [c["cells"][f"{family} {task} {setting}"] for c in columns]
                said = [r["verdict"] if r["verdict"] == r["holm"] else f"{r['verdict']}, Holm {r['holm']}"
                        for r in cells]
                want = " | ".join(f"{_gap_cell(r)}: {v}" for r, v in zip(cells, said, strict=True))
                assert _frontier_rows(f"| {model} | {task} {setting} (hold-out) | {want} |"), (setting, task, want)

    def tally(c):
        t, h = c["tally"], c["tally_holm"]
        return f"{t['win']}, {t['tie']}, {t['loss']} ({h['win']}, {h['tie']}, {h['loss']})"

    assert _frontier_rows("| all | wins, ties, losses (Holm) | " + " | ".join(map(tally, columns)) + " |")
    for group in ("all", "math", "code", "llada", "dream"):
        gaps = " | ".join(_gap_cell({**c["pooled"][group], "verdict": ""}) for c in columns)
        assert _frontier_rows(f"| pooled | {group} | {gaps} |"), (group, gaps)


CONTROL_CELLS = sorted(p.stem.replace("control-", "") + "@" + p.parent.name.split("-")[-1]
                       for p in (ROOT / "bench" / "results").glob("verdict-testbed-*/control-*.json"))


@pytest.mark.parametrize("cell", CONTROL_CELLS)
def test_the_control_cells_are_recomputed_from_the_committed_records(cell):
    """The control (docs/frontier.md, "What the wins are made of"): the shipped rule's gap at matched steps against the
    heuristics and Fast-dLLM's threshold given the same end-of-text hold, from
    bench/results/verdict-testbed-<family>/control-<cell>.json, paired by item."""
    cell, family = cell.split("@")
    gap, heuristics, shipped = _shipped_gap(family, f"control-{cell}")
    assert any(k.endswith("hold-end-true") for k in heuristics) and shipped.n_items == 500
    task, gen, width = cell.split("-")
    model = {"llada": "LLaDA", "dream": "Dream"}[family]
    rows = _frontier_rows(f"| {model} | {task} {gen}/{width} (control) |")
    assert len(rows) == 1 and f"| {gap}" in rows[0], (gap, rows)


def test_every_control_cell_is_in_the_docs():
    controls = [line for line in _frontier_rows("| ") if "(control) |" in line]
    assert len(controls) == len(CONTROL_CELLS) >= 1
