"""Decoding: the step's verbs (`step`), the eager loop behind `reference_generate` and `fused_generate` (`loop`),
the static-shape engine behind ``compile=True`` and the server (`engine`, `compiled`), the run's settings
(`settings`) and the KV cache both drivers keep (`kv_cache`); docs/design.md."""

from tracelock.decode.loop import run_decode
from tracelock.decode.settings import DecodeSettings
from tracelock.decode.step import DecodeStats

__all__ = ["DecodeSettings", "DecodeStats", "run_decode"]
