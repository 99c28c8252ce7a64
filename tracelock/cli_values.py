"""The argparse value types of the CLI and their bounds: counts, lengths, widths, seeds and thread counts in range
(`bounded_int`, the `MAX_*` ceilings), finite non-negative numbers, and output and input files checked before any
work.

Nothing here imports torch: building the parser must stay cheap (`tracelock --help` takes no torch import).
"""

import argparse
import os

# the ceilings of the sizes a command allocates, loops or starts processes by before any work: past one a
# command would allocate or loop for minutes before failing, or be killed by the kernel's out-of-memory handler
MAX_COUNT = 10_000_000  # any count: items, steps, epochs (a count's own ceiling may be lower)
MAX_GEN_LENGTH = 1 << 16  # generated positions (the checkpoint's own maximum is checked before it loads)
MAX_BATCH = 65_536  # rows decoded or trained together (testbed-train's ceiling)
MAX_WIDTH = 1 << 16  # a layer's width (hidden units, code dimensions)
MAX_WORKERS = max(64, 4 * (os.cpu_count() or 1))  # processes or threads started at once


def positive_int(text: str) -> int:
    """argparse type of counts that must be at least 1 (``--limit``, ``--batch-size``), and at most `MAX_COUNT`."""
    return bounded_int(MAX_COUNT)(text)


def bounded_int(limit: int, why: str = "", minimum: int = 1):
    """argparse type of a whole number in [``minimum``, ``limit``]; ``why`` says what the ceiling protects."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        if value > limit:
            raise argparse.ArgumentTypeError(f"{value} is more than {limit:,}{f' ({why})' if why else ''}; pass at "
                                             f"most {limit}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages; the fuzz tests read it as an int option
    return parse


def nonneg_float(text: str) -> float:
    """argparse type of a finite number >= 0 (``--temperature``, ``--cfg-scale``: 0 turns them off)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0 (0: off)")
    return value


nonneg_float.__name__ = "float"


def gen_length_int(text: str) -> int:
    """argparse type of a generation length: 1 to `MAX_GEN_LENGTH` (the checkpoint's own maximum, prompt included,
    is checked before its weights load)."""
    return bounded_int(MAX_GEN_LENGTH, "generated positions")(text)


def batch_int(text: str) -> int:
    """argparse type of a batch size: 1 to `MAX_BATCH` rows."""
    return bounded_int(MAX_BATCH, "rows at once")(text)


def workers_int(text: str) -> int:
    """argparse type of a process or worker count: 1 to `MAX_WORKERS` (4 per core, at least 64)."""
    return bounded_int(MAX_WORKERS, f"processes on {os.cpu_count()} cores")(text)


def width_int(text: str) -> int:
    """argparse type of a layer width: 1 to `MAX_WIDTH`."""
    return bounded_int(MAX_WIDTH, "units of one layer")(text)


def seed_int(text: str) -> int:
    """argparse type of ``--seed``: a whole number torch's and Python's generators take (a signed 64-bit integer; a
    larger one failed inside torch, "Overflow when unpacking long long", naming no option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not -(1 << 63) <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"{value} is past a 64-bit seed; pass one in [-2**63, 2**63)")
    return value


def thread_count(text: str) -> int:
    """argparse type of ``--threads``: at least 1, at most 4 threads per core (at least 64): OpenMP allocates every
    thread's state up front, and a huge count ends the process with its own out-of-memory message."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    if value > MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"{value} threads on {os.cpu_count()} cores; pass at most {MAX_WORKERS}")
    return value


def output_file(text: str) -> str:
    """argparse type of an ``--out`` that names a file (a JSON or JSONL result): not empty, not an existing folder
    (writing it failed late, after the work, with a bare ``[Errno 21] Is a directory``)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; pass a file path such as results.json")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; pass a file path (e.g. "
                                         f"{os.path.join(text, 'results.json')})")
    return text


def existing_file(option: str):
    """argparse type of an input file (``--prompts`` of `generate`): it must exist and be a file, said with the
    option, before the model loads (else a bare ``[Errno 2]`` came after it)."""
    def parse(text: str) -> str:
        if not os.path.exists(text):
            raise argparse.ArgumentTypeError(f"{text!r}: no such file")
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r} is a folder; pass a JSONL file, one {{\"prompt\": ...}} a line")
        return text

    return parse


def input_folder(what: str):
    """argparse type of an input folder (``--traces``, ``--cache``, ``--encoder``): not empty. An empty value read as
    the working directory, and its missing index.json named no option; a missing folder is named, path and all, by
    the reader that opens it."""
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"an empty path; pass {what}")
        return text

    return parse
