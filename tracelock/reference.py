"""`reference_generate`: the executable spec of a decoding run, calling only the ``*_ref`` ops."""

from tracelock.api import check_call
from tracelock.checks import check_decode_inputs
from tracelock.decode.loop import run_decode
from tracelock.kernels.ref import apply_commits_ref, skip_finished_blocks_ref
from tracelock.policies import policy_args_for


def reference_generate(model, input_ids, *, policy, gen_length, block=None, window=None, policy_args=None,
                       attention_mask=None, temperature=0.0, cfg_scale=0.0, stop_at_eot=False, idle_steps=False,
                       seed=0, cache=None, refresh_every=None, refresh_shift=None, impl=None, observer=None,
                       compile=None):
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
    check_decode_inputs(model, input_ids, policy_args)
    check_call(policy, policy_args)
    policy_args = policy_args_for(model, policy, policy_args, gen_length)
    return run_decode(model, input_ids, policy=policy, gen_length=gen_length, block=block, window=window,
                      policy_args=policy_args, attention_mask=attention_mask, temperature=temperature,
                      cfg_scale=cfg_scale, stop_at_eot=stop_at_eot, idle_steps=idle_steps, seed=seed, observer=observer,
                      cache=cache, refresh_every=refresh_every, refresh_shift=refresh_shift,
                      apply_commits=apply_commits_ref,
                      skip_finished_blocks=skip_finished_blocks_ref)
