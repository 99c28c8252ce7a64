"""What a backbone forward is asked for: its outputs (`Outputs`) and its use of the KV cache (`CacheQuery`)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Outputs:
    """What `DiffusionBackbone.forward` returns besides nothing (every field off returns an empty output).

    ``positions`` [B, R] are the output rows the LM head reads (None: every row; `DiffusionBackbone.predict` takes
    canvas positions instead and shifts them); ``logits`` the raw logits there (default: True, or False with
    ``head_op``); ``hidden`` norm_f(h_n) there, the LM head's input; ``taps`` h_{n-2}, h_{n-1} and norm_f(h_n) at
    ``tap_positions`` [B, T] (None: every row), the last three entries of HF ``output_hidden_states``.

    ``head_op(hidden [B*R, D], lm_head_weight [V, D], eos_id)`` -> a tuple of [B*R] tensors runs in place of the LM
    head (the fused loop passes `tracelock.ops.window_logits_stats`): its outputs come back as ``stats`` [B, R] each,
    and neither logits nor hidden are returned, so no [B, R, V] tensor is written. ``tap_op(h1, h2, h3 each [B*T,
    D])`` -> [B*T, N] folds the three taps (needs ``taps``; the fused loop passes `tracelock.ops.tap_project` with a
    TraceLock policy's fold): its output comes back as ``tap_inputs`` [B, T, N] and ``taps`` is None; the rows of
    h_{n-2} and h_{n-1} live only until the op runs, after the final norm gives the third tap.
    """

    positions: torch.Tensor | None = None
    logits: bool | None = None
    hidden: bool = False
    taps: bool = False
    tap_positions: torch.Tensor | None = None
    head_op: Callable | None = None
    tap_op: Callable | None = None

    @property
    def wants_logits(self) -> bool:
        return self.head_op is None if self.logits is None else self.logits


@dataclass(frozen=True)
class CacheQuery:
    """A forward's use of the KV cache: a refresh (``store``: every position's keys and values come back as a
    `KVCache`), or a cached step (``kv``): only the rows at ``query_positions`` [B, Q] run (canvas positions; a row
    may repeat its last position as padding), attending to the cached keys/values of every other position and to
    their own fresh ones, which are written into ``kv`` in place at ``kv_positions`` (default: ``query_positions``;
    the engine sends its padding rows to a spare position). The outputs' positions must lie among the query rows:
    with ``check_query`` on a CPU that is checked (one host read; the engine, which builds its positions inside the
    query, passes False); never on CUDA or inside a compiled graph."""

    kv: "object | None" = None  # a `tracelock.models.backbone.KVCache`
    query_positions: torch.Tensor | None = None
    kv_positions: torch.Tensor | None = None
    store: bool = False
    check_query: bool = True
