import importlib.util
import os
import sys
import warnings
from pathlib import Path

# set before anything imports tracelock: @triton.jit reads TRITON_INTERPRET when a kernel is decorated
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _load_helper(name: str):
    """tests/NAME.py as the module NAME, loaded once here, before any test file: tests/ is not on sys.path (pytest
    runs with --import-mode=importlib), so the test files' ``from NAME import ...`` find this one copy."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# the scripted chat server of the judge tests (its `Sleep` entries are checked with isinstance: one copy only)
chat_server = _load_helper("chat_server")
# the fault-injection harness and its comparisons of stores and caches (standard library only at import)
faults = _load_helper("faults")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny ops: on a loaded 2-core machine a second thread only adds contention
    (150 autoencoder steps: 21 s with 2 threads, 0.4 s with 1). Use as ``pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _grad_mode_restored(request):
    """A test that leaves autograd off made every later test that trains by hand fail far from it ("element 0 of
    tensors does not require grad": a CI run once had 29 such failures, the leaking test never named and not found
    in three local runs). Turn it back on and name the test that left it off."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        warnings.warn(f"{request.node.nodeid} left autograd off (torch.is_grad_enabled() was False after it); "
                      "turned back on", pytest.PytestWarning, stacklevel=1)


@pytest.fixture(autouse=True)
def _no_env_impl(monkeypatch):
    """Tests choose op implementations themselves: a TRACELOCK_IMPL in the caller's shell must not leak in."""
    monkeypatch.delenv("TRACELOCK_IMPL", raising=False)


@pytest.fixture(autouse=True)
def _not_quiet_after(monkeypatch):
    """An in-process ``main([..., "--quiet"])`` sets TRACELOCK_QUIET in os.environ; set here (to its "not quiet"
    value), it is put back when the test ends, so later tests' subprocesses still draw their progress on stderr; so is
    the mark of a busy-machine notice already said (TRACELOCK_LOAD_NOTICED), so a later test's notice still prints."""
    monkeypatch.setenv("TRACELOCK_QUIET", "0")
    monkeypatch.delenv("TRACELOCK_LOAD_NOTICED", raising=False)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty filled with garbage (NaN for floats, True for bools, -7 for ints): an output element a kernel
    skips, or a partial it never writes, shows up in the comparison."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else True if t.dtype == torch.bool else -7)

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def server():
    """A scripted OpenAI-compatible chat server on loopback (tests/chat_server.py)."""
    with chat_server.chat_server() as srv:
        yield srv


@pytest.fixture(scope="session")
def study_script():
    """A loader of bench/studies' scripts by name (each run as a module of its own)."""
    folder = Path(__file__).resolve().parents[1] / "bench" / "studies"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        return script

    return load
