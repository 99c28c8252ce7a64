"""The optional dependencies a command needs (setup.py's extras), checked when the command starts: a missing one is
a one-line error naming the extra to install, before any model loads or any point decodes."""

import importlib

# extra: the modules it brings that the commands below import
EXTRAS = {"report": ("matplotlib",), "quant": ("torchao",), "lm-eval": ("lm_eval",)}


class MissingExtraError(RuntimeError):
    """A command's optional dependency is not installed (the message names the extra)."""


def require_extra(extra: str, command: str, why: str) -> None:
    """Raise `MissingExtraError` unless every module of ``extra`` imports; ``why`` says what ``command`` uses it for."""
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            raise MissingExtraError(
                f"tracelock {command} {why} with {module}, which is not installed: pip install \"tracelock[{extra}]\" "
                f"(in a clone: pip install -c constraints.txt --no-build-isolation -e \".[{extra}]\")") from None
