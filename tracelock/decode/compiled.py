"""`fused_generate(..., compile=True)`: a batch decoded on a compiled `DecodeEngine`, one slot per row.

The prompts are left-padded to a prompt bucket (`prompt_bucket`), so prompts of similar lengths share the compiled
graphs; an engine is kept per model and settings (at most `_KEEP` per model, the least recently used dropped first;
`clear_engines` frees them) and reused, so a second call with the same settings compiles nothing. What a graph
cannot express runs the eager loop instead, with a warning that says why: classifier-free guidance, an observer (it
reads every step on the host), sampling and stochastic policies (their draws come from a ``torch.Generator``), the
oracle policy.
"""

import os
import warnings
import weakref
from collections import OrderedDict

import torch

from tracelock.decode.canvas import prepare_canvas
from tracelock.decode.engine import DecodeEngine, prompt_bucket
from tracelock.decode.settings import DecodeSettings
from tracelock.decode.step import Stopwatch, run_stats
from tracelock.policies import POLICIES

ENV = "TRACELOCK_COMPILE"
_KEEP = 4
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compile_requested(compile) -> bool | str:
    """``compile``, else ``TRACELOCK_COMPILE`` (1/true/yes, 0/false/no/empty, or cudagraphs), else False."""
    if compile is not None:
        if compile not in (True, False, "cudagraphs"):
            raise TypeError(f"compile={compile!r} must be True, False, 'cudagraphs' or None (None: ${ENV}, default "
                            "off)")
        return compile
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    if raw == "cudagraphs":
        return "cudagraphs"
    raise ValueError(f"{ENV}={raw!r}: use 1 (compile the decode step), cudagraphs (CUDA graphs of the uncompiled "
                     "step) or 0 (the eager loop)")


def eager_reason(settings: DecodeSettings, observer) -> str | None:
    """Why these settings cannot run compiled (None: they can)."""
    policy = settings.policy
    if settings.cfg_scale:
        return "classifier-free guidance (cfg_scale > 0) runs two forwards per step on the eager loop only"
    if observer is not None:
        return "an observer reads every step on the host"
    if getattr(policy, "name", None) == "oracle":
        return "the oracle policy indexes its reference canvas by the eager loop's batch rows"
    if settings.temperature > 0:
        return "sampling (temperature > 0) draws from a torch.Generator, which a compiled graph cannot take"
    if isinstance(policy, str):
        # an unknown name runs on: the engine's resolve_policy says what the known ones are
        deterministic = policy not in POLICIES or POLICIES[policy].deterministic_with(**(settings.policy_args or {}))
    else:
        deterministic = policy.deterministic
    if not deterministic:
        return f"the {policy if isinstance(policy, str) else policy.name!r} policy draws from a torch.Generator"
    return None


def _key(settings: DecodeSettings, slots: int, bucket: int) -> tuple:
    # a policy object is its own key (the engine holds it); a name with its arguments by value (a module, such as the
    # backbone a learned policy is checked against, by identity)
    args = sorted((k, ("object", id(v)) if isinstance(v, torch.nn.Module) else v)
                  for k, v in (settings.policy_args or {}).items())
    policy = settings.policy
    who = ("object", id(policy)) if not isinstance(policy, str) else (policy, repr(args))
    return who, settings.key(), slots, bucket


def _engine_for(model, settings: DecodeSettings, slots: int, bucket: int, mode) -> DecodeEngine:
    engines = _ENGINES.setdefault(model, OrderedDict())
    key = _key(settings, slots, bucket) + (mode,)
    if key in engines:
        engines.move_to_end(key)
        return engines[key]
    engine = DecodeEngine(model, settings, slots=slots, prompt_len=bucket, compile=mode)
    engines[key] = engine
    if len(engines) > _KEEP:
        engines.popitem(last=False)
    return engine


def generate_compiled(model, input_ids, settings: DecodeSettings, *, attention_mask, mode=True):
    """`fused_generate`'s result, decoded on a compiled engine (see the module docstring)."""
    gen_length = settings.gen_length
    canvas = prepare_canvas(model.spec, input_ids, attention_mask, gen_length, model.device)
    B, P = canvas.x.shape[0], canvas.prompt_len
    bucket = prompt_bucket(P, gen_length, model.spec.max_positions)
    engine = _engine_for(model, settings, slots=B, bucket=bucket, mode=mode)
    engine.reset()
    mask = canvas.attention_mask
    for r in range(B):
        engine.admit(canvas.x[r, :P] if mask is None else canvas.x[r, :P][mask[r, :P]])
    forwards = engine.forwards
    clock = Stopwatch(model.device)
    while engine.step():
        pass
    seconds = clock.seconds()
    runner = engine.runner
    canvas.x = runner.canvas.x[:, bucket - P:].clone()
    steps = runner.counters.steps.tolist()
    log = runner.commit_log.tolist()
    stats = run_stats(engine.context, canvas.x[:, P:], [row[:n] for row, n in zip(log, steps)],
                      engine.forwards - forwards, seconds, None if runner.kv is None else runner.kv.refreshes)
    return canvas.x, stats


def clear_engines(model=None) -> None:
    """Drop the kept engines (their graphs and KV-cache buffers) of ``model``, or of every model."""
    if model is None:
        _ENGINES.clear()
    else:
        _ENGINES.pop(model, None)


def warn_eager(reason: str) -> None:
    warnings.warn(f"compile=True: {reason}; decoding with the eager loop instead", stacklevel=3)
