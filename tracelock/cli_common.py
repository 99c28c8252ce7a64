"""What every `tracelock` subcommand shares: help that shows each option's default, old option spellings kept
for one release as deprecated aliases, ``--threads`` and ``--quiet``, and the item-count and task-list
conventions. The grammar is written down in docs/cli.md.

Nothing here imports torch: building the parser must stay cheap (`tracelock --help` under 0.5 s).
"""

import argparse
import os
import sys

from tracelock.progress import QUIET_ENV

# the release that drops the deprecated spellings
REMOVED_IN = "0.2"
TESTBED_TASKS = ("math", "code")
# `tracelock.policies.POLICIES` for the help texts, without importing torch (tested equal)
POLICY_NAMES = ("confidence", "entropy", "factor", "l2p", "l2p-hidden", "maskgit_plus", "origin", "random",
                "threshold", "topk", "topk_margin", "tracelock")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help states its default already, the option is
    required or a flag, or it has no default (then the help says what leaving it out does)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (action.help is argparse.SUPPRESS or "default" in text.lower() or action.required
                or not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS or default == []
                or isinstance(action, argparse._StoreConstAction | argparse._VersionAction | argparse._HelpAction)):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with `HelpFormatter`, for the top-level parser and every subcommand."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def warn_deprecated(prog: str, old: str, new: str) -> None:
    print(f"{prog}: {old} is deprecated, use {new} (the old spelling goes away in tracelock {REMOVED_IN})",
          file=sys.stderr, flush=True)


class _DeprecatedAlias(argparse.Action):
    """An old spelling of an option: hidden from --help, stores into the new option's dest, and says on stderr
    what to write instead."""

    def __init__(self, option_strings, dest, *, new: str, **kwargs):
        kwargs["help"] = argparse.SUPPRESS
        kwargs.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        warn_deprecated(parser.prog, option_string, self.new)
        setattr(namespace, self.dest, values)


def add_alias(parser, old: str, new: str, *, dest: str, **kwargs) -> None:
    """Keep ``old`` working as a deprecated spelling of the option ``new`` (same ``dest``; ``type`` etc. as ``new``).
    ``parser`` may be a mutually exclusive group that holds ``new``, so a required option can be given either way."""
    parser.add_argument(old, action=_DeprecatedAlias, new=new, dest=dest, **kwargs)


def positive_int(text: str) -> int:
    """argparse type of counts that must be at least 1 (``--limit``, ``--batch-size``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def thread_count(text: str) -> int:
    """argparse type of ``--threads``: at least 1, at most 4 threads per core (at least 64): OpenMP allocates every
    thread's state up front, and a huge count ends the process with its own out-of-memory message."""
    value, limit = positive_int(text), max(64, 4 * (os.cpu_count() or 1))
    if value > limit:
        raise argparse.ArgumentTypeError(f"{value} threads on {os.cpu_count()} cores; pass at most {limit}")
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


def add_limit(parser, *, help: str, default=None, old: tuple = ()) -> None:
    """The item count, ``--limit N``; ``old`` spellings (``--n``, ``--num``) stay as deprecated aliases."""
    parser.add_argument("--limit", type=positive_int, default=default, metavar="N", help=help)
    for spelling in old:
        add_alias(parser, spelling, "--limit", dest="limit", type=positive_int, metavar="N")


def add_model_dtype(parser, *, old: tuple = ("--dtype",)) -> None:
    """The backbone's dtype, ``--model-dtype`` (old: ``--dtype``, which elsewhere names a storage precision)."""
    choices = ["float32", "bfloat16", "float16"]
    parser.add_argument("--model-dtype", default="float32", choices=choices,
                        help="dtype of the backbone's weights and compute (float16 needs a GPU)")
    for spelling in old:
        add_alias(parser, spelling, "--model-dtype", dest="model_dtype", choices=choices)


def split_tasks(text: str) -> list[str]:
    """Comma-separated task names as `tracelock eval` spells them (``testbed:math``, ``gsm8k:PATH``, ...); a bare
    testbed task name (``math``, or ``code`` in ``testbed:math,code``) stands for ``testbed:NAME``."""
    out = []
    for part in (t.strip() for t in text.split(",")):
        if part and part.partition("@")[0] in TESTBED_TASKS:
            part = "testbed:" + part
        if part:
            out.append(part)
    if not out:
        raise ValueError(f"--tasks {text!r} names no task; e.g. --tasks testbed:math,testbed:code")
    return out


