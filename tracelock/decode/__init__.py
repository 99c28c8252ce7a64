"""The decoding loop shared by `reference_generate` and `fused_generate`."""

from tracelock.decode.loop import DecodeStats, run_decode

__all__ = ["DecodeStats", "run_decode"]
