"""`fused_generate`: the decoding entry point, running its per-step ops through `tracelock.ops`.

Greedy steps without CFG hand the backbone forward two ops to run in place of its outputs:
`ops.window_logits_stats` on the LM head's input (the head and its softmax statistics in one op), so no
[b, R, V] logits are written, and, for a policy with a linear tap fold (TraceLock with a linear encoder),
`ops.tap_project` on the three hidden-state taps, so the policy reads its controller inputs and the taps are
never returned. Sampling and CFG need the logits and take the logits path (raw taps, as the reference). A policy
with a commit rule (TraceLock, whatever rule its controller carries) has its step closed by `ops.commit_step`
on the device; the other commits go through `ops.apply_commits`. Which implementation runs each op is
`ops.op_set`'s choice, from the one table `ops.IMPLEMENTATIONS`.

``compile=True`` (or ``TRACELOCK_COMPILE=1``) decodes on a `tracelock.decode.engine.DecodeEngine` instead: static
shapes, one host read per step, the step compiled with ``torch.compile`` (`tracelock.decode.compiled`).
"""

from tracelock import ops
from tracelock.api import entry_settings
from tracelock.decode.compiled import compile_requested, eager_reason, generate_compiled, warn_eager
from tracelock.decode.loop import run_decode
from tracelock.decode.settings import DecodeSettings
from tracelock.models.from_transformers import as_backbone


def _device_of(model):
    param = next(model.parameters(), None)
    return param.device if param is not None else "cpu"


def fused_generate(model, input_ids, settings: DecodeSettings | None = None, *, attention_mask=None, impl=None,
                   observer=None, compile=None, **fields):
    """Decode ``gen_length`` tokens after each prompt with a commitment policy.

    Args:
        model (DiffusionBackbone): from `tracelock.load_model`.
        input_ids: [B, P] int64 left-padded prompts (with ``attention_mask``), or a list of token-id lists.
        settings (DecodeSettings, optional): what to decode: the policy, ``gen_length``, the schedule (``block`` /
            ``window``), sampling, the KV cache. Its fields may instead be passed as keywords (``policy=``,
            ``gen_length=``, ``block=``, ``window=``, ``policy_args=``, ``temperature=``, ``cfg_scale=``,
            ``stop_at_eot=``, ``idle_steps=``, ``seed=``, ``cache=``, ``refresh_every=``, ``refresh_shift=``: see
            `tracelock.DecodeSettings`), which also override those of a given ``settings``.
        attention_mask: [B, P] 1 for prompt tokens, 0 for left padding. Default: None.
        impl (str, optional): op implementations: "torch" (the specs), "cpp" (C++ commits, torch scoring),
            "triton" (Triton scoring, torch commits) or "cuda" (CUDA commits, Triton scoring). Default:
            ``TRACELOCK_IMPL``, else each op's fastest available.
        observer (callable, optional): called with a `tracelock.decode.loop.StepRecord` at every step
            (what trace recording uses). Default: None.
        compile (bool | str, optional): decode on the static-shape engine with each step compiled by
            ``torch.compile(fullgraph=True)`` (inductor on CPU, CUDA graphs on CUDA; the first call of a setting
            compiles, seconds to a minute), same tokens and steps as the eager loop; "cudagraphs" (CUDA only)
            captures the uncompiled engine's steps as CUDA graphs instead (no compile time). Its ops are each op's
            default that a graph can hold (`ops.op_set`: the Triton kernels and, when built, the CUDA commits on
            CUDA; the torch bookkeeping under inductor; ``impl`` is not used). CFG, an observer, sampling and
            stochastic policies warn and run the eager loop. Default: ``TRACELOCK_COMPILE`` (1, cudagraphs or 0),
            else False.

    Returns:
        (tokens [B, P + gen_length], DecodeStats): the whole canvas (prompt included) and the run's costs.

    Examples::

        model = tracelock.load_model(path)
        tokens, stats = tracelock.fused_generate(model, ids, policy="threshold", gen_length=64, block=16)
        print(stats.steps)
    """
    model = as_backbone(model)  # a LLaDA / Dream module loaded with transformers too
    settings = entry_settings(model, input_ids, settings, fields, "fused_generate")
    mode = compile_requested(compile)
    if mode:
        reason = eager_reason(settings, observer)
        if reason is None:
            return generate_compiled(model, input_ids, settings, attention_mask=attention_mask, mode=mode)
        warn_eager(reason)
    device = _device_of(model)
    ops.check_impl(impl, device)
    return run_decode(model, input_ids, settings, ops.op_set(device, impl=impl), attention_mask=attention_mask,
                      observer=observer)
