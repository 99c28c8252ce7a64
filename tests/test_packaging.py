"""The installed layout: ``kernels/`` ships as ``tracelock.kernels`` only, and importing it skips triton."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, json, sys
import tracelock.kernels, tracelock.kernels.ref
print(json.dumps({
    "kernels_file": tracelock.kernels.__file__,
    "bare_kernels": importlib.util.find_spec("kernels") is not None,
    "triton_loaded": "triton" in sys.modules,
}))
"""


def test_kernels_installed_as_subpackage(tmp_path):
    # a temp cwd keeps the repo root off sys.path, so only the installed layout is visible
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert Path(info["kernels_file"]).resolve().parent == REPO / "kernels"
    assert not info["bare_kernels"], "a bare top-level `kernels` module is importable"
    assert not info["triton_loaded"], "importing tracelock.kernels.ref pulled in triton"


def test_bare_kernels_import_fails(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import kernels"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert done.returncode != 0
    assert "No module named 'kernels'" in done.stderr


def test_a_folder_named_tracelock_in_the_working_directory_does_not_shadow_the_package(tmp_path):
    """A clone named tracelock, used from the folder above it: Python's path search finds that folder first (an empty
    namespace package). The installed package still wins; a real package there (another checkout) wins as Python's
    rule has it."""
    (tmp_path / "tracelock" / "tracelock").mkdir(parents=True)  # the clone's root and its package folder
    probe = "import tracelock; print(tracelock.__file__); print(hasattr(tracelock, 'load_model'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(REPO / "tracelock" / "__init__.py"), "True"]
    (tmp_path / "tracelock" / "__init__.py").write_text("")  # now a package of its own
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.stdout.split() == [str(tmp_path / "tracelock" / "__init__.py"), "False"], done.stderr
