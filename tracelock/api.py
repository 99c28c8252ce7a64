"""What the public decoding entry points (`fused_generate`, `reference_generate`, and `generate_many` through them)
do before they decode (`entry_settings`): their `DecodeSettings`, built and checked once, the prompts' checks, and the
thread rule the CLI applies (`tracelock.cli_threads.threads_for_load`), said once on stderr. A named policy and its
arguments are resolved where the decode builds it (`tracelock.decode.context.start_run`, by
`tracelock.policies.resolve_policy`, the one reading of a policy the commands check theirs with too): the CLI's spec
spelling pointed at ``policy_args``, "did you mean" for a name or an argument, every error prefixed with its policy."""

import os
import sys

import torch

from tracelock.checks import check_decode_inputs
from tracelock.cli_threads import physical_cores, threads_for_load
from tracelock.decode.settings import settings_from

__all__ = ["entry_settings", "apply_thread_rule"]

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
    ``fields``, checked once as it is built), the prompts' checks (`tracelock.checks.check_decode_inputs`) and the
    thread rule. The named policy is resolved, and checked, once, where the decode builds it
    (`tracelock.policies.resolve_policy` in `tracelock.decode.context.start_run`): the settings keep its name and
    arguments as given, so a compiled engine is found again by them."""
    settings = settings_from(settings, fields, caller)
    check_decode_inputs(model, input_ids)
    apply_thread_rule()
    return settings
