"""`tracelock lm-eval ARGS...`: lm-evaluation-harness's own command line, with the models of installed packages'
``lm_eval.models`` entry points (this package's ``tracelock``) registered first.

lm-eval releases that discover model plugins themselves need none of this (``lm_eval --model tracelock``); 0.4.13
resolves ``--model`` against its built-in table only, so this wrapper adds the entry points to lm-eval's own
registry, exactly as plugin discovery does, and hands every argument to lm-eval unchanged.
"""

import sys

ENTRY_POINT_GROUP = "lm_eval.models"


def register_entry_point_models() -> list:
    """Register every ``lm_eval.models`` entry point lm-eval does not know yet; returns the names added.

    The entry point itself is registered (lm-eval's registry loads it lazily), so a broken plugin fails only when
    it is asked for.
    """
    from importlib.metadata import entry_points

    import lm_eval.models  # noqa: F401  (the built-in table first: lm-eval fills it only into an empty registry)
    from lm_eval.api.registry import model_registry

    added = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in model_registry:
            model_registry.register(ep.name, target=ep)
            added.append(ep.name)
    return added


def run_lm_eval(args) -> int:
    from tracelock.extras import require_extra

    # `tracelock lm-eval --help` too: without the extra it says how to install it, in a clone as well
    require_extra("lm-eval", "lm-eval", "runs lm-evaluation-harness's command line")
    from lm_eval.__main__ import cli_evaluate

    register_entry_point_models()
    sys.argv = ["lm_eval", *args.args]
    cli_evaluate()
    return 0


def add_parsers(sub) -> None:
    # '+' as the only prefix character: every argument, options included, is lm-eval's and passes through as is
    p = sub.add_parser("lm-eval", prefix_chars="+", add_help=False,
                       help="lm-evaluation-harness's command line with `--model tracelock` registered; every argument "
                            "goes to lm-eval, e.g. tracelock lm-eval --model tracelock --model_args "
                            "pretrained=PATH,policy=threshold,tau=0.9,gen_length=256,block=32 --tasks gsm8k")
    p.add_argument("args", nargs="...", help="lm-eval's arguments (see `tracelock lm-eval --help`)")
    p.set_defaults(func=run_lm_eval)
