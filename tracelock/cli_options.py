"""The options several `tracelock` subcommands share, defined once (docs/cli.md, "The grammar"): `OPTIONS` holds
their help texts; `add_model`, `add_device`, `add_model_dtype`, `add_quantize`, `add_schedule`, `add_settings`,
`add_block_or_window`, `add_policy`, `add_limit` and `add_runtime_options` (``--threads`` and ``--quiet``) add them,
so the same flag means the same thing, and says so in the same words, in every subcommand.

- One setting is ``--gen-length N`` with ``--block W`` or ``--window W`` in every command that decodes; the commands
  that compare settings also take several, ``--settings GEN/WIDTH,...`` with ``--schedule`` (`check_settings`,
  `check_schedule_options`).
- A singular flag takes one value, a plural one a comma-separated list (the one list separator): ``--policy SPEC``,
  ``--policies SPEC,SPEC``, ``--tasks a,b`` (`split_tasks`; the policy specs' grammar is `tracelock.policy_specs`).

Nothing here imports torch: building the parser must stay cheap (`tracelock --help` takes no torch import).
"""

import re

from tracelock.cli_parser import add_alias
from tracelock.cli_threads import physical_cores
from tracelock.cli_values import MAX_GEN_LENGTH, batch_int, gen_length_int, positive_int, thread_count
from tracelock.policy_specs import POLICY_NAMES
from tracelock.text import did_you_mean

TESTBED_TASKS = ("math", "code")
TESTBED_SPLITS = ("train", "validation", "test")

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
    add_block_or_window(parser, block_help=f" (default: {block_default})", window_help=f" (default: {window_default})")
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


def add_block_or_window(parser, *, block_help: str, window_help: str) -> None:
    """``--block W`` or ``--window W``, not both: the schedule's width, with the shared help of each followed by
    ``block_help`` / ``window_help`` (this command's words, punctuation included: what the width does here and what
    leaving both out means)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--block", type=gen_length_int, metavar="W", help=option_help("--block") + block_help)
    group.add_argument("--window", type=gen_length_int, metavar="W", help=option_help("--window") + window_help)


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
    add_block_or_window(parser, block_help=": with --gen-length, the setting GEN/W in blocks (default: --settings)",
                        window_help=": with --gen-length, the setting GEN/W in a window (default: --settings)")

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


def add_prompt_limit(parser) -> None:
    """``--limit N`` (old: ``--num``) of the commands that decode ``--prompts``, testbed tasks or a JSONL file
    (`tracelock.recording.collect.load_items` reads both)."""
    add_limit(parser, help="items per testbed task (required there); the first N lines of a JSONL (default: all)",
              old=("--num",))


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


def add_testbed_tasks(parser) -> None:
    """``--tasks`` of the commands that run the testbed's own tasks only (demo, testbed-eval: `testbed_task_names`)."""
    parser.add_argument("--tasks", default="testbed:math,testbed:code",
                        help=option_help("--tasks", "this command runs only the testbed's two (math,code also "
                                                    "accepted)"))


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
