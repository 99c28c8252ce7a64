"""Checks of what a user hands the public API (`fused_generate`, `reference_generate`, `generate_many`,
`load_model`): each bad input raises one error that names the argument and the fix, before any work is done,
instead of a silent misreading or a raw message from deep inside torch."""

from collections.abc import Mapping

import torch

__all__ = ["check_decode_inputs", "check_device", "check_prompt_lists"]


def check_device(device) -> torch.device:
    """``device`` as a `torch.device`; a CUDA device without a CUDA build of torch (or without a GPU) is an error."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device ({err}); use 'cpu' or 'cuda[:i]'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = ("is a CPU-only build" if torch.version.cuda is None
               else f"is built for CUDA {torch.version.cuda} but finds no usable GPU")
        raise ValueError(f"device={device!r} but this torch ({torch.__version__}) {why}; use device='cpu' "
                         "(CLI: --device cpu), or install a CUDA build of torch on a machine with an NVIDIA GPU")
    return dev


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prompt_lists(prompts, name: str = "input_ids") -> None:
    """A list of prompts must hold token-id sequences of ints: a flat list of ints is one prompt that was not
    wrapped (what ``tok(text)["input_ids"]`` returns), and float ids would be truncated silently."""
    if isinstance(prompts, str) or not hasattr(prompts, "__len__") or getattr(prompts, "ndim", 1) == 0:
        raise TypeError(f"{name} must be a list of token-id lists, got {type(prompts).__name__}")
    if not len(prompts):
        raise ValueError(f"{name} is empty; pass at least one prompt (a list of token ids)")
    for i, seq in enumerate(prompts):
        if _is_id(seq) or (isinstance(seq, torch.Tensor) and seq.dim() == 0):
            raise TypeError(f"{name} is a flat list of token ids ({name}[{i}] = {seq!r}), which would decode as "
                            f"one-token prompts; wrap one prompt in a list, [ids], or pass a list of token-id lists "
                            f"(tok(text)['input_ids'] returns one prompt's flat list)")
        if isinstance(seq, torch.Tensor):
            if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
                raise TypeError(f"{name}[{i}] is a {seq.dtype} tensor; token ids are integers: pass "
                                f"{name}[{i}].long() only if the values really are ids")
            continue
        if not isinstance(seq, list | tuple) and not hasattr(seq, "__array__"):
            raise TypeError(f"{name}[{i}] is a {type(seq).__name__}; each prompt must be a list (or 1-D tensor) of "
                            "token ids")
        values = seq.tolist() if hasattr(seq, "tolist") else seq
        bad = next((v for v in values if not _is_id(v)), None)
        if bad is not None:
            raise TypeError(f"{name}[{i}] holds {bad!r} ({type(bad).__name__}); token ids are ints: encode the "
                            "prompt with the model's tokenizer (tracelock.load_tokenizer) instead of passing "
                            f"{type(bad).__name__} values, which would be truncated")


def _check_id_range(ids: torch.Tensor, vocab_size: int, name: str, rows=None) -> None:
    """``ids`` [B, P]; ``rows`` names each row's index in the user's input (default 0..B-1)."""
    out = (ids < 0) | (ids >= vocab_size)
    if bool(out.any()):
        row, col = (int(v) for v in out.nonzero()[0])
        where = f"{name}[{row if rows is None else rows[row]}][{col}]"
        raise ValueError(f"{where} = {int(ids[row, col])} is outside this model's vocabulary [0, {vocab_size}); "
                         "encode prompts with the same checkpoint's tokenizer (tracelock.load_tokenizer(path))")


def check_decode_inputs(model, input_ids) -> None:
    """What `fused_generate` / `reference_generate` check of the prompts before decoding (`DecodeSettings` checks
    the settings; the loop the rest: shapes, padding, the mask token and lengths)."""
    spec = getattr(model, "spec", None)
    if isinstance(input_ids, Mapping) or hasattr(input_ids, "input_ids") and hasattr(input_ids, "keys"):
        raise TypeError(f"input_ids is a {type(input_ids).__name__}, a tokenizer's whole output; pass its token ids: "
                        "enc = tok(text); fused_generate(model, [enc['input_ids']], ...) for one text, or for a "
                        "batch enc = tok(texts, padding=True, return_tensors='pt') and fused_generate(model, "
                        "enc['input_ids'], attention_mask=enc['attention_mask'], ...) (left padding: "
                        "tok.padding_side = 'left')")
    if isinstance(input_ids, list | tuple):
        check_prompt_lists(input_ids)
        if spec is not None:
            for i, seq in enumerate(input_ids):
                _check_id_range(torch.as_tensor(seq, dtype=torch.long).reshape(1, -1), spec.vocab_size,
                                "input_ids", rows=[i])
    elif isinstance(input_ids, torch.Tensor) and spec is not None and input_ids.dtype == torch.long:
        # the shape itself is checked with the canvas; a 1-D tensor is one prompt
        if input_ids.dim() in (1, 2):
            _check_id_range(input_ids if input_ids.dim() == 2 else input_ids[None], spec.vocab_size, "input_ids")
