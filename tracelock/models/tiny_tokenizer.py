"""Offline toy tokenizer for the tiny LLaDA / Dream checkpoints (docs/design.md, "Models").

A `tokenizers` WordLevel model over the in-repo word list below, with each family's real special-token strings
placed at family-specific ids, so code that hard-codes ids (or assumes both families share them) fails on the tiny
models. Built deterministically, nothing is downloaded.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

from tracelock.atomic import atomic_write, atomic_write_text
from tracelock.models.chat_templates import CHAT_TEMPLATES

UNK_TOKEN = "<unk>"

# every piece the pre-tokenizer can emit: a newline, a single digit, an ASCII letter run, or one other character
_SPLIT_PATTERN = r"\n|\d|[A-Za-z]+|[^\sA-Za-z\d]"

_SYMBOLS = "\n 0 1 2 3 4 5 6 7 8 9 . , ; : ! ? ' \" ( ) [ ] { } + - * / = < > % ^ & | ~ # @ $ _ \\ `".split(" ")

_WORDS = """
the a an and or not of to in on at by for from with as is are was were be been it its this that there here what
which who when where why how if then else than so but because while also only just very more most less some any
all each every both no yes none one two three four five six seven eight nine ten eleven twelve twenty hundred
thousand zero half twice first second third last next number numbers sum total difference product quotient
remainder result answer question problem step steps solution solve compute calculate find write explain show
give let given equal equals plus minus times divided multiply divide add subtract square root power even odd
prime factor factors multiple divisible integer fraction decimal percent ratio average value values digit
digits count length width height area perimeter volume angle triangle circle radius point side price cost money
dollars cents hours minutes days weeks years apples oranges books students people friends boxes cars pages
miles per left right up down over into out after before fewer buy buys bought sell sold has have had do does did
get got make made take took use used need needs want can could will would should must know see go went come
gave pay paid spend spent save saved eat ate read run walk work start end stop return print call check test
true false new old big small large long short high low good bad best same different other again always never
day week year month hour minute time speed rate distance x y z n m k i j b c d
he she they we you me him her them us my your his our their
function list string dictionary array element index key item loop variable input output code program python
class method object type file line character word words sentence text letter reverse sorted sort order
maximum minimum largest smallest greater smaller positive negative
user assistant system helpful hello world
False None True assert async await break continue def del elif except finally global import lambda nonlocal
pass raise try yield self len range int str float dict set tuple min max abs enumerate zip map filter open
append pop join split strip lower upper res ans nums num arr lst val idx
What How Find Write Solve Compute Calculate Let If The A Is Answer Question Given Each There You I We Step So
Therefore Then This It In For Explain Hello Yes No Please Sure Here Thus Now First Next Finally Tom Anna
"""


def _word_list() -> list[str]:
    # keep the first occurrence: a few words are listed in more than one group
    seen, words = set(), []
    for w in _SYMBOLS + _WORDS.split():
        if w and w not in seen:
            seen.add(w)
            words.append(w)
    return words


WORDS = _word_list()
# ids 0..len(BASE_VOCAB)-1, shared by both families; special tokens come after, at family-specific ids
BASE_VOCAB = [UNK_TOKEN, *WORDS]

# the family's special strings in id order, appended after the base vocabulary like in the real tokenizers (LLaDA:
# 126080+, Dream: 151643+). LLaDA keeps one reserved token before its mask, as in the real layout, so no special
# string has the same id in both families.
SPECIAL_TOKENS = {
    "llada": [
        "<|startoftext|>",
        "<|endoftext|>",
        "<|reserved_token_0|>",
        "<|mdm_mask|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
    "dream": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"],
}

# token roles as in the released tokenizer configs
ROLES = {
    "llada": {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|mdm_mask|>",
        "eot_token": "<|eot_id|>",
    },
    "dream": {
        "bos_token": "<|beginoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "eot_token": "<|im_end|>",
    },
}


def tiny_vocab(family: str) -> dict[str, int]:
    """Token string -> id for the family's toy tokenizer (base words first, then its special tokens)."""
    return {tok: i for i, tok in enumerate(BASE_VOCAB + SPECIAL_TOKENS[family])}


def build_tokenizer(family: str) -> Tokenizer:
    """The family's toy `tokenizers.Tokenizer`; deterministic, no download."""
    tok = Tokenizer(models.WordLevel(vocab=tiny_vocab(family), unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="removed", invert=True)
    # the strings already sit in the WordLevel vocab, so registering them keeps those ids
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS[family]])
    tok.add_special_tokens([AddedToken(UNK_TOKEN, special=True, normalized=False)])
    return tok


def write_tokenizer_files(folder: str | Path, family: str, *, model_max_length: int) -> dict[str, int]:
    """Write the family's toy tokenizer: tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    Args:
        folder (str | Path): checkpoint folder (must exist).
        family (str): "llada" or "dream".
        model_max_length (int): the config's maximum number of positions.

    Returns:
        dict[str, int]: role (bos/eos/pad/mask/eot) -> token id, for the model config.
    """
    return save_tokenizer(folder, build_tokenizer(family), family, model_max_length=model_max_length,
                          unk_token=UNK_TOKEN)


def save_tokenizer(folder: str | Path, tok: Tokenizer, family: str, *, model_max_length: int,
                   unk_token: str | None = None) -> dict[str, int]:
    """Save any `tokenizers.Tokenizer` that holds the family's special strings as an HF tokenizer folder.

    Writes tokenizer.json, tokenizer_config.json (PreTrainedTokenizerFast, the family's chat template) and
    special_tokens_map.json, and returns role (bos/eos/pad/mask/eot) -> token id, for the model config.
    """
    folder = Path(folder)
    atomic_write(folder / "tokenizer.json", lambda tmp: tok.save(tmp))
    roles = ROLES[family]
    missing = [s for s in SPECIAL_TOKENS[family] if tok.token_to_id(s) is None]
    if missing:
        raise ValueError(f"the tokenizer lacks the {family} special tokens {missing}; add them before saving")
    named = {role: roles[role] for role in ("bos_token", "eos_token", "pad_token", "mask_token")}
    # like the released configs, the extra specials are everything the named roles do not cover
    extra = [s for s in SPECIAL_TOKENS[family] if s not in named.values()]
    specials = ([unk_token] if unk_token else []) + SPECIAL_TOKENS[family]
    added = {
        str(tok.token_to_id(s)): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s in specials
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": extra,
        **named,
        **({"unk_token": unk_token} if unk_token else {}),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATES[family],
    }
    special_map = {**named, **({"unk_token": unk_token} if unk_token else {}), "additional_special_tokens": extra}
    atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    atomic_write_text(folder / "special_tokens_map.json", json.dumps(special_map, indent=2) + "\n")
    return {role: tok.token_to_id(s) for role, s in roles.items()}
