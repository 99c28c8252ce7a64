"""The names users bring from LLaDA, Dream, Fast-dLLM and vLLM (docs/coming-from.md), and the hint an unknown keyword
gets: what tracelock calls it, else the closest known name ("did you mean")."""

from tracelock.text import did_you_mean

__all__ = ["DECODE_NAMES", "SAMPLING_NAMES", "unknown_name_hint"]

_STEPS = "a policy argument here: policy_args={'steps': S} (or {'per_step': k}: S = gen_length // k)"
_REMASKING = ("the policy here: remasking='low_confidence' is policy='confidence', remasking='random' is "
              "policy='random'")
_THRESHOLD = "Fast-dLLM's rule here: policy='threshold', policy_args={'tau': 0.9}"
_CACHE = "cache='prefix' (use_cache) or cache='dual' (dual_cache) here"
_MASK = "read from the checkpoint's config here; leave it out"

# `DecodeSettings` / `fused_generate` keywords
DECODE_NAMES = {
    "steps": _STEPS,
    "block_length": "block= here (semi-AR block length; it must divide gen_length)",
    "remasking": _REMASKING,
    "max_new_tokens": "gen_length= here",
    "max_tokens": "gen_length= here",
    "max_length": "gen_length= here (the generated positions, without the prompt)",
    "alg": "the policy here: alg='entropy' is policy='entropy' (also 'origin', 'maskgit_plus', 'topk_margin')",
    "alg_temp": "a policy argument here: policy_args={'alg_temp': ...}",
    "eps": "a policy argument here: policy_args={'eps': ...}",
    "threshold": _THRESHOLD,
    "factor": "Fast-dLLM's factor rule here: policy='factor', policy_args={'f': 1.0}",
    "use_cache": _CACHE,
    "dual_cache": _CACHE,
    "mask_id": _MASK,
    "mask_token_id": _MASK,
}

# `SamplingParams` fields
SAMPLING_NAMES = {
    **{k: v.replace("gen_length= here", "max_tokens= here") for k, v in DECODE_NAMES.items()},
    "steps": _STEPS.replace("gen_length", "the generated length"),
    "gen_length": "max_tokens= here",
    "do_sample": "temperature > 0 here (0 = greedy)",
}


def unknown_name_hint(word, names, mapping: dict | None = None) -> str:
    """``"; steps= is ..."`` when ``word`` is a name another project uses (``mapping``), else `did_you_mean`."""
    note = (mapping or {}).get(word)
    if isinstance(word, str) and note:
        return f"; {word}= is {note}"
    return did_you_mean(word, names)
