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


if triton_available:
    tl = triton.language
    # Interpreter workaround (triton 3.6, 3.7): its fp32 -> bf16 cast truncates, with or without
    # fp_downcast_rounding="rtne", so under the interpreter `round_to` rounds to bf16 on the bits instead.
    _BF16_ON_BITS = tl.constexpr(triton_interpret)

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        """fp32 ``x`` rounded to the nearest ``dtype`` value, ties to even, as torch's casts round (a no-op for
        fp32). Kernels whose spec rounds step by step in a 16-bit dtype use it for every rounding."""
        if _BF16_ON_BITS and dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            # c10::BFloat16's round to nearest even; a NaN becomes the quiet NaN 0x7FC0
            bits = tl.where(x == x, bits + 0x7FFF + ((bits >> 16) & 1), 0x7FC00000)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return x.to(dtype)

    @triton.jit
    def mul_rn(a, b):
        """``a * b`` rounded once to fp32 and never contracted with a following add into an FMA (the NVIDIA
        backend contracts by default), for specs that round each product as a torch expression ``a * b + c * d``
        does: ``fma(a, b, +0.0)`` is the rounded product, except that a zero product comes out +0. (A -0.0 addend
        would keep the sign, but LLVM folds ``fma(a, b, -0.0)`` back into a multiply and contracts it; triton 3.7.)"""
        return tl.fma(a, b, 0.0)
