"""The bundled testbed: synthetic, automatically checkable tasks for the tiny masked diffusion LM (docs/testbed.md).

`math`: GSM8K-style word problems with worked answers ending in ``#### N``; `code`: HumanEval-style functions
(signature + docstring prompt, body completion, hidden ``check(candidate)`` tests). Answers are drawn from a diverse
distribution (phrasings, orders, equivalent forms) so that the commitment problem exists.
"""

from tracelock.tasks import (
    SPLITS,
    TASKS,
    Example,
    approx_tokens,
    code_program,
    held_out,
    normalize,
    resample_answer,
    sample,
    score,
    split_of,
)

__all__ = ["SPLITS", "TASKS", "Example", "approx_tokens", "code_program", "held_out", "normalize",
           "resample_answer", "sample", "score", "split_of"]
