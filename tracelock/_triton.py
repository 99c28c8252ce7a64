"""The only module that imports triton. Everything else asks here whether triton can run.

``triton_interpret`` is read once at import, as ``@triton.jit`` does when it decorates a kernel: set
``TRITON_INTERPRET=1`` before importing tracelock (tests/conftest.py does) for it to take effect.
"""

import os

try:
    import triton
except ImportError:
    triton = None

triton_available = triton is not None
triton_version = triton.__version__ if triton_available else None


def _env_flag(name: str) -> bool:
    # the same truthy spellings as triton's own getenv_bool (3.6, 3.7)
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on")


triton_interpret = _env_flag("TRITON_INTERPRET")
# one config per autotune list: the interpreter has no driver to time configs, and TRACELOCK_SKIP_AUTOTUNE
# makes GPU runs deterministic and fast to start
skip_autotune = triton_interpret or _env_flag("TRACELOCK_SKIP_AUTOTUNE")


def autotune_configs(configs: list) -> list:
    """Return ``configs``, or only its first (safe default) config under the interpreter or
    ``TRACELOCK_SKIP_AUTOTUNE=1``. Use as ``@triton.autotune(configs=autotune_configs([...]), key=...)``."""
    return list(configs[:1]) if skip_autotune else list(configs)
