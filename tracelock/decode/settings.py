"""`DecodeSettings`: what a user sets for a decoding run, as one object checked once where it is built.

Every entry point takes it (`fused_generate`, `reference_generate`, `generate_many`, `DecodeEngine`), or its fields
as keywords (`settings_from`), and hands the one object down: the loop, the engine, the compiled path and the stats
read it instead of a dozen loose keywords each.
"""

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from tracelock.decode.kv_cache import default_refresh_shift, validate_cache
from tracelock.decode.schedule import validate_schedule
from tracelock.names import DECODE_NAMES, unknown_name_hint


@dataclass(frozen=True)
class DecodeSettings:
    """The settings of a decoding run.

    Args:
        policy (str | Policy): a policy name (``tracelock.policies.POLICIES``) or a policy object.
        gen_length (int): positions to generate.
        block (int, optional): semi-AR block length (must divide gen_length). Default: None.
        window (int, optional): soft-crop window width. Default: None (with no block: the full region).
        policy_args (dict, optional): keyword arguments of a named policy, e.g. ``{"tau": 0.9}``.
        temperature (float): 0 = greedy; > 0 samples by Gumbel-max. Default: 0.0.
        top_p (float, optional): nucleus filter in (0, 1], Dream's ``top_p_logits``: each slot keeps its most likely
            tokens up to the one that takes their probability past ``top_p``; sampling, confidences and entropies read
            the kept tokens only (as Dream's ``sample_tokens``). None or 1: every token. Default: None.
        top_k (int, optional): keep the ``top_k`` most likely tokens of each slot (after ``top_p``, as Dream). Default:
            None (every token).
        cfg_scale (float): LLaDA's classifier-free guidance scale. Default: 0.0.
        stop_at_eot (bool): a committed end token finishes its row. Default: False (paper presets).
        idle_steps (bool): reproduce the reference release's block-advance artifact. Default: False.
        seed (int): seed of sampling and random policies. Default: 0.
        cache (str, optional): approximate KV cache (`tracelock.decode.kv_cache`): "prefix" recomputes the
            positions from the last refresh's pointer to the end, "dual" only up to the commit region's end.
            A refresh is a full forward that is also a step. Default: None (every step is a full forward).
        refresh_every (int, optional): with ``cache``, also refresh a row after this many steps. Default: None.
        refresh_shift (int, optional): with ``cache`` and ``window``, refresh a row when its window's left end has
            moved this far since the last refresh. Default: window // 2 (`effective_refresh_shift`). Blocks refresh
            at every block start.

    Examples::

        settings = DecodeSettings(policy="threshold", policy_args={"tau": 0.9}, gen_length=64, block=16)
        tokens, stats = tracelock.fused_generate(model, ids, settings)
    """

    policy: object
    gen_length: int
    block: int | None = None
    window: int | None = None
    policy_args: Mapping | None = None
    temperature: float = 0.0
    cfg_scale: float = 0.0
    stop_at_eot: bool = False
    idle_steps: bool = False
    seed: int = 0
    cache: str | None = None
    refresh_every: int | None = None
    refresh_shift: int | None = None
    top_p: float | None = None
    top_k: int | None = None

    def __post_init__(self):
        if self.policy_args is not None and not isinstance(self.policy_args, Mapping):
            raise TypeError(f"policy_args must be a dict of the policy's keyword arguments, e.g. {{'tau': 0.9}}, "
                            f"got {type(self.policy_args).__name__} {self.policy_args!r}")
        for name, zero in (("temperature", "greedy"), ("cfg_scale", "no classifier-free guidance")):
            value = getattr(self, name)
            # a real number (None, a string or inf would fail deep in the loop, or decode garbage)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
                raise ValueError(f"{name}={value!r} must be a finite number >= 0 (0 = {zero})")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1):
            raise ValueError(f"top_p={p!r} must lie in (0, 1] (1 or None: every token)")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
            raise ValueError(f"top_k={k!r} must be an int >= 1 (None: every token)")
        validate_schedule(self.gen_length, self.block, self.window, self.idle_steps)
        validate_cache(self.cache, self.refresh_every, self.refresh_shift, self.schedule_kind, self.cfg_scale)

    @property
    def effective_refresh_shift(self) -> int | None:
        """``refresh_shift``, or for a window's cache its default (`default_refresh_shift`: half a window); kept apart
        from the field, so settings derived with another window get that window's default."""
        if self.cache is not None and self.refresh_shift is None and self.schedule_kind == "window":
            return default_refresh_shift(self.window)
        return self.refresh_shift

    @property
    def filtered(self) -> bool:
        """Whether ``top_p`` / ``top_k`` cut the distributions (the steps then read the logits)."""
        return (self.top_p is not None and self.top_p < 1) or self.top_k is not None

    @property
    def schedule_kind(self) -> str:
        return "block" if self.block else "window" if self.window else "full"

    def record(self, policy) -> dict:
        """`DecodeStats.settings`: the run's settings as every driver records them, ``policy`` as built."""
        return dict(self.key(), refresh_shift=self.effective_refresh_shift, policy=repr(policy),
                    schedule=self.schedule_kind)

    def key(self) -> tuple:
        """The settings by value, beside the policy (an engine cache's key)."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self) if f.name not in ("policy", "policy_args"))


FIELDS = tuple(f.name for f in fields(DecodeSettings))


def settings_from(settings, overrides: dict, caller: str) -> DecodeSettings:
    """The run's `DecodeSettings`: ``settings`` with ``overrides`` (its fields as keywords) applied, or the
    overrides alone; an unknown keyword names the fields."""
    unknown = [k for k in overrides if k not in FIELDS]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}; the decoding settings are: "
                        f"{', '.join(FIELDS)}{unknown_name_hint(unknown[0], FIELDS, DECODE_NAMES)}")
    if settings is None:
        missing = [k for k in ("policy", "gen_length") if k not in overrides]
        if missing:
            raise TypeError(f"{caller}() needs {' and '.join(f'{k}=' for k in missing)} (or settings=DecodeSettings("
                            "policy=..., gen_length=...))")
        return DecodeSettings(**overrides)
    if not isinstance(settings, DecodeSettings):
        raise TypeError(f"settings must be a tracelock.DecodeSettings, got {type(settings).__name__}; pass the "
                        "decoding settings as DecodeSettings(...) or as keywords")
    return replace(settings, **overrides) if overrides else settings
