"""What every `tracelock` subcommand shares: one grammar (docs/cli.md, "The grammar").

- The options several commands have are defined once, here (`OPTIONS` holds their help texts; `add_model`,
  `add_device`, `add_model_dtype`, `add_quantize`, `add_schedule`, `add_settings`, `add_policy`, `add_limit`,
  ``--threads`` and ``--quiet``), so the same flag means the same thing, and says so in the same words, in every
  subcommand.
- One setting is ``--gen-length N`` with ``--block W`` or ``--window W`` in every command that decodes; the commands
  that compare settings also take several, ``--settings GEN/WIDTH,...`` with ``--schedule``.
- A singular flag takes one value, a plural one a comma-separated list (the one list separator): ``--policy SPEC``,
  ``--policies SPEC,SPEC``, ``--tasks a,b``. Inside a spec, ``key=v1,v2`` lists values of one key: one policy per
  value in ``--policies``, a curve's points in ``frontier --sweep`` (`expand_policy_list`).
- Help that shows each option's default, old spellings kept for one release as deprecated aliases, an option of
  another command named with this one's spelling, "did you mean" for every closed set of names, one error line
  with the user's values escaped (`safe_echo`), and the thread rule the Python API shares (`threads_for_load`).

Nothing here imports torch: building the parser must stay cheap (`tracelock --help` takes no torch import).
"""

import argparse
import os
import re
import sys
import time
import unicodedata

from tracelock.progress import QUIET_ENV
from tracelock.text import did_you_mean

# the release that drops the deprecated spellings
REMOVED_IN = "0.2"
TESTBED_TASKS = ("math", "code")
TESTBED_SPLITS = ("train", "validation", "test")
# `tracelock.policies.POLICIES` for the help texts, without importing torch (tested equal)
POLICY_NAMES = ("confidence", "credit", "eb", "entropy", "factor", "frechet", "hierarchy", "klass", "l2p", "l2p-hidden",
                "less", "maskgit_plus", "origin", "pc", "random", "threshold", "topk", "topk_margin", "tracelock")


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


