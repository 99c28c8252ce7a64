"""What the public decoding entry points (`fused_generate`, `reference_generate`, and `generate_many` through them)
do before they decode (`entry_settings`): their `DecodeSettings`, built and checked once, and the checks it cannot
make, with the command line's care: a named policy and its arguments (the CLI's spec spelling pointed at
``policy_args``, "did you mean" for a name or an argument, every value error prefixed with its policy), and the
thread rule the CLI applies (`tracelock.cli_threads.threads_for_load`), said once on stderr."""

import inspect
import os
import sys
from dataclasses import replace

import torch

from tracelock.checks import check_decode_inputs
from tracelock.cli_parser import safe_echo
from tracelock.cli_threads import physical_cores, threads_for_load
from tracelock.decode.settings import settings_from
from tracelock.policies import POLICIES, make_policy, policy_args_for
from tracelock.text import did_you_mean

__all__ = ["entry_settings", "check_named_policy", "apply_thread_rule"]

# arguments whose check reads files or needs the model: a policy that takes one is checked when it is built
_LOADED = ("model", "controller", "filters", "encoder")


def _spec_args(text: str) -> dict:
    import json

    args = {}
    for pair in text.split(":")[1:]:
        key, _, value = pair.partition("=")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    return args


def check_named_policy(policy, policy_args) -> None:
    """A policy given by name: known (else the name meant, or for the command line's ``"threshold:tau=0.9"`` the
    ``policy_args`` spelling of it), every argument one it takes (else the one meant), and the values its constructor
    checks, each error prefixed with the policy (``policy 'threshold': tau=1.5 must lie in (0, 1]``). A policy object
    passes through."""
    if not isinstance(policy, str):
        return
    if policy not in POLICIES:
        name = policy.split(":")[0].strip()
        if (":" in policy or "=" in policy) and name in POLICIES:
            args = {**_spec_args(policy), **(policy_args or {})}
            raise ValueError(f"policy={safe_echo(repr(policy))} is the command line's spec; in Python pass the name "
                             f"and its arguments apart: policy={name!r}, policy_args={args!r}")
        raise ValueError(f"unknown policy {safe_echo(repr(policy))}; known policies: {', '.join(sorted(POLICIES))}"
                         f"{did_you_mean(name, POLICIES)}")
    signature = inspect.signature(POLICIES[policy].__init__).parameters
    params = [n for n, p in signature.items() if n not in ("self", "model") and p.kind is not p.VAR_KEYWORD]
    # a policy with **kwargs (the gate's base_<name> arguments) checks those itself, when it is built
    open_ended = any(p.kind is p.VAR_KEYWORD for p in signature.values())
    args = dict(policy_args or {})
    takes = params + (["per_step"] if "steps" in params else [])
    for key in args:
        if key not in takes and key != "model" and not open_ended:  # (make_policy's words, with the argument meant)
            raise TypeError(f"policy {policy!r} takes no argument {safe_echo(key)}; its arguments are: "
                            f"{', '.join(takes) or '(none)'}{did_you_mean(key, takes)}")
    if set(params) & set(_LOADED) or "model" in inspect.signature(POLICIES[policy].__init__).parameters:
        return
    try:
        make_policy(policy, **{k: v for k, v in args.items() if k != "per_step"})
    except (ValueError, TypeError) as err:
        message = str(err)
        if message.startswith(("policy ", "make_policy")):
            raise
        raise type(err)(f"policy {policy!r}: {message}") from None


_threads_checked = False


def apply_thread_rule() -> str | None:
    """The CLI's thread rule for a Python caller, once per process: while neither ``$OMP_NUM_THREADS`` nor a
    ``torch.set_num_threads`` call chose the count (it is torch's default, the physical cores), a machine busy with
    other work gets the cores its load leaves free; a count chosen above them is kept. Either is said once on stderr
    (threads that wait for a core made the quick start's decode 19x slower on a loaded 2-core machine). Returns the
    notice, if any."""
    global _threads_checked
    if _threads_checked:
        return None
    _threads_checked = True
    if os.environ.get("OMP_NUM_THREADS", "").strip():  # the user's, or the CLI's, which has applied the rule
        return None
    from tracelock.cli_threads import machine_load

    cores, current = physical_cores(), torch.get_num_threads()
    chosen = None if current in (cores, os.cpu_count()) else current
    n, notice = threads_for_load(chosen, current, cores, machine_load(cores), how="torch.set_num_threads({n})")
    if n != current:
        torch.set_num_threads(n)
    from tracelock.progress import quiet

    if notice and not quiet():  # TRACELOCK_QUIET=1 silences it, as --quiet does
        print(f"tracelock: {notice}", file=sys.stderr, flush=True)
    return notice


def entry_settings(model, input_ids, settings, fields: dict, caller: str):
    """What the entry points do before decoding: the run's `DecodeSettings` (``settings`` and the keyword
    ``fields``, checked once as it is built), the prompts' checks (`tracelock.checks.check_decode_inputs`), the named
    policy's (which `DecodeSettings` cannot make: it sits below the policies), the thread rule, and a learned
    policy's arguments completed for ``model`` (`tracelock.policies.policy_args_for`)."""
    settings = settings_from(settings, fields, caller)
    check_decode_inputs(model, input_ids)
    check_named_policy(settings.policy, settings.policy_args)
    apply_thread_rule()
    return replace(settings, policy_args=policy_args_for(model, settings.policy, settings.policy_args,
                                                         settings.gen_length))
