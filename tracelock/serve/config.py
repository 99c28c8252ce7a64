"""What the server serves and what a request may choose: the allowed policies, the schedule, and the mapping of
``max_tokens`` to a generation length the schedule accepts.

A decode engine runs one setting for all its rows (`DecodeSetting`: policy, generation length, temperature, seed), so
a request is served by the engine of its setting. ``max_tokens`` is rounded up to a multiple of the schedule's width
(the block, or the window), or with ``--gen-lengths`` to the shortest listed length that holds it (fewer settings,
so fuller batches), and the response's usage says which ``gen_length`` decoded it; the answer itself is cut to
``max_tokens`` tokens (a row leaves the batch as soon as a token past them is committed).
"""

from dataclasses import dataclass, field

from tracelock.serve.protocol import APIError

# keys of a served policy spec that set its decoding (`fused_generate`'s), not the policy's own arguments
DECODE_KEYS = ("block", "window", "cache", "refresh_every", "refresh_shift")


@dataclass(frozen=True)
class DecodeSetting:
    """What every row of one decode engine shares."""

    policy: str  # the allowed spec's label, e.g. "threshold:tau=0.9"
    gen_length: int
    temperature: float = 0.0
    seed: int = 0
    top_p: float | None = None
    top_k: int | None = None


@dataclass
class ServedPolicy:
    """An allowed policy: its label, name and own arguments, and the decoding keywords it runs with."""

    label: str
    name: str
    args: dict
    decode: dict  # block / window and the KV cache's keywords

    @property
    def width(self) -> int:
        return self.decode.get("block") or self.decode["window"]

    def policy_args(self, gen_length: int) -> dict:
        """The policy's own arguments at a generation length (``per_step=k`` becomes ``steps=gen_length // k``)."""
        from tracelock.policies import with_steps

        return with_steps(self.name, self.args, gen_length)


def remembers(name: str) -> bool:
    """Whether the named policy keeps a memory per slot from step to step (CreditDecoding, KLASS, LESS): such a rule
    decodes greedily and in blocks (`tracelock.decode.context.check_memory_rule`)."""
    from tracelock.policies import POLICIES

    return bool(getattr(POLICIES.get(name), "reads_vocab", False))


def parse_served_policies(text: str, *, block: int | None, window: int | None, cache: str | None) -> list:
    """The `ServedPolicy` list of ``--policy`` (comma-separated ``name[:key=value...]``; the first is the default).

    ``block=N`` / ``window=N`` / ``cache=...`` / ``refresh_every`` / ``refresh_shift`` inside a spec override the
    server's ``--block`` / ``--window`` / ``--cache`` for that policy.
    """
    from tracelock.decode.kv_cache import validate_cache
    from tracelock.eval.runner import parse_policies

    try:
        specs = parse_policies(text)
    except ValueError as err:  # its messages name eval's --policies
        raise ValueError(str(err).replace("--policies", "--policy")) from None
    served = []
    for spec in specs:
        if spec.name == "oracle":
            raise ValueError("--policy: oracle replays reference tokens and cannot be served")
        if "schedule" in spec.args:
            raise ValueError(f"--policy {spec.label}: set the schedule with block=N or window=N (or --block / "
                             "--window), not schedule=")
        args = {k: v for k, v in spec.args.items() if k not in DECODE_KEYS}
        decode = {k: v for k, v in spec.args.items() if k in DECODE_KEYS}
        if "block" in decode and "window" in decode:
            raise ValueError(f"--policy {spec.label}: give block=N or window=N, not both")
        if "block" not in decode and "window" not in decode:
            decode.update(block=block) if block or not window else decode.update(window=window)
        decode.setdefault("cache", cache)
        width = decode.get("block") or decode.get("window")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"--policy {spec.label}: the block / window width must be a positive int, got {width!r}")
        try:
            validate_cache(decode["cache"], decode.get("refresh_every"), decode.get("refresh_shift"),
                           "block" if "block" in decode else "window", 0.0)
        except ValueError as err:  # its message names the keyword, not the option it came from
            raise ValueError(f"--policy {spec.label}: {err}") from None
        if "window" in decode and remembers(spec.name):
            raise ValueError(f"--policy {spec.label}: {spec.name} keeps a memory per slot of a block, which a sliding "
                             f"window moves: serve it in blocks (--block N, or block=N in its spec), not in a window "
                             f"of {decode['window']}")
        served.append(ServedPolicy(spec.label, spec.name, args, {k: v for k, v in decode.items() if v is not None}))
    return served