def safe_echo(text: str) -> str:
    """``text`` with every control or format character written as its escape (``\\r``, ``\\x1b``, ``\\u202e``), so a
    value a user typed cannot move the cursor, rewrite a terminal line or turn text around when an error names it."""
    return "".join(c.encode("unicode_escape").decode("ascii") if c == "\n" or c == "\t" or
                   unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp") else c for c in str(text))


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with `HelpFormatter`, for the top-level parser and every subcommand. Its errors are
    one line (``tracelock CMD: error: ...``, exit status 2) like every other error of the CLI, not the usage first;
    a bad choice says which one was meant; an option the command lacks is named with this command's spelling when
    another command has it (`foreign_option_hint`); ``checks`` run on the parsed arguments (cross-option rules)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # `serve --gen-length` is not `--gen-lengths`: no prefix matching
        super().__init__(*args, **kwargs)
        self.checks = []  # functions of the parsed namespace; a ValueError they raise is a usage error

    def error(self, message):
        if message.startswith("the following arguments are required"):  # an option of another command given instead?
            have = _options_of(self)
            given = getattr(self, "_given", [])
            for i, arg in enumerate(given):
                option = arg.partition("=")[0]
                if option.startswith("--") and option not in have:
                    value = arg.partition("=")[2] or (given[i + 1] if i + 1 < len(given) else "")
                    hint = foreign_option_hint(self.prog.removeprefix("tracelock ").strip(), option, value, self)
                    if hint:
                        message += f"; {option} is not an option here: {hint}"
                        break
                    close = did_you_mean(option, have)
                    if close:
                        message += f"; {option} is not an option here{close}"
                        break
        self.exit(2, f"{self.prog}: error: {safe_echo(message)}\n")

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            names = list(action.choices)
            what = "command" if isinstance(action, argparse._SubParsersAction) else "choice"
            raise argparse.ArgumentError(action, f"invalid {what}: {value!r} (choose from "
                                                 f"{', '.join(map(str, names))}){did_you_mean(value, names)}")

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        for check in self.checks:
            try:
                check(namespace)
            except ValueError as err:
                self.error(str(err))
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = self.subparser(getattr(namespace, "command", None))
            (sub or self).error(unrecognized_message(sub or self, extras))
        return namespace

    def subparser(self, name):
        """The subcommand parser ``name`` of this (top-level) parser, or None."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(name)
        return None


def _options_of(parser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


def unrecognized_message(parser, extras: list) -> str:
    """argparse's "unrecognized arguments" with the fix: the other command's option in this command's spelling
    (`foreign_option_hint`), else the closest option this command has."""
    first = next((a for a in extras if a.startswith("--")), extras[0])
    option, _, inline = first.partition("=")
    value = inline or (extras[extras.index(first) + 1] if extras.index(first) + 1 < len(extras) else "")
    command = parser.prog.removeprefix("tracelock ").strip()
    hint = foreign_option_hint(command, option, value, parser) if option.startswith("--") else None
    if hint is None and option.startswith("--"):
        hint = did_you_mean(option, _options_of(parser)).removeprefix("; ") or None
    text = f"unrecognized arguments: {' '.join(extras)}" + (f"; {hint}" if hint else "")
    return text + (f" (`tracelock {command} --help` lists its options)" if command else "")


def _setting_text(value: str) -> tuple[str, str] | None:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", value or "")
    return (m[1], m[2]) if m else None


def foreign_option_hint(command: str, option: str, value: str, parser) -> str | None:
    """What to write instead of ``option`` (an option of other commands) in ``command``, or None."""
    have = _options_of(parser)
    if option == "--schedule" and "--gen-length" in have and "--schedule" not in have:
        return f"tracelock {command} spells the schedule --block W or --window W (neither: one region)"
    if option in ("--settings", "--schedule") and "--gen-length" in have and "--settings" not in have:
        pair = _setting_text(value) if option == "--settings" else None
        if option == "--settings" and "," in (value or ""):
            return (f"tracelock {command} runs one setting: --gen-length N with --block W or --window W; "
                    "--settings GEN/WIDTH,... is for the commands that compare settings (eval, frontier, testbed-eval)")
        if pair:
            gen, width = pair
            return (f"tracelock {command} spells the setting {gen}/{width} --gen-length {gen} --block {width} "
                    f"(or --window {width})")
        return f"tracelock {command} spells the schedule --block W or --window W (neither: one region)"
    if option == "--policies" and "--policy" in have:
        return (f"tracelock {command} decodes with one policy: --policy SPEC (eval, testbed-eval and serve take "
                "--policies SPEC,SPEC)")
    if option == "--policy" and "--policies" in have:
        return f"tracelock {command} takes --policies SPEC[,SPEC...] (one spec is a list of one)"
    if option in ("--lengths", "--widths", "--gen-lengths") and "--settings" in have:
        return f"tracelock {command} takes its settings as --settings GEN/WIDTH,... (e.g. --settings 64/16,128/32)"
    # the names of LLaDA's, Dream's and Fast-dLLM's arguments (docs/coming-from.md)
    policy_option = "--policy" if "--policy" in have else "--policies" if "--policies" in have else None
    if option == "--block-length" and "--block" in have:
        return f"LLaDA's block_length is --block{' ' + value if value.isdigit() else ' W'} here"
    if option in ("--max-new-tokens", "--max-tokens") and "--gen-length" in have:
        return f"the generated length is --gen-length{' ' + value if value.isdigit() else ' N'} here"
    if option == "--steps" and policy_option:
        return (f"steps are a policy argument here: {policy_option} confidence:steps={value or 'S'} (or "
                "confidence:per_step=k, k tokens per step)")
    if option in ("--remasking", "--alg") and policy_option:
        names = {"low_confidence": "confidence"}
        return f"the rule is the policy here: {policy_option} {names.get(value, value) or 'NAME'}"
    if option == "--threshold" and policy_option:
        return f"Fast-dLLM's threshold is {policy_option} threshold:tau={value or '0.9'} here"
    if option == "--dtype" and "--model-dtype" in have:
        return "the backbone's dtype is --model-dtype"
    if option == "--task" and "--tasks" in have:
        return "use --tasks"
    if option in ("--n", "--num", "--items") and "--limit" in have:
        return f"the item count is --limit N (did you mean --limit {value}?)" if value.isdigit() else \
            "the item count is --limit N"
    return None


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
    """argparse type of counts that must be at least 1 (``--limit``, ``--batch-size``), and at most `MAX_COUNT`."""
    return bounded_int(MAX_COUNT)(text)


# the ceilings of the sizes a command allocates, loops or starts processes by before any work: past one a
# command would allocate or loop for minutes before failing, or be killed by the kernel's out-of-memory handler
MAX_COUNT = 10_000_000  # any count: items, steps, epochs (a count's own ceiling may be lower)
MAX_GEN_LENGTH = 1 << 16  # generated positions (the checkpoint's own maximum is checked before it loads)
MAX_BATCH = 65_536  # rows decoded or trained together (testbed-train's ceiling)
MAX_WIDTH = 1 << 16  # a layer's width (hidden units, code dimensions)
MAX_WORKERS = max(64, 4 * (os.cpu_count() or 1))  # processes or threads started at once


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


# ---- the options several commands share, defined once: the help of a flag is the same words in every command
# (a command may add what is its own after them); docs/cli.md's grammar table says the same
OPTIONS = {
    "--model": "the backbone: a checkpoint folder (LLaDA, Dream, or `tracelock tiny-checkpoint`), a Hugging Face Hub "
               "id (GSAI-ML/LLaDA-8B-Instruct, Dream-org/Dream-v0-Instruct-7B: read from huggingface_hub's cache, "
               "downloaded there first where the network allows), or a bundled model: testbed (alias testbed-llada) "
               "or testbed-dream",
    "--device": "where the model runs: cpu or cuda[:i]",
    "--model-dtype": "dtype of the backbone's weights and compute (float16 on CUDA only)",
    "--quantize": "the transformer blocks' weights quantized through torchao (the quant extra): int8 (CPU and CUDA), "
                  "int4 or fp8 (CUDA, --model-dtype bfloat16); the LM head, norms and activations stay in "
                  "--model-dtype (default: none, every weight in --model-dtype)",
    "--gen-length": "tokens generated per prompt (LLaDA's gen_length)",
    "--block": "semi-AR block length, divides --gen-length (LLaDA's block_length)",
    "--window": "soft-crop window width (TraceLock's schedule)",
    "--settings": "GEN/WIDTH, the generation length and the block (or window) width, e.g. 64/16; comma-separated in "
                  "the commands that compare settings (eval, frontier, testbed-eval: 64/16,128/32); one setting may be "
                  "given as --gen-length GEN with --block WIDTH or --window WIDTH instead",
    "--policy": "one policy spec name[:key=value...], e.g. threshold:tau=0.9 or confidence:per_step=2",
    "--policy-arg": "one more policy argument, repeatable; the same as :K=V in --policy",
    "--policies": "policy specs name[:key=value...], comma-separated (key=v1,v2 gives one policy per value: "
                  "threshold:tau=0.9,0.7 is threshold:tau=0.9,threshold:tau=0.7)",
    "--tasks": "tasks, comma-separated: testbed:math, testbed:code (testbed:math@validation: that split), "
               "gsm8k:PATH, humaneval[:PATH], humaneval-with-tests[:PATH], qa:PATH",
    "--threads": "torch CPU threads (default: $OMP_NUM_THREADS if set, else the physical cores, {cores} here; on a "
                 "machine busy at the start, the cores its load leaves free, said on stderr, as threads that wait for "
                 "a core make decoding many times slower)",
    "--quiet": "no progress bars, status lines or busy-machine notice on stderr (results and errors still print)",
    "--allow-uncontained-code": "run the generated code even where the sandbox cannot contain it (the kernel refuses "
                                "it the namespaces): it can then read and write what its user may. The same as "
                                "TRACELOCK_ALLOW_UNCONTAINED_CODE=1; the run's records say so (default: refused, "
                                "before anything decodes)",
}


def option_help(option: str, extra: str = "") -> str:
    """The shared help of ``option`` (`OPTIONS`), with ``extra`` (what is this command's own) after it."""
    text = OPTIONS[option].replace("{cores}", str(physical_cores()) if "{cores}" in OPTIONS[option] else "")
    return f"{text}; {extra}" if extra else text


def add_model(parser, *, default=None, extra: str = "") -> None:
    """``--model``: required unless ``default`` (a bundled model) is given."""
    parser.add_argument("--model", required=default is None, default=default, help=option_help("--model", extra))


def add_device(parser, *, default="cpu", torchrun: bool = False, extra: str = "") -> None:
    """``--device``; ``torchrun``: the command runs one process per GPU under torchrun."""
    more = "; under torchrun: cuda:LOCAL_RANK" if torchrun else ""
    parser.add_argument("--device", default=default, help=option_help("--device", extra) + more)


def add_schedule(parser, *, gen_length=None, gen_required: bool = False, block_default: str, window_default: str,
                 window_only: bool = False, block_fallback: int | None = None) -> None:
    """One setting: ``--gen-length N`` (``gen_length`` its default) and ``--block W`` or ``--window W``, or the same
    as ``--settings N/W`` (a block; `--window W` with it: a window); the ``*_default`` texts say what leaving each out
    does (``block_fallback``: the block the command takes then). A parser check makes them one setting and checks it
    (a block divides the length) in these words."""
    if gen_length is not None or gen_required:
        parser.add_argument("--gen-length", type=gen_length_int, default=None, metavar="N",
                            help=option_help("--gen-length") + (" (no default: required, or --settings N/W)"
                                                                 if gen_required else f" (default: {gen_length})"))
        parser.add_argument("--settings", metavar="GEN/WIDTH",
                            help=option_help("--settings", "here one: the same as --gen-length GEN --block WIDTH "
                                                           "(with --window: a window of WIDTH)") +
                            " (default: --gen-length and --block)")
    if window_only:
        parser.add_argument("--window", type=gen_length_int, default=int(window_default), metavar="W",
                            help=option_help("--window"))
        return
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--block", type=gen_length_int, metavar="W",
                       help=f"{option_help('--block')} (default: {block_default})")
    group.add_argument("--window", type=gen_length_int, metavar="W",
                       help=f"{option_help('--window')} (default: {window_default})")
    if gen_length is None and not gen_required:
        return

    def one_setting(args) -> None:
        if args.settings is not None:
            pairs = check_settings(args.settings)
            if len(pairs) > 1:
                raise ValueError(f"--settings {args.settings}: this command runs one setting (--settings GEN/WIDTH, "
                                 "or --gen-length N --block W); several are for eval, frontier and testbed-eval")
            (gen, width), = pairs
            if args.gen_length is not None or args.block is not None:
                raise ValueError(f"--settings {args.settings} and --gen-length / --block: give the setting once")
            args.gen_length = gen
            if args.window is None:
                args.block = width
            elif args.window != width:
                raise ValueError(f"--settings {args.settings} and --window {args.window}: the widths differ")
        if args.gen_length is None:
            if gen_required:
                raise ValueError("the following arguments are required: --gen-length (or --settings GEN/WIDTH)")
            args.gen_length = gen_length
        block = args.block if args.block or args.window else block_fallback
        try:
            check_schedule_options(args.gen_length, block, args.window)
        except ValueError as err:
            raise ValueError(f"--settings {args.settings}: {err}" if args.settings is not None else str(err)) from None

    parser.checks.append(one_setting)


def add_setting_spelling(parser, *, width: str) -> None:
    """``--settings GEN/WIDTH`` on a command that has its own ``--gen-length`` and ``--block`` or ``--window``
    (``width``): the same as ``--gen-length GEN --WIDTH-OPTION WIDTH``, one setting."""
    parser.add_argument("--settings", metavar="GEN/WIDTH",
                        help=option_help("--settings", f"here one: the same as --gen-length GEN --{width} WIDTH") +
                        f" (default: --gen-length and --{width})")

    def spelled(args) -> None:
        if args.settings is None:
            return
        pairs = check_settings(args.settings)
        if len(pairs) > 1:
            raise ValueError(f"--settings {args.settings}: this command runs one setting (--settings GEN/WIDTH, or "
                             f"--gen-length N --{width} W); several are for eval, frontier and testbed-eval")
        other = "block" if width == "window" else "window"
        if getattr(args, other, None) is not None:
            raise ValueError(f"--settings {args.settings} sets --{width}; drop --{other} (or give --gen-length N "
                             f"--{other} W instead)")
        (args.gen_length, value), = pairs
        setattr(args, width, value)

    parser.checks.append(spelled)


def check_schedule_options(gen_length: int, block, window) -> None:
    """`tracelock.decode.schedule.validate_schedule`'s rules in the command line's words, before anything loads."""
    for option, width in (("--block", block), ("--window", window)):
        if width is not None and width > gen_length:
            raise ValueError(f"{option} {width} is longer than --gen-length {gen_length}; pass at most {gen_length} "
                             f"({option} {gen_length}: the whole generation as one region)")
    if block and gen_length % block:
        # the fixes nearest to what was asked: a block near it, a generation length that it tiles, or a window
        divisors = sorted((d for d in range(2, gen_length + 1) if gen_length % d == 0),
                          key=lambda d: (abs(d - block), d))[:3] or [gen_length]
        raise ValueError(f"--block {block} does not divide --gen-length {gen_length}: semi-AR blocks must tile the "
                         f"generation; use --block {' or '.join(map(str, sorted(divisors)))} (divisors of "
                         f"{gen_length}), --gen-length {-(-gen_length // block) * block} (a multiple of {block}), or "
                         f"--window {block} for a sliding window")


def add_settings(parser, *, default: str, schedules=("auto", "block", "window"), schedule_help: str) -> None:
    """Several settings, ``--settings GEN/WIDTH,...`` with ``--schedule``, or one as ``--gen-length N`` with
    ``--block W`` / ``--window W`` (the spelling of every other command). `resolve_settings` (a parser check) turns
    the one into the other, so the command reads ``args.settings`` and ``args.schedule`` only."""
    parser.add_argument("--settings", metavar="GEN/WIDTH,...", help=f"{option_help('--settings')} (default: {default})")
    parser.add_argument("--schedule", choices=list(schedules), help=f"{schedule_help} (default: {schedules[0]})")
    parser.add_argument("--gen-length", type=gen_length_int, metavar="N",
                        help=f"{option_help('--gen-length')}: with --block or --window, one setting (default: "
                             "--settings)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--block", type=gen_length_int, metavar="W",
                       help=f"{option_help('--block')}: with --gen-length, the setting GEN/W in blocks (default: "
                            "--settings)")
    group.add_argument("--window", type=gen_length_int, metavar="W",
                       help=f"{option_help('--window')}: with --gen-length, the setting GEN/W in a window (default: "
                            "--settings)")

    def resolve_settings(args) -> None:
        given = [f for f, v in (("--gen-length", args.gen_length), ("--block", args.block),
                                ("--window", args.window)) if v is not None]
        if given:
            width = args.block if args.block is not None else args.window
            flag = "--block" if args.block is not None else "--window"
            if args.settings is not None:
                raise ValueError(f"--settings {args.settings} and {' '.join(given)}: give several settings as "
                                 "--settings GEN/WIDTH,... or one as --gen-length N --block W, not both")
            if args.gen_length is None or width is None:
                raise ValueError("one setting is --gen-length N with --block W or --window W (e.g. --gen-length 64 "
                                 "--block 16); several: --settings 64/16,128/32")
            kind = flag.removeprefix("--")
            if kind not in schedules:
                raise ValueError(f"{flag}: this command runs {' or '.join(schedules)} schedules")
            if args.schedule not in (None, kind):
                raise ValueError(f"--schedule {args.schedule} and {flag} {width}: {flag} sets the schedule; drop "
                                 "--schedule")
            args.settings, args.schedule = f"{args.gen_length}/{width}", kind
        args.settings = args.settings if args.settings is not None else default
        args.schedule = args.schedule or schedules[0]
        check_settings(args.settings)

    parser.checks.append(resolve_settings)


def check_settings(text: str) -> list[tuple[int, int]]:
    """``GEN/WIDTH`` comma-separated -> [(gen, width)], each in range (`MAX_GEN_LENGTH`)."""
    out = []
    for token in (t.strip() for t in str(text).split(",")):
        if not token:
            continue
        m = re.fullmatch(r"(\d+)/(\d+)", token)
        if not m or not 1 <= int(m[2]) <= MAX_GEN_LENGTH or not 1 <= int(m[1]) <= MAX_GEN_LENGTH:
            raise ValueError(f"--settings: {token!r} must look like GEN/WIDTH with both in 1..{MAX_GEN_LENGTH}, "
                             "e.g. 128/32")
        out.append((int(m[1]), int(m[2])))
    if not out:
        raise ValueError("--settings names no setting; e.g. --settings 64/16,128/32")
    return out


def add_policy(parser, *, required: bool = False, default=None, extra: str = "") -> None:
    """``--policy SPEC`` (one policy) and ``--policy-arg K=V`` (repeatable)."""
    names = f"names: {', '.join(POLICY_NAMES)}"
    parser.add_argument("--policy", required=required, default=default, metavar="SPEC",
                        help=option_help("--policy", f"{extra}; {names}" if extra else names))
    parser.add_argument("--policy-arg", action="append", default=[], metavar="K=V",
                        help=option_help("--policy-arg") + " (default: none)")


def add_batch_size(parser, *, default: int, extra: str = "") -> None:
    """``--batch-size`` of a command that decodes: items decoded together (at most `MAX_BATCH`)."""
    parser.add_argument("--batch-size", type=batch_int, default=default,
                        help="items decoded together" + (f"; {extra}" if extra else ""))


def add_limit(parser, *, help: str, default=None, old: tuple = ()) -> None:
    """The item count, ``--limit N``; ``old`` spellings (``--n``, ``--num``) stay as deprecated aliases."""
    parser.add_argument("--limit", type=positive_int, default=default, metavar="N", help=help)
    for spelling in old:
        add_alias(parser, spelling, "--limit", dest="limit", type=positive_int, metavar="N")


MODEL_DTYPES = ("float32", "bfloat16", "float16")


def add_model_dtype(parser, *, old: tuple = ("--dtype",)) -> None:
    """The backbone's dtype, ``--model-dtype`` (old: ``--dtype``, which elsewhere names a storage precision)."""
    choices = list(MODEL_DTYPES)
    parser.add_argument("--model-dtype", default="float32", choices=choices, help=option_help("--model-dtype"))
    for spelling in old:
        add_alias(parser, spelling, "--model-dtype", dest="model_dtype", choices=choices)


QUANTIZE_FORMATS = ("int8", "int4", "fp8")  # tracelock.models.quantize.FORMATS, without importing torch (tested equal)


def add_quantize(parser) -> None:
    """``--quantize FORMAT``: quantized weights (`tracelock.models.quantize`); checked before the model loads."""
    parser.add_argument("--quantize", choices=list(QUANTIZE_FORMATS), metavar="FORMAT",
                        help=option_help("--quantize") + f"; formats: {', '.join(QUANTIZE_FORMATS)}")


# every task kind `tracelock eval` runs (tracelock.eval.tasks), for "did you mean" without importing it
TASK_KINDS = ("testbed", "gsm8k", "humaneval", "humaneval-with-tests", "qa")


def split_tasks(text: str) -> list[str]:
    """Comma-separated task names as `tracelock eval` spells them (``testbed:math``, ``gsm8k:PATH``, ...); a bare
    testbed task name (``math``, or ``code`` in ``testbed:math,code``) stands for ``testbed:NAME``. A task of no
    kind (``gsm8:test.jsonl``) or a testbed split of none (``@valid``) is refused with the one meant."""
    out = []
    for part in (t.strip() for t in text.split(",")):
        if part and part.partition("@")[0] in TESTBED_TASKS:
            part = "testbed:" + part
        if part:
            kind, _, rest = part.partition(":")
            if kind not in TASK_KINDS:
                raise ValueError(f"--tasks: {part!r} is not a task; kinds: {', '.join(TASK_KINDS)}"
                                 f"{did_you_mean(kind, TASK_KINDS + TESTBED_TASKS)}")
            _, at, split = rest.partition("@")
            if kind == "testbed" and at and split not in TESTBED_SPLITS:
                raise ValueError(f"--tasks: {part!r}: the testbed's splits are {', '.join(TESTBED_SPLITS)}"
                                 f"{did_you_mean(split, TESTBED_SPLITS)}")
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
                             f"{', '.join('testbed:' + t for t in TESTBED_TASKS)}{did_you_mean(name, TESTBED_TASKS)}")
        names.append(name)
    return names


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
    built (`tracelock.policies.make_policy`); a list (``threshold:tau=0.9,0.7``, ``confidence,threshold``) is refused
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


