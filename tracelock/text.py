"""Prompt files and encoding with the checkpoint's chat template, answer extraction from a generated region, and
the "did you mean" hint of every error that names a closed set of names (`did_you_mean`)."""

import difflib
import json
from pathlib import Path


def did_you_mean(word, names) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``names`` to ``word``, else ``""``: for the error of any closed
    set of names (commands, choices, policies, their arguments, tasks, models)."""
    if not isinstance(word, str) or not word:
        return ""
    names = [str(n) for n in names]
    folded = {n.lower().replace("-", "_"): n for n in names}
    close = difflib.get_close_matches(word.lower().replace("-", "_"), list(folded), n=1, cutoff=0.6)
    return f"; did you mean {folded[close[0]]!r}?" if close else ""


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list:
    """Token ids of one user prompt, rendered with the chat template when the tokenizer has one."""
    if chat and tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def encode_text(tokenizer, text: str) -> list:
    """Token ids of plain text (no chat template) with the tokenizer's special tokens (LLaDA's BOS), unless the text
    already starts with the BOS token (a prompt rendered by a chat template)."""
    bos = tokenizer.bos_token
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def answer_ids(generated: list, end_ids) -> list:
    """The generated ids up to (not including) the first end token."""
    for i, t in enumerate(generated):
        if t in end_ids:
            return generated[:i]
    return generated


def decode_answer(tokenizer, generated: list, end_ids) -> str:
    return tokenizer.decode(answer_ids(generated, end_ids), skip_special_tokens=True)


def read_jsonl(path, *, required=(), example: str = "") -> list[dict]:
    """The JSON objects of a JSONL file, one per non-empty line, each with string fields ``required``.

    Raises ValueError naming the file and line for bad JSON, a line that is not an object, or a missing field
    (with ``example``, a record in the expected format, in the message).
    """
    path = Path(path)
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n} is not valid JSON ({err}); fix or remove that line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n} is not a JSON object; fix that line: each line must hold one record" +
                             (f", e.g. {example}" if example else ""))
        missing = [k for k in required if not isinstance(row.get(k), str)]
        if missing:
            raise ValueError(f"{path}:{n} needs the string field(s) {', '.join(map(repr, missing))}; fix that line" +
                             (f", e.g. {example}" if example else ""))
        rows.append(row)
    return rows


def read_prompt_rows(path) -> list[dict]:
    """The rows of a JSONL prompt file: one ``{"prompt": str, ...}`` object per non-empty line.

    Raises ValueError naming the file and line for bad JSON or a missing prompt, and for a file without prompts.
    """
    rows = read_jsonl(path, required=("prompt",), example='{"prompt": "What is 2 + 3?"}')
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return rows


def cut_at_stop(text: str, stop) -> tuple[str, bool]:
    """``text`` up to (not including) the earliest of the ``stop`` strings, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop or () if s) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)