@dataclass
class ServeConfig:
    """The server's settings (see ``tracelock serve --help``)."""

    model_name: str
    policies: list  # ServedPolicy, the first is the default
    max_positions: int
    max_tokens: int = 256  # the largest max_tokens a request may ask for
    default_max_tokens: int = 128  # a request without max_tokens
    max_batch: int = 16
    gen_lengths: tuple | None = None  # the only generation lengths engines run; None: every multiple of the width
    api_key: str | None = field(default=None, repr=False)  # what /v1/* requests must send; None: no key
    by_label: dict = field(init=False, repr=False)

    def __post_init__(self):
        from tracelock.decode.schedule import validate_schedule

        self.by_label = {p.label: p for p in self.policies}
        for p in self.policies:
            if "per_step" in p.args and self.gen_lengths is None:
                try:  # every generation length is then a multiple of the width: per_step must divide it
                    p.policy_args(p.width)
                except ValueError as err:
                    raise ValueError(f"--policy {p.label}: {err} (every generation length is a multiple of the "
                                     f"block / window width {p.width})") from None
        if self.gen_lengths is not None:
            self.gen_lengths = tuple(sorted(set(self.gen_lengths)))
            if self.max_tokens > self.gen_lengths[-1]:
                raise ValueError(f"--max-tokens {self.max_tokens} is more than the longest --gen-lengths "
                                 f"{self.gen_lengths[-1]}; lower it or add a longer generation length")
            for p in self.policies:
                for g in self.gen_lengths:
                    try:
                        validate_schedule(g, p.decode.get("block"), p.decode.get("window"))
                        p.policy_args(g)
                    except ValueError as err:
                        raise ValueError(f"--gen-lengths {g} does not suit policy {p.label}: {err}") from None

    def policy(self, requested: str | None) -> ServedPolicy:
        """The allowed policy a request names (its label, or its bare name when one allowed policy has that name);
        the default when it names none."""
        if requested is None:
            return self.policies[0]
        if requested in self.by_label:
            return self.by_label[requested]
        same_name = [p for p in self.policies if p.name == requested]
        if len(same_name) == 1:
            return same_name[0]
        raise APIError(400, f"policy {requested!r} is not allowed on this server; allowed: "
                            f"{', '.join(self.by_label)}", "policy")

    def gen_length(self, policy: ServedPolicy, max_tokens: int | None, param: str = "max_tokens") -> tuple:
        """(max_tokens, gen_length): the request's cap on the answer and the generation length that decodes it:
        the shortest of ``gen_lengths`` that holds ``max_tokens``, else ``max_tokens`` rounded up to a multiple of
        the policy's block / window width."""
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        if max_tokens < 1:
            raise APIError(400, f"{param}={max_tokens} must be >= 1", param)
        if max_tokens > self.max_tokens:
            raise APIError(400, f"{param}={max_tokens} is more than this server allows ({self.max_tokens}); "
                                f"ask for at most {self.max_tokens}", param)
        if self.gen_lengths is not None:
            return max_tokens, next(g for g in self.gen_lengths if g >= max_tokens)
        width = policy.width
        return max_tokens, -(-max_tokens // width) * width

    def setting(self, policy: ServedPolicy, gen_length: int, temperature: float | None, seed: int | None,
                top_p: float | None = None, top_k: int | None = None):
        """The `DecodeSetting` of a request (seed matters only when sampling, so greedy requests share engines). A
        rule with a memory per slot decodes greedily from whole distributions: a request that asks it to sample, or
        to cut the distributions (``top_p`` / ``top_k``), is a 400 naming the field."""
        temperature = float(temperature or 0.0)
        top_p = None if top_p in (None, 1) else float(top_p)
        for name, value in (("top_p", top_p), ("top_k", top_k)):
            if value is not None and remembers(policy.name):
                raise APIError(400, f"{name}={value:g}: the policy {policy.label!r} keeps a memory per slot and reads "
                                    f"whole distributions; leave {name} out, or choose another of this server's "
                                    f"policies ({', '.join(self.by_label)})", name)
        if temperature > 0 and remembers(policy.name):
            raise APIError(400, f"temperature={temperature:g}: the policy {policy.label!r} keeps a memory per slot and "
                                "decodes greedily; send temperature 0 (or leave it out), or choose another of this "
                                f"server's policies ({', '.join(self.by_label)})", "temperature")
        return DecodeSetting(policy.label, gen_length, temperature, int(seed or 0) if temperature > 0 else 0, top_p,
                             top_k)

    def check_prompt(self, prompt_tokens: int, gen_length: int, param: str) -> None:
        if prompt_tokens + gen_length > self.max_positions:
            raise APIError(400, f"{param} is {prompt_tokens} tokens; with the generation length {gen_length} that "
                                f"exceeds the model's context of {self.max_positions} tokens; shorten the "
                                "prompt or lower max_tokens", param, code="context_length_exceeded")
