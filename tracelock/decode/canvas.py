"""The decoding canvas: ``[left-padded prompt | mask x gen_length]``, its states and its attention mask."""

from dataclasses import dataclass

import torch

from tracelock import states
from tracelock.models.spec import ModelSpec


@dataclass
class Canvas:
    x: torch.Tensor  # [B, L] int64 tokens
    state: torch.Tensor  # [B, L] uint8 position states
    attention_mask: torch.Tensor | None  # [B, L] bool, None when no row is padded
    prompt_len: int  # P: the generation region is [P, P + gen_length) in every row
    gen_length: int

    @property
    def length(self) -> int:
        return self.x.shape[1]

    def admit(self, row: int, ids: torch.Tensor, spec: ModelSpec) -> None:
        """Put prompt ``ids`` [n] into ``row`` (an engine's slot): left-padded to the prompt region, its generation
        all masks."""
        P, n = self.prompt_len, ids.numel()
        self.x[row] = spec.pad_id
        self.x[row, P - n:P] = ids.to(self.x.device)
        self.x[row, P:] = spec.mask_id
        self.state[row, :P] = states.PROMPT
        self.state[row, P:] = states.ACTIVE
        self.attention_mask[row, :P - n] = False
        self.attention_mask[row, P - n:] = True

    def release(self, row, spec: ModelSpec) -> None:
        """Empty ``row`` (an index or a slice): padding, every position a prompt's, nothing masked out."""
        self.state[row] = states.PROMPT
        self.x[row] = spec.pad_id
        self.attention_mask[row] = True


def _as_batch(input_ids, attention_mask, pad_id: int):
    """Accept a [B, P] tensor (+ optional mask) or a list of 1-D sequences, which are left-padded."""
    if isinstance(input_ids, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask is only accepted with a [B, P] input_ids tensor; a list of prompts "
                             "is left-padded for you")
        seqs = [torch.as_tensor(s, dtype=torch.long).flatten() for s in input_ids]
        if not seqs:
            raise ValueError("input_ids is an empty list; pass at least one prompt")
        P = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), P), dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, P - len(s):] = s
            mask[i, P - len(s):] = True
        return ids, mask
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a LongTensor [B, P] or a list of token-id lists, got {type(input_ids)}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be an int64 tensor [B, P], got {input_ids.dtype} {list(input_ids.shape)}")
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, torch.Tensor):  # a list of lists, a numpy array: 1 prompt, 0 padding
            try:
                attention_mask = torch.as_tensor(attention_mask)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"attention_mask must be a [B, P] tensor (or list of lists) of 1 for prompt tokens "
                                f"and 0 for left padding, got {type(attention_mask).__name__}") from None
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {list(attention_mask.shape)} must match input_ids "
                             f"{list(input_ids.shape)}")
        mask = attention_mask.bool()
        # left padding only: once a row's prompt starts it must not contain padding
        if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
            raise ValueError("attention_mask must describe left padding (0s then 1s in every row); "
                             "right-padded prompts would put padding between the prompt and the answer")
    return input_ids, mask


def check_prompt_ids(spec: ModelSpec, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The prompts' tokens (``ids`` [B, P] where ``mask``) as both drivers need them: no row empty, every token in the
    vocabulary, none the mask token."""
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if ids.shape[1] == 0 or empty:
        raise ValueError(f"prompt rows {empty or 'all'} are empty; every prompt needs at least one token "
                         "(with a chat model, apply the chat template first)")
    outside = ((ids < 0) | (ids >= spec.vocab_size)) & mask
    if bool(outside.any()):
        raise ValueError(f"the prompt's token {int(ids[outside][0])} is outside this model's vocabulary [0, "
                         f"{spec.vocab_size}); encode prompts with the checkpoint's own tokenizer")
    if bool(((ids == spec.mask_id) & mask).any()):
        raise ValueError(f"a prompt contains the mask token (id {spec.mask_id}); remove it: the decoder would treat "
                         "it as prompt text, not as a position to fill")


def prepare_canvas(spec: ModelSpec, input_ids, attention_mask, gen_length: int, device) -> Canvas:
    """Validate the prompts and lay out the canvas on ``device``."""
    ids, mask = _as_batch(input_ids, attention_mask, spec.pad_id)
    check_prompt_ids(spec, ids, mask)
    B, P = ids.shape
    L = P + gen_length
    if L > spec.max_positions:
        raise ValueError(f"prompt ({P} tokens) + gen_length ({gen_length}) = {L} exceeds the model's "
                         f"{spec.max_positions} positions; shorten the prompt or lower gen_length")
    x = torch.full((B, L), spec.mask_id, dtype=torch.long)
    x[:, :P] = ids
    state = torch.full((B, L), states.ACTIVE, dtype=torch.uint8)
    state[:, :P] = states.PROMPT
    full_mask = None
    if not bool(mask.all()):
        full_mask = torch.ones((B, L), dtype=torch.bool)
        full_mask[:, :P] = mask
        full_mask = full_mask.to(device)
    return Canvas(x=x.to(device), state=state.to(device), attention_mask=full_mask, prompt_len=P,
                  gen_length=gen_length)


def truncate_after(x: torch.Tensor, state: torch.Tensor, attention_mask: torch.Tensor, cut: torch.Tensor,
                   fill_id: int) -> torch.Tensor:
    """Cut rows after canvas position ``cut`` [b] (Learn2PD's end-of-text truncation ``x = x[:, :cut + 1]``), in
    place: later positions become EOT with ``fill_id`` whatever their state, and their keys are masked, so the
    forwards that follow see exactly the shorter canvas. ``cut = L`` keeps a row whole.

    Returns:
        torch.Tensor: [b] the first active position of each row (L for none).
    """
    L = x.shape[1]
    pos = torch.arange(L, device=x.device)
    after = pos > cut[:, None]
    x.masked_fill_(after, fill_id)
    state.masked_fill_(after, states.EOT)
    attention_mask &= ~after
    return torch.where(state == states.ACTIVE, pos, L).amin(1)
