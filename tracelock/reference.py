"""`reference_generate`: the executable spec of a decoding run, calling only the ``*_ref`` ops (the spec set)."""

from tracelock.api import entry_settings
from tracelock.decode.loop import run_decode
from tracelock.decode.settings import DecodeSettings
from tracelock.models.from_transformers import as_backbone
from tracelock.ops import spec_set


def reference_generate(model, input_ids, settings: DecodeSettings | None = None, *, attention_mask=None, impl=None,
                       observer=None, compile=None, **fields):
    """Decode with plain-PyTorch ops; same signature and results as `tracelock.fused_generate`.

    ``impl`` and ``compile`` exist only to keep the signatures identical: the reference always runs the torch spec
    on the eager loop (``TRACELOCK_COMPILE`` does not apply to it).
    """
    if compile:
        raise ValueError("reference_generate is the eager spec and never compiles; use "
                         "tracelock.fused_generate(..., compile=True)")
    if impl not in (None, "torch"):
        raise ValueError(f"reference_generate always runs the torch reference ops; got impl={impl!r}. "
                         "Use tracelock.fused_generate(..., impl=...) to pick an implementation")
    model = as_backbone(model)  # a LLaDA / Dream module loaded with transformers too
    settings = entry_settings(model, input_ids, settings, fields, "reference_generate")
    return run_decode(model, input_ids, settings, spec_set(), attention_mask=attention_mask, observer=observer)
