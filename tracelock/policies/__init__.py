"""Heuristic decoding policies behind one interface (:class:`Policy`), and a name registry.

Examples::

    policy = make_policy("threshold", tau=0.9)
    policy.setup(gen_length=256, num_regions=8)
"""

from __future__ import annotations

import inspect

from .base import Policy, StepInput
from .dream import EntropyPolicy, MaskGitPlusPolicy, OriginPolicy, TopKMarginPolicy
from .fastdllm import FactorPolicy, ThresholdPolicy
from .l2p import L2PHiddenPolicy, L2PPolicy
from .llada import ConfidencePolicy, RandomPolicy, TopKPolicy
from .tracelock import TraceLockPolicy

__all__ = ["POLICIES", "Policy", "StepInput", "make_policy"]

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
        TraceLockPolicy,
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
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"policy {spec!r} takes no argument {', '.join(unknown)}; "
            f"its arguments are: {', '.join(accepted) or '(none)'}"
        )
    return cls(**kwargs)
