"""The testbed model's folder: a byte-level BPE trained on task text, a LLaDA or Dream config, official-key weights.

The tokenizer is trained with `tokenizers` on a corpus the task generators produce from the seed, so it
is reproducible offline. Digit runs are pre-split from words and merged by BPE like words, so every number the
tasks use (0-99) is one token: copying a number is one token and ``8 + 9 = 17`` is a lookup rather than
digit-by-digit carrying, which a small model trained briefly on 2 cores learns far sooner. Byte-level BPE keeps
whitespace exactly, so generated Python keeps its indentation.
"""

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tracelock.atomic import atomic_write_text
from tracelock.models.keys import official_keys
from tracelock.models.spec import ModelSpec
from tracelock.models.tiny import dream_config, generation_config, llada_config, save_weights
from tracelock.models.tiny_tokenizer import SPECIAL_TOKENS, save_tokenizer
from tracelock.tasks import sample

FAMILIES = ("llada", "dream")
NUMBER_TOKENS = 100  # 0-99 are single tokens


# text the family's chat template adds to every prompt (Qwen2.5's default system turn), learnt as a few tokens
TEMPLATE_TEXT = {"llada": "", "dream": "You are a helpful assistant."}


def corpus(tasks, n: int, seed: int, family: str = "llada"):
    """Prompts and answers of ``n`` training examples, alternating tasks, and the chat template's own text (for the
    tokenizer)."""
    rng = random.Random(seed)
    for i in range(n):
        ex = sample(tasks[i % len(tasks)], "train", rng)
        yield ex.prompt
        yield ex.answer
        if TEMPLATE_TEXT[family]:
            yield TEMPLATE_TEXT[family]
    # every number the tasks state or compute, with and without a leading space, at least twice (min_frequency)
    numbers = " ".join(f"{n} ({n}" for n in range(NUMBER_TOKENS))
    yield from (numbers, numbers)


def train_tokenizer(tasks, *, vocab_size: int, corpus_size: int, seed: int, family: str = "llada") -> Tokenizer:
    """The family's special strings first (their ids: the LLaDA and Dream layouts differ), then BPE on task text."""
    tok = Tokenizer(models.BPE())
    # ByteLevel's regex keeps a number with its leading space (" 17" -> "Ġ17") and apart from letters
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS[family],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(tasks, corpus_size, seed, family), trainer=trainer)
    return tok


def write_folder_files(folder: Path, tok: Tokenizer, sizes: dict, max_positions: int,
                       family: str = "llada") -> ModelSpec:
    """Tokenizer files, config.json and generation_config.json of the family (LLaDA's or Dream's config keys,
    special ids and chat template); returns the folder's `ModelSpec`."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: the testbed model is one of {', '.join(FAMILIES)}")
    folder.mkdir(parents=True, exist_ok=True)
    ids = save_tokenizer(folder, tok, family, model_max_length=max_positions)
    # embedding rows padded to a multiple of 64, like the real checkpoints pad theirs to a multiple of 128
    rows = -(-tok.get_vocab_size() // 64) * 64
    make_config = llada_config if family == "llada" else dream_config
    config = make_config(sizes["d_model"], sizes["n_heads"], sizes["n_heads"], sizes["n_layers"], sizes["mlp"], ids,
                         vocab_rows=rows, max_positions=max_positions)
    atomic_write_text(folder / "generation_config.json", json.dumps(generation_config(family, ids), indent=2) + "\n")
    # config.json last: a run folder that has it has the others (`tracelock testbed-train` resumes on it)
    atomic_write_text(folder / "config.json", json.dumps(config, indent=2) + "\n")
    return ModelSpec.from_pretrained(folder)


def export_weights(folder: Path, model) -> None:
    """Our parameters -> the family's official key names, bf16, like the released checkpoints."""
    ours_to_official = {v: k for k, v in official_keys(model.spec).items()}
    state = {ours_to_official[name]: p.detach().to(torch.bfloat16).contiguous().clone()
             for name, p in model.released_weights().items()}
    save_weights(folder, state, shards=1)
