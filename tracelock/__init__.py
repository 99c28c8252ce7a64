"""tracelock: learned commitment for masked diffusion LMs (LLaDA, Dream), with fused decoding kernels."""

import importlib

__version__ = "0.1.0"

# the public names load on first use (PEP 562), so `import tracelock` and the CLI's `--help` do not pay for torch
# (about 1.3 s); each module imports torch before anything that may load the compiled extension tracelock._C
_EXPORTS = {
    "CompletionOutput": "tracelock.llm",
    "DecodeSettings": "tracelock.decode.settings",
    "LLM": "tracelock.llm",
    "ModelSpec": "tracelock.models",
    "fused_generate": "tracelock.generate",
    "generate_many": "tracelock.throughput",
    "load_model": "tracelock.models",
    "load_tokenizer": "tracelock.models",
    "reference_generate": "tracelock.reference",
    "RequestOutput": "tracelock.llm",
    "SamplingParams": "tracelock.llm",
    "write_tiny_checkpoint": "tracelock.models",
}

__all__ = ["CompletionOutput", "DecodeSettings", "LLM", "ModelSpec", "RequestOutput", "SamplingParams", "__version__",
           "fused_generate", "generate_many", "load_model", "load_tokenizer", "reference_generate",
           "write_tiny_checkpoint"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    # `tracelock.ops` and other submodules, as before, when they were imported eagerly
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