def add_allow_uncontained(parser) -> None:
    """``--allow-uncontained-code``, on the commands that run generated code (`tracelock.sandbox`)."""
    parser.add_argument("--allow-uncontained-code", action="store_true", help=option_help("--allow-uncontained-code"))


def add_runtime_options(parser) -> None:
    """``--threads`` and ``--quiet``, on every subcommand (one that defines ``--threads`` itself keeps its own, with
    the same help first: `option_help`)."""
    if "--threads" not in parser._option_string_actions:
        parser.add_argument("--threads", type=thread_count, default=None, metavar="N", help=option_help("--threads"))
    if "--quiet" not in parser._option_string_actions:
        parser.add_argument("--quiet", action="store_true", help=option_help("--quiet"))


def threads_for_load(threads: int | None, default: int, cores: int, load: float,
                     how: str = "--threads {n}") -> tuple[int, str | None]:
    """(torch threads to use, a notice or None) for a thread count chosen by the user (None: not chosen) on a machine
    whose load is ``load`` over ``cores`` cores (`machine_load`). Threads that wait for a core stall each other at
    every op: on a shared 2-core machine two threads made `tracelock demo --model testbed-dream` 15x slower than one.
    So the default comes down to the cores the load leaves free, and a chosen count above them is kept but called
    out. ``how`` is how the user sets the count (the CLI's ``--threads {n}``, the API's
    ``torch.set_num_threads({n})``). The one rule of the CLI and the Python API."""
    free = max(1, int(cores - load + 0.5))
    if threads is None and default > free:
        return free, (f"this machine is busy (load average {load:.1f} on {cores} cores): using {free} torch "
                      f"thread{'s' if free > 1 else ''} instead of {default}, as threads that wait for a core make "
                      f"decoding many times slower; {how.format(n='N')} sets the count")
    if threads is not None and threads > free:
        chosen = how.format(n=threads)
        return threads, (f"{chosen} on a busy machine (load average {load:.1f} on {cores} cores): threads that wait "
                         f"for a core make decoding many times slower; {how.format(n=free)} may well be faster")
    return threads or default, None