def testbed_task_names(text: str) -> list[str]:
    """``--tasks`` of the commands that run the testbed's own tasks only (demo, testbed-eval): their bare names."""
    names = []
    for task in split_tasks(text):
        name = task.removeprefix("testbed:")
        if name not in TESTBED_TASKS:
            raise ValueError(f"--tasks: {task!r} is not a testbed task; this command runs "
                             f"{', '.join('testbed:' + t for t in TESTBED_TASKS)}")
        names.append(name)
    return names


def parse_policy_spec(text: str) -> tuple[str, dict]:
    """``name[:key=value[:key=value]]`` -> (name, {key: value}); values are JSON when they parse (0.9, true), else
    strings. The policy and its arguments are checked when the policy is built (`tracelock.policies.make_policy`)."""
    import json

    name, *pairs = text.strip().split(":")
    args = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"policy spec {text!r}: {pair!r} must look like key=value, e.g. threshold:tau=0.9")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    if not name:
        raise ValueError(f"policy spec {text!r} names no policy; e.g. threshold:tau=0.9")
    return name, args


def policy_and_args(spec: str, pairs: list) -> tuple[str, dict]:
    """``--policy SPEC`` and repeated ``--policy-arg K=V`` -> (name, keyword arguments); ``--policy-arg`` wins."""
    name, args = parse_policy_spec(spec)
    for pair in pairs:
        if "=" not in pair or pair.startswith("="):
            raise ValueError(f"--policy-arg {pair!r} must look like key=value, e.g. tau=0.9")
        args.update(parse_policy_spec(f"{name}:{pair}")[1])
    return name, args


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings count once), from sysfs; the logical CPU count
    where sysfs does not say."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as pkg, open(topology + "core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", cpu))
    return max(1, len(cores))


def default_threads() -> int:
    """``$OMP_NUM_THREADS`` when set to a positive number, else the physical cores available."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else physical_cores()


def add_runtime_options(parser) -> None:
    """``--threads`` and ``--quiet``, on every subcommand (one that defines ``--threads`` itself keeps its own)."""
    if "--threads" not in parser._option_string_actions:
        parser.add_argument("--threads", type=thread_count, default=None, metavar="N",
                            help=f"torch CPU threads of this process (default: $OMP_NUM_THREADS if set, else the "
                                 f"physical cores, {default_threads()} here, or the cores the load leaves free when "
                                 "the machine is busy at the start: threads that wait for a core make decoding many "
                                 "times slower)")
    if "--quiet" not in parser._option_string_actions:
        parser.add_argument("--quiet", action="store_true",
                            help="no progress bars or status lines on stderr (results and errors still print)")


def threads_for_load(threads: int | None, default: int, cores: int, load: float) -> tuple[int, str | None]:
    """(torch threads to use, a notice or None) for ``--threads`` (None: not given) on a machine whose load average
    is ``load`` over ``cores`` cores. Threads that wait for a core stall each other at every op: on a shared 2-core
    machine two threads made `tracelock demo --model testbed-dream` 15x slower than one. So the default comes down to
    the cores the load leaves free, and an explicit count above them is kept but called out."""
    free = max(1, int(cores - load + 0.5))
    if threads is None and default > free:
        return free, (f"this machine is busy (load average {load:.1f} on {cores} cores): using {free} torch "
                      f"thread{'s' if free > 1 else ''} instead of {default}, as threads that wait for a core make "
                      "decoding many times slower; --threads N sets the count")
    if threads is not None and threads > free:
        return threads, (f"--threads {threads} on a busy machine (load average {load:.1f} on {cores} cores): threads "
                         f"that wait for a core make decoding many times slower; --threads {free} may well be faster")
    return threads or default, None


def apply_runtime_options(args) -> None:
    """Set the thread count and the quiet switch for this process and the processes it starts. torch reads
    ``OMP_NUM_THREADS`` when it loads, which the CLI does only inside a command, after this. The busy-machine notice
    prints even with --quiet: it says why the command may run slowly, or with fewer threads than the default."""
    if getattr(args, "quiet", False):
        os.environ[QUIET_ENV] = "1"
    threads = getattr(args, "threads", None) or None  # testbed-train's --threads 0 is its default
    if threads is not None or "OMP_NUM_THREADS" not in os.environ:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        n, notice = threads_for_load(threads, default_threads(), physical_cores(), load)
        if notice:
            print(f"{getattr(args, 'command', 'tracelock')}: {notice}", file=sys.stderr, flush=True)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(n)
