"""The decoding policies behind one interface (:class:`Policy`): the published rules (LLaDA, Dream, Fast-dLLM,
Fast-dLLM++, and those since: CreditDecoding, dInfer's hierarchy, KLASS, LESS, the entropy bound, PC-Sampler) and
the learned ones (TraceLock, its gate over a training-free rule, Learn2PD); the name registry and the arguments a
named policy is built with.

Examples::

    policy = make_policy("threshold", tau=0.9)
    policy.setup(gen_length=256, num_regions=8)
    policy = resolve_policy("confidence", {"per_step": 2}, gen_length=256, num_regions=8)  # built and set up
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from .base import Policy, StepInput
from .credit import CreditPolicy
from .dream import EntropyPolicy, MaskGitPlusPolicy, OriginPolicy, TopKMarginPolicy
from .entropy_bound import EntropyBoundPolicy
from .fastdllm import FactorPolicy, ThresholdPolicy
from .frechet import FrechetPolicy
from .gate import GatePolicy
from .hierarchy import HierarchyPolicy
from .klass import KlassPolicy
from .l2p import L2PHiddenPolicy, L2PPolicy
from .less import LessPolicy
from .llada import ConfidencePolicy, RandomPolicy, TopKPolicy
from .pc_sampler import PCSamplerPolicy
from .tracelock import TraceLockPolicy

__all__ = ["POLICIES", "Policy", "StepInput", "make_policy", "resolve_policy", "with_steps"]

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RandomPolicy,
        ConfidencePolicy,
        TopKPolicy,
        OriginPolicy,
        MaskGitPlusPolicy,
        TopKMarginPolicy,
        EntropyPolicy,
        ThresholdPolicy,
        FactorPolicy,
        FrechetPolicy,
        CreditPolicy,
        HierarchyPolicy,
        KlassPolicy,
        LessPolicy,
        EntropyBoundPolicy,
        PCSamplerPolicy,
        TraceLockPolicy,
        GatePolicy,
        L2PPolicy,
        L2PHiddenPolicy,
    )
}


def make_policy(spec: str | Policy, **kwargs) -> Policy:
    """Build a policy from its registry name and keyword arguments, or pass an instance through
    (`resolve_policy`'s checks and words).

    Args:
        spec (str | Policy): a name in :data:`POLICIES` or a ready :class:`Policy`.
        **kwargs: the policy's arguments (only with a name).

    Returns:
        Policy: not yet set up; call ``setup(gen_length=..., num_regions=...)``.
    """
    if isinstance(spec, Policy):
        if kwargs:
            raise TypeError(
                f"make_policy got a {type(spec).__name__} instance and kwargs {sorted(kwargs)}; "
                "pass the name instead (make_policy(name, **kwargs)) or configure the instance"
            )
        return spec
    return resolve_policy(spec, kwargs)


# arguments whose value is read from disk or is the model: a check made before they are at hand (`load=False`)
# stops short of building a policy that takes one
_LOADED = ("model", "controller", "filters", "encoder")


def resolve_policy(policy, policy_args=None, *, gen_length: int | None = None, num_regions: int | None = None,
                   model=None, load: bool = True) -> Policy | None:
    """The one reading of a policy given by name and arguments, for every caller (`fused_generate` through
    `tracelock.decode.context.start_run`, the commands' checks before the model loads, the server's, `make_policy`):
    the name known (else the name meant, or for the command line's ``"threshold:tau=0.9"`` the ``policy_args``
    spelling of it), every argument one it takes (else the one meant), the required ones present, ``per_step=k`` as
    ``steps=gen_length // k`` (`with_steps`), each value of the kind its signature declares, then the policy built,
    so its constructor checks the values. Every error is one line that names the policy (``policy 'threshold':
    tau=1.5 must lie in (0, 1]``).

    Args:
        policy (str | Policy): a name in :data:`POLICIES`, or a ready policy (passed through; no arguments then).
        policy_args (dict, optional): the named policy's arguments.
        gen_length (int, optional): the generation length, for ``per_step``.
        num_regions (int, optional): given, the policy is also set up (``setup(gen_length=, num_regions=)``), so
            ``steps`` that do not split into the blocks fail here too.
        model (optional): the backbone, passed as ``model=`` to a policy that takes it (TraceLock, Learn2PD, the
            gate), so a controller or filter made for another backbone is refused when it loads.
        load (bool): False for a check before the files and the model are at hand (`tracelock.SamplingParams`, the
            server's options): a policy that takes one of them (model, controller, filters, encoder) is checked up to
            building it, and None is returned. Default: True.

    Returns:
        Policy | None: the built policy (set up with ``num_regions``), or None (``load=False``, a learned policy).
    """
    if policy_args is not None and not isinstance(policy_args, Mapping):
        raise TypeError(f"policy_args must be a dict of the policy's keyword arguments, e.g. {{'tau': 0.9}}, got "
                        f"{type(policy_args).__name__} {policy_args!r}")
    if isinstance(policy, Policy):
        if policy_args:
            raise TypeError(f"policy is a {type(policy).__name__} instance and policy_args {sorted(policy_args)} were "
                            f"given too; pass the name instead (policy={policy.name!r}, policy_args=...) or "
                            "configure the instance")
        built = policy
    else:
        name = _known_name(policy, policy_args)
        args = _checked_args(name, dict(policy_args or {}), gen_length)
        cls = POLICIES[name]
        params = _params(cls)
        if not load and set(params) & set(_LOADED):
            return None
        if model is not None and "model" in params and "model" not in args:
            args["model"] = model
        missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in args]
        if missing:
            what = ", ".join(f"{n} ({_REQUIRED_HINTS[n]})" if n in _REQUIRED_HINTS else n for n in missing)
            example = ", ".join(f"{n!r}: ..." for n in missing)
            raise TypeError(f"policy {name!r} needs {what}: pass policy_args={{{example}}} "
                            f"(on the command line: {name}:{missing[0]}=...)")
        built = _named_errors(name, lambda: cls(**args))
    if num_regions is not None:
        _named_errors(built.name, lambda: built.setup(gen_length=gen_length, num_regions=num_regions))
    return built


def _known_name(policy, policy_args) -> str:
    """``policy`` when it is a registry name; else the error that says which name was meant."""
    from tracelock.cli_parser import safe_echo
    from tracelock.text import did_you_mean

    if isinstance(policy, str) and policy in POLICIES:
        return policy
    name = policy.split(":")[0].strip() if isinstance(policy, str) else repr(policy)
    if isinstance(policy, str) and (":" in policy or "=" in policy) and name in POLICIES:
        from tracelock.policy_specs import parse_policy_spec

        try:
            spelled = repr({**parse_policy_spec(policy, option="policy=")[1], **(policy_args or {})})
        except ValueError:  # not key=value pairs: the shape of the fix
            spelled = "{'key': value, ...}"
        raise ValueError(f"policy={safe_echo(repr(policy))} is the command line's spec; in Python pass the name "
                         f"and its arguments apart: policy={name!r}, policy_args={safe_echo(spelled)}")
    raise ValueError(f"unknown policy {safe_echo(repr(policy))}; known policies: {', '.join(sorted(POLICIES))}"
                     f"{did_you_mean(name, POLICIES)}")


def _params(cls) -> dict:
    """A policy's named arguments (its ``**kwargs``, the gate's ``base_<name>``, left out)."""
    return {n: p for n, p in inspect.signature(cls.__init__).parameters.items()
            if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}


def _checked_args(name: str, args: dict, gen_length) -> dict:
    """``args`` of policy ``name`` checked by name (else the one meant) and kind, ``per_step`` as ``steps``."""
    from tracelock.cli_parser import safe_echo
    from tracelock.text import did_you_mean

    cls = POLICIES[name]
    params = _params(cls)
    # a policy with **kwargs (the gate's base_<name> arguments) checks those itself, when it is built
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD
                     for p in inspect.signature(cls.__init__).parameters.values())
    takes = [n for n in params if n != "model"] + (["per_step"] if "steps" in params else [])
    for key in args:
        if key not in takes and key not in params and not open_ended:
            raise TypeError(f"policy {name!r} takes no argument {safe_echo(key)}; its arguments are: "
                            f"{', '.join(takes) or '(none)'}{did_you_mean(key, takes)}")
    if "per_step" in args and "steps" in params:
        if gen_length is None:
            raise TypeError(f"policy {name!r}: per_step (tokens per step) needs the generation length; pass it to "
                            f"fused_generate (policy_args={{'per_step': {args['per_step']!r}}}), or "
                            "steps=gen_length // per_step here")
        args = with_steps(name, args, gen_length)
    for key, value in args.items():
        if key in params:
            _check_kind(name, key, value, params[key])
    return args


def _named_errors(name: str, build):
    """``build()``, its value errors said as the policy's (``policy 'klass': tau=2 must lie in (0, 1]``)."""
    try:
        return build()
    except (ValueError, TypeError) as err:
        message = str(err)
        if message.startswith("policy ") or "policy '" in message:  # it names its policy (the gate's base's)
            raise
        try:
            named = type(err)(f"policy {name!r}: {message}")
        except Exception:  # an error type built otherwise: its own words
            raise err from None
        raise named from None


def with_steps(spec, args: dict | None, gen_length: int) -> dict | None:
    """``args`` with ``per_step=k`` (tokens per step, the knob `tracelock frontier` sweeps a schedule rule along)
    turned into the policy's own ``steps=gen_length // k``; other arguments pass through unchanged. One grammar:
    ``confidence:per_step=2`` means the same to ``generate``, ``eval``, ``frontier`` and `fused_generate`."""
    if not isinstance(args, dict) or "per_step" not in args or not isinstance(spec, str) or spec not in POLICIES:
        return args
    if "steps" not in inspect.signature(POLICIES[spec].__init__).parameters:
        return args  # resolve_policy names the policy's real arguments
    per_step = args["per_step"]
    if "steps" in args:
        raise ValueError(f"policy {spec!r}: give steps={args['steps']!r} or per_step={per_step!r}, not both "
                         "(per_step=k is steps=gen_length // k)")
    if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1:
        raise ValueError(f"policy {spec!r}: per_step={per_step!r} must be a whole number >= 1 (tokens per step)")
    if gen_length % per_step:
        raise ValueError(f"policy {spec!r}: per_step={per_step} does not divide gen_length={gen_length}; pick a "
                         f"divisor, or give steps=N (the total step count) instead")
    out = {k: v for k, v in args.items() if k != "per_step"}
    out["steps"] = gen_length // per_step
    return out


# what a required policy argument is, for the error that asks for it
_REQUIRED_HINTS = {"background": "a PC-Sampler token-frequency table, or a bundled model's name",
                   "controller": "a `tracelock train --out` folder",
                   "filters": "a `tracelock train-l2p --out` folder"}


def _check_kind(policy: str, name: str, value, param: inspect.Parameter) -> None:
    """A number where the signature declares a number, a bool where it declares a bool: a typo such as ``tau=abc``
    is reported as what it is, not as a value out of range."""
    ann = "" if param.annotation is inspect.Parameter.empty else str(param.annotation)
    kinds = {k for k in ("bool", "int", "float") if k in ann.replace("None", "")}
    if value is None and "None" in ann or not kinds or "str" in ann:
        return
    default = "" if param.default in (inspect.Parameter.empty, None) else f", e.g. {name}={param.default}"
    if kinds == {"bool"}:
        if not isinstance(value, bool):
            raise TypeError(f"policy {policy!r}: {name}={value!r} must be a bool, true or false{default}")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        what = "an int" if kinds == {"int"} else "a number"
        raise TypeError(f"policy {policy!r}: {name}={value!r} is not {what}; pass {what}{default}")
    if kinds == {"int"} and not isinstance(value, int):
        raise TypeError(f"policy {policy!r}: {name}={value!r} is not an int; pass a whole number{default}")
