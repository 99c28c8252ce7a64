"""bench/tables.py turns a committed benchmark JSON into the tables bench/README.md quotes."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tables_reproduce_the_readme_rows():
    result = ROOT / "bench" / "results" / "cpu-2core-20261122-7ad988e.json"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "tables.py"), str(result)], capture_output=True,
                         text=True, check=True).stdout
    assert "| confidence | block 16 | 826.8 ms | 869.8 ms | 1.05x | 64.0 | 41.4 | 25.0% |" in out
    assert "| median | 95.2 ms | 146.1 ms | 1.53x |" in out
    assert "| canonical | 8 | 1,586 | 22,075x |" in out
    readme = (ROOT / "bench" / "README.md").read_text()
    for row in ("826.8 ms | 869.8 ms | 1.05x", "95.2 ms | 146.1 ms | 1.53x", "| 1,586 | 22,075x |"):
        assert row in readme


def test_tables_without_a_file_print_the_usage():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tables.py")], capture_output=True, text=True)
    assert run.returncode == 1 and "usage: python bench/tables.py FILE" in run.stderr
