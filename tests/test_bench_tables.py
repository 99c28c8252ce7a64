"""bench/tables.py turns a committed benchmark JSON into the tables bench/README.md quotes."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tables(result: str) -> str:
    """bench/tables.py's output on a committed result file."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / "tables.py"), str(ROOT / "bench" / "results" / result)],
                          capture_output=True, text=True, check=True).stdout


def test_tables_reproduce_the_readme_rows():
    out = _tables("cpu-2core-xeon-20261123-ea0a476.json")
    assert "| confidence | block 16 | 135.2 ms | 144.8 ms | 1.07x | 64.0 | 197.9 | 25.0% |" in out
    assert "| l2p | block 16 | 36.9 ms | 29.2 ms | 0.79x | 11.4 | 738.2 | 25.0% |" in out
    assert "| median | 16.4 ms | 42.7 ms | 2.60x |" in out
    assert "| canonical | 8 | 1,586 | 22,075x |" in out
    readme = (ROOT / "bench" / "README.md").read_text()
    for row in ("135.2 ms | 144.8 ms | 1.07x", "36.9 ms | 29.2 ms | 0.79x", "16.4 ms | 42.7 ms | 2.60x",
                "| 1,586 | 22,075x |"):
        assert row in readme


def test_cache_tables_reproduce_the_readme_rows():
    out = _tables("cpu-2core-20261122-88a074a-cache.json")
    assert "| fastdllm-0.9 | dual | 163.0 ms | 2.27x | 31.9 | 4.0 | 214.0 | 25.0% |" in out
    assert "| tracelock | dual | 432.6 ms | 2.03x | 42.2 | 4.9 | 82.3 | 25.0% |" in out
    assert "| fastdllm-0.9 + prefix cache | 8 | 8 | 1 | 16% | 159.8 |" in out
    assert "| policy | schedule |" not in out  # no decode rows in this file: no empty table
    readme = (ROOT / "bench" / "README.md").read_text()
    for row in ("| 163.0 ms | 2.27x | 31.9 | 4.0 | 214.0 |", "| 432.6 ms | 2.03x | 42.2 | 4.9 | 82.3 |",
                "| 8 | 8 | 1 | 16% | 159.8 |"):
        assert row in readme


def test_peer_and_loop_tables_reproduce_the_readme_rows():
    out = _tables("cpu-2core-20261126-213d96a-compile.json")
    rows = ["| fastdllm-0.9-dual | tracelock-compiled-B1 | 61.2 ms | 1.45x | 21.1 | 100.0% |",
            "| confidence | tracelock-compiled-B32 | 277.0 ms | 1.78x | 64.0 | 100.0% |",
            "| fastdllm-dream-0.9-dual | fastdllm | 182.6 ms | 1.00x | - | 94.5% |",
            "| fastdllm-0.9-dual | 1 | 64 | 0.98 ms | 0.37 ms | 2.68x |"]
    readme = (ROOT / "bench" / "README.md").read_text()
    for row in rows:
        assert row in out and row in readme


def test_tables_without_a_file_print_the_usage():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tables.py")], capture_output=True, text=True)
    assert run.returncode == 1 and "usage: python bench/tables.py FILE" in run.stderr
