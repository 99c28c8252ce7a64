"""The argparse machinery every `tracelock` subcommand shares (docs/cli.md, "The grammar"): help that shows each
option's default (`HelpFormatter`), one error line with the user's values escaped (`safe_echo`, `Parser`), "did you
mean" for a bad choice, an option of another command named with this one's spelling (`foreign_option_hint`,
`unrecognized_message`), and old spellings kept for one release as deprecated aliases (`add_alias`).

Nothing here imports torch: building the parser must stay cheap (`tracelock --help` takes no torch import).
"""

import argparse
import re
import sys
import unicodedata

from tracelock.text import did_you_mean

# the release that drops the deprecated spellings
REMOVED_IN = "0.2"


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
