"""The grammar of policy specs, the one reading of ``name[:key=value...]`` in every command (``--policy``,
``--policies``, ``frontier --sweep``, ``serve``): a singular option takes one spec (`parse_policy_spec`,
`policy_and_args`), a plural one a comma-separated list, where ``key=v1,v2`` lists values of one key: one policy per
value in ``--policies``, a curve's points in ``frontier --sweep`` (`policy_groups`, `expand_policy_list`).

Nothing here imports torch: the names are `tracelock.policies.POLICIES` as text (tested equal).
"""

import re

from tracelock.text import did_you_mean

# `tracelock.policies.POLICIES` for the help texts, without importing torch (tested equal)
POLICY_NAMES = ("confidence", "credit", "eb", "entropy", "factor", "frechet", "gate", "hierarchy", "klass", "l2p",
                "l2p-hidden", "less", "maskgit_plus", "origin", "pc", "random", "threshold", "topk", "topk_margin",
                "tracelock")


def spec_value(text: str):
    """A spec's value: JSON where it parses (0.9, true, 32), None for ``none`` as for JSON's ``null`` (an optional
    argument left unset, ``hierarchy:tau=none``), else the text (a path, a name). The one reading of a value in
    every command's specs (``--policy``, ``--policies``, ``--sweep``, ``serve``)."""
    import json

    if text.strip().lower() == "none":
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _pairs(text: str, pairs: list, option: str) -> list[tuple[str, str]]:
    out = []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{option} {text!r}: {pair!r} must look like key=value, e.g. threshold:tau=0.9")
        out.append((key.strip(), value))
    return out


def policy_groups(text: str, *, option: str = "--policies", names=None) -> list[tuple]:
    """The one list grammar of policy specs: comma-separated ``name[:key=value...]``, where an item that is no
    policy's name (``0.7`` in ``threshold:tau=0.9,0.7``) is one more value of the key before it, and the
    ``:key=value`` pairs after such a value hold for every value (``threshold:tau=0.5,0.7:curve=late``). Returns
    [(name, text as typed or None, [(key, value text)], index of the listed key or None, [its values])] in order.
    ``names``: the policy names (default `POLICY_NAMES` and oracle)."""
    names = tuple(names or (*POLICY_NAMES, "oracle"))
    groups = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        head, *rest = item.split(":")
        head = head.strip()
        if head in names or not groups or "=" in head:
            if head not in names:
                raise ValueError(f"{option}: {head!r} is not a policy; known: {', '.join(names)}"
                                 f"{did_you_mean(head, names)}")
            groups.append([head, item, _pairs(item, rest, option), None, None])
            continue
        group = groups[-1]
        # one or two characters are a value, not a near miss of a short name ("b" is no misspelt "eb")
        close = did_you_mean(head, names) if len(head) > 2 else ""
        if not group[2] or close and not re.fullmatch(r"[-+.\deE]+|true|false|null|none", head.lower()):
            # no key to list values of, or a near miss of a policy's name rather than a value
            raise ValueError(f"{option}: {head!r} is not a policy; known: {', '.join(names)}{close}")
        last = len(group[2]) - 1
        if group[3] is None:
            group[3], group[4] = last, [group[2][last][1]]
        elif group[3] != last:
            raise ValueError(f"{option} {text!r} lists values of two keys of {group[0]} ({group[2][group[3]][0]}, "
                             f"{group[2][last][0]}); list one key per policy")
        group[4].append(head)
        group[1] = None
        group[2] += _pairs(text, rest, option)
    return [tuple(g) for g in groups]


def expand_policy_list(text: str, *, option: str = "--policies", names=None) -> list[tuple[str, str, list]]:
    """`policy_groups` with a policy per listed value: [(label, name, [(key, value text)])] in order, a policy of
    a listed key labelled ``name:key=value...`` once per value, the others labelled as typed."""
    out = []
    for name, typed, pairs, listed, values in policy_groups(text, option=option, names=names):
        if listed is None:
            out.append((typed, name, pairs))
            continue
        for value in values:
            one = [(k, value if i == listed else v) for i, (k, v) in enumerate(pairs)]
            out.append((name + "".join(f":{k}={v}" for k, v in one), name, one))
    return out


def parse_policy_spec(text: str, option: str = "--policy") -> tuple[str, dict]:
    """One spec ``name[:key=value[:key=value]]`` -> (name, {key: value}); values are JSON when they parse (0.9,
    true; ``none`` or ``null``: None), else strings (`spec_value`). The arguments are checked when the policy is
    built (`tracelock.policies.resolve_policy`); a list (``threshold:tau=0.9,0.7``, ``confidence,threshold``) is refused
    here: a singular option takes one."""
    if not text.strip() or not text.strip().split(":")[0].strip():
        raise ValueError(f"{option} {text!r} names no policy; e.g. threshold:tau=0.9")
    if "," in text:
        specs = expand_policy_list(text, option=option)
        if len(specs) > 1:
            raise ValueError(f"{option} takes one policy; {text!r} is {len(specs)}: "
                             f"{', '.join(label for label, _, _ in specs)} (eval, testbed-eval and serve compare "
                             "several: --policies)")
    name, *pairs = text.strip().split(":")
    name = name.strip()
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICY_NAMES)}"
                         f"{did_you_mean(name, POLICY_NAMES)}")
    return name, {k: spec_value(v) for k, v in _pairs(text, pairs, option)}


def policy_and_args(spec: str, pairs: list) -> tuple[str, dict]:
    """``--policy SPEC`` and repeated ``--policy-arg K=V`` -> (name, keyword arguments); ``--policy-arg`` wins."""
    name, args = parse_policy_spec(spec)
    for pair in pairs:
        if "=" not in pair or pair.startswith("="):
            raise ValueError(f"--policy-arg {pair!r} must look like key=value, e.g. tau=0.9")
        if "," in pair:
            raise ValueError(f"--policy-arg {pair!r}: one value per key (a list of policies is --policies)")
        args.update(parse_policy_spec(f"{name}:{pair}")[1])
    return name, args
