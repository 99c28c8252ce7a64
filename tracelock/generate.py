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
from tracelock.api import check_call
from tracelock.checks import check_decode_inputs
from tracelock.decode.compiled import compile_requested, eager_reason, generate_compiled, warn_eager
from tracelock.decode.loop import run_decode
from tracelock.policies import policy_args_for


def _device_of(model):
    param = next(model.parameters(), None)
    return param.device if param is not None else "cpu"


def fused_generate(model, input_ids, *, policy, gen_length, block=None, window=None, policy_args=None,
                   attention_mask=None, temperature=0.0, cfg_scale=0.0, stop_at_eot=False, idle_steps=False,
                   seed=0, cache=None, refresh_every=None, refresh_shift=None, impl=None, observer=None, compile=None):
    """Decode ``gen_length`` tokens after each prompt with a commitment policy.

    Args:
        model (DiffusionBackbone): from `tracelock.load_model`.
        input_ids: [B, P] int64 left-padded prompts (with ``attention_mask``), or a list of token-id lists.
        policy (str | Policy): a policy name (``tracelock.policies.POLICIES``) or a policy object.
        gen_length (int): positions to generate.
        block (int, optional): semi-AR block length (must divide gen_length). Default: None.
        window (int, optional): soft-crop window width. Default: None (with no block: the full region).
        policy_args (dict, optional): keyword arguments of a named policy, e.g. ``{"tau": 0.9}``.
        attention_mask: [B, P] 1 for prompt tokens, 0 for left padding. Default: None.
        temperature (float): 0 = greedy; > 0 samples by Gumbel-max. Default: 0.0.
        cfg_scale (float): LLaDA's classifier-free guidance scale. Default: 0.0.
        stop_at_eot (bool): a committed end token finishes its row. Default: False (paper presets).
        idle_steps (bool): reproduce the reference release's block-advance artifact. Default: False.
        seed (int): seed of sampling and random policies. Default: 0.
        cache (str, optional): approximate KV cache (`tracelock.decode.kv_cache`): "prefix" recomputes the
            positions from the last refresh's pointer to the end, "dual" only up to the commit region's end.
            A refresh is a full forward that is also a step. Default: None (every step is a full forward).
        refresh_every (int, optional): with ``cache``, also refresh a row after this many steps. Default: None.
        refresh_shift (int, optional): with ``cache`` and ``window``, refresh a row when its window's left end has
            moved this far since the last refresh. Default: window // 2. Blocks refresh at every block start.
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
    check_decode_inputs(model, input_ids, policy_args)
    check_call(policy, policy_args)
    policy_args = policy_args_for(model, policy, policy_args, gen_length)
    mode = compile_requested(compile)
    if mode:
        reason = eager_reason(policy, policy_args, temperature, cfg_scale, observer)
        if reason is None:
            return generate_compiled(model, input_ids, attention_mask=attention_mask, policy=policy, mode=mode,
                                     policy_args=policy_args, gen_length=gen_length, block=block, window=window,
                                     stop_at_eot=stop_at_eot, idle_steps=idle_steps, seed=seed, cache=cache,
                                     refresh_every=refresh_every, refresh_shift=refresh_shift)
        warn_eager(reason)
    device = _device_of(model)
    ops.check_impl(impl, device)
    bound = ops.op_set(impl, device)
    return run_decode(model, input_ids, policy=policy, gen_length=gen_length, block=block, window=window,
                      policy_args=policy_args, attention_mask=attention_mask, temperature=temperature,
                      cfg_scale=cfg_scale, stop_at_eot=stop_at_eot, idle_steps=idle_steps, seed=seed, observer=observer,
                      cache=cache, refresh_every=refresh_every, refresh_shift=refresh_shift,
                      apply_commits=bound.apply_commits, skip_finished_blocks=bound.skip_finished_blocks,
                      window_logits_stats=bound.window_logits_stats, tap_project=bound.tap_project,
                      commit_step=bound.commit_step, kernels=ops.backbone_kernels(device, impl=impl))
