"""The decoding policies behind one interface (:class:`Policy`): the published rules (LLaDA, Dream, Fast-dLLM,
Fast-dLLM++, and those since: CreditDecoding, dInfer's hierarchy, KLASS, LESS, the entropy bound, PC-Sampler) and
the learned ones (TraceLock, its gate over a training-free rule, Learn2PD); the name registry and the arguments a
named policy is built with.

Examples::

    policy = make_policy("threshold", tau=0.9)
    policy.setup(gen_length=256, num_regions=8)
"""

from __future__ import annotations

import inspect

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

__all__ = ["POLICIES", "Policy", "StepInput", "check_policy", "make_policy", "policy_args_for", "with_steps"]

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
    """Build a policy from its registry name and keyword arguments, or pass an instance through.

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
    if not isinstance(spec, str) or spec not in POLICIES:
        raise ValueError(f"unknown policy {spec!r}; known policies: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[spec]
    params = {n: p for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}
    # a policy with **kwargs (the gate's base_<name> arguments) checks those itself
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    params = {n: p for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    unknown = [] if open_ended else sorted(set(kwargs) - set(params))
    if unknown == ["per_step"] and "steps" in params:
        raise TypeError(f"policy {spec!r}: per_step (tokens per step) needs the generation length; pass it to "
                        f"fused_generate (policy_args={{'per_step': {kwargs['per_step']!r}}}), or steps=gen_length // "
                        "per_step here")
    if unknown:
        also = "; per_step (tokens per step) stands for steps" if "steps" in params else ""
        raise TypeError(
            f"policy {spec!r} takes no argument {', '.join(unknown)}; "
            f"its arguments are: {', '.join(params) or '(none)'}{also}"
        )
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        what = ", ".join(f"{n} ({_REQUIRED_HINTS[n]})" if n in _REQUIRED_HINTS else n for n in missing)
        example = ", ".join(f"{n!r}: ..." for n in missing)
        raise TypeError(f"policy {spec!r} needs {what}: pass policy_args={{{example}}} "
                        f"(on the command line: {spec}:{missing[0]}=...)")
    for name, value in kwargs.items():
        if name in params:
            _check_kind(spec, name, value, params[name])
    return cls(**kwargs)


def with_steps(spec, args: dict | None, gen_length: int) -> dict | None:
    """``args`` with ``per_step=k`` (tokens per step, the knob `tracelock frontier` sweeps a schedule rule along)
    turned into the policy's own ``steps=gen_length // k``; other arguments pass through unchanged. One grammar:
    ``confidence:per_step=2`` means the same to ``generate``, ``eval``, ``frontier`` and `fused_generate`."""
    if not isinstance(args, dict) or "per_step" not in args or not isinstance(spec, str) or spec not in POLICIES:
        return args
    if "steps" not in inspect.signature(POLICIES[spec].__init__).parameters:
        return args  # make_policy names the policy's real arguments
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


def check_policy(spec: str, args: dict | None, *, gen_length: int, num_regions: int = 1) -> None:
    """Build and set up a named policy without a model, so a bad name, argument or value fails before any model
    loads or any decoding starts (the commands call it first). A learned policy reads its controller or filters
    from disk here; whether they fit the backbone is checked when the model is there."""
    policy = make_policy(spec, **(with_steps(spec, args, gen_length) or {}))
    policy.setup(gen_length=gen_length, num_regions=num_regions)


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


def policy_args_for(model, policy, policy_args, gen_length=None) -> dict:
    """The keyword arguments a named policy is built with: ``policy_args`` (``per_step=k`` as ``steps=gen_length //
    k``), plus the backbone for a learned policy that takes ``model=`` (TraceLock, Learn2PD), so a controller or
    filter made for another backbone is refused when it loads rather than decoding silently with the wrong one."""
    args = dict(policy_args or {})
    if isinstance(gen_length, int) and not isinstance(gen_length, bool) and gen_length > 0:
        args = with_steps(policy, args, gen_length)
    cls = POLICIES.get(policy) if isinstance(policy, str) else None
    if cls is not None and "model" not in args and "model" in inspect.signature(cls.__init__).parameters:
        args["model"] = model
    return args