def _cpu_jiffies(cpus, stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies of the logical ``cpus`` in a /proc/stat text."""
    busy = total = 0
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]
            total += sum(values)
            busy += sum(values) - values[3] - (values[4] if len(values) > 4 else 0)  # idle and iowait
    return busy, total


def busy_cores(before: str, after: str, cpus, cores: int) -> float | None:
    """Physical cores' worth of work the logical ``cpus`` did between two /proc/stat texts (None: no time passed)."""
    (b0, t0), (b1, t1) = _cpu_jiffies(cpus, before), _cpu_jiffies(cpus, after)
    if t1 <= t0:
        return None
    return (b1 - b0) / (t1 - t0) * cores


def machine_load(cores: int, sample_seconds: float = 0.1) -> float:
    """The load a command's threads would compete with, in cores: the 1-minute load average, unless a short sample
    of the CPUs this process may use says they are freer now. The average still counts, for about a minute, a run
    that has just ended (the user's own previous command, say), which would cost the next run its threads for
    nothing; the sample is taken only when the average says the machine is busy, so an idle machine waits for none."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load < 0.5 or not os.path.exists("/proc/stat"):
        return load
    cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        with open("/proc/stat") as f:
            before = f.read()
        time.sleep(sample_seconds)
        with open("/proc/stat") as f:
            after = f.read()
    except OSError:
        return load
    now = busy_cores(before, after, cpus, cores)
    return load if now is None else min(load, now)


# commands that decode (or train) nothing: no load sample, no busy-machine notice
NO_COMPUTE = ("env", "report", "tiny-checkpoint", "testbed-ship", "testbed-ship-controller")
NOTICE_ENV = "TRACELOCK_LOAD_NOTICED"  # set once the busy-machine notice is said: the run's other processes keep quiet


def apply_runtime_options(args) -> None:
    """Set the thread count and the quiet switch for this process and the processes it starts. torch reads
    ``OMP_NUM_THREADS`` when it loads, which the CLI does only inside a command, after this. The busy-machine notice
    prints once per run (not again in the processes it starts), not with --quiet, and not for a command that decodes
    nothing (`NO_COMPUTE`)."""
    quiet = getattr(args, "quiet", False)
    if quiet:
        os.environ[QUIET_ENV] = "1"
    if getattr(args, "allow_uncontained_code", False):  # read by tracelock.sandbox, here and in torchrun's ranks
        os.environ["TRACELOCK_ALLOW_UNCONTAINED_CODE"] = "1"
    threads = getattr(args, "threads", None) or None  # testbed-train's --threads 0 is its default
    if threads is not None or "OMP_NUM_THREADS" not in os.environ:
        cores = physical_cores()
        computes = getattr(args, "command", None) not in NO_COMPUTE
        n, notice = threads_for_load(threads, default_threads(), cores, machine_load(cores) if computes else 0.0)
        if notice and not quiet and not os.environ.get(NOTICE_ENV):
            print(f"{getattr(args, 'command', 'tracelock')}: {notice}", file=sys.stderr, flush=True)
            os.environ[NOTICE_ENV] = "1"
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(n)
