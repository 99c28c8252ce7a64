"""Our own LLaDA / Dream forward: a pre-norm bidirectional transformer (docs/design.md, "Models").

One module serves both families; a `ModelSpec` sets the sizes and the two numeric differences
(q/k/v biases, RoPE precision). Key names of the official checkpoints are mapped in ``keys.py``.

The forward returns only what a decoding step asks for: logits at chosen positions, and on request
the three hidden-state taps with HF ``output_hidden_states`` semantics at chosen positions. No
all-layer hidden states and no ``[B, L, V]`` logits unless asked for. The fused decode loop hands it two
ops to run in place of the LM head and of the raw taps (``head_op``, ``tap_op``), so it returns the
greedy signals and the controller inputs instead.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tracelock.models.spec import ModelSpec


@dataclass
class BackboneOutput:
    logits: torch.Tensor | None  # [B, R, V] raw (unshifted) logits at logit_positions
    taps: tuple | None  # 3 x [B, T, D]: h_{n-2}, h_{n-1}, norm_f(h_n) at tap_positions
    hidden: torch.Tensor | None = None  # [B, R, D] norm_f(h_n) at logit_positions (the LM head's input)
    stats: tuple | None = None  # [B, R] each: head_op's outputs at logit_positions
    tap_inputs: torch.Tensor | None = None  # [B, T, N]: tap_op's outputs at tap_positions
    kv_cache: "KVCache | None" = None  # with store_kv: every position's keys and values


@dataclass
class KVCache:
    """Keys and values of every canvas position, per layer, from one full forward (a *refresh*).

    Keys are stored after RoPE: a canvas position keeps its position for the whole decode, so the rotation done at
    the refresh is the one a later step would do (Fast-dLLM stores them before RoPE and rotates all of them again
    on every call). Shapes: ``keys[i]``, ``values[i]`` [B, n_kv, L, head_dim].
    """

    keys: list
    values: list

    def select(self, rows: torch.Tensor) -> "KVCache":
        """The cache of batch rows ``rows`` (a copy)."""
        return KVCache([k[rows] for k in self.keys], [v[rows] for v in self.values])

    def write(self, rows: torch.Tensor, other: "KVCache") -> None:
        """Replace batch rows ``rows`` with ``other``'s (a refresh of those rows), in place."""
        for mine, theirs in zip(self.keys + self.values, other.keys + other.values):
            mine[rows] = theirs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # upcast for the statistics, cast back, *then* scale in the input dtype (as LLaDA, Llama and Qwen2 do)
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin [B, L, head_dim] in fp32 for integer positions [B, L] (half-split / NeoX convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def apply_rope(t, cos, sin, fp32: bool):
    """t [B, H, L, hd]; cos/sin [B, L, hd] fp32. fp32=True: LLaDA's rope_full_precision; else Dream's bf16 path."""
    cos, sin = cos[:, None], sin[:, None]
    if fp32:
        t32 = t.float()
        return (t32 * cos + _rotate_half(t32) * sin).to(t.dtype)
    cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    return t * cos + _rotate_half(t) * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, hd = spec.hidden_size, spec.head_dim
        self.n_heads, self.n_kv, self.head_dim, self.rope_fp32 = spec.num_heads, spec.num_kv_heads, hd, spec.rope_fp32
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def forward(self, x, cos, sin, attn_mask, causal=False, past=None, store=None):
        """``store`` (a list) receives this layer's (keys, values); ``past`` = (keys, values, index): the cached
        keys/values of every position, with this call's rows (canvas positions ``index`` [B, 1, Q, 1]) replacing
        theirs, so the Q query rows attend to all L keys."""
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, self.rope_fp32), apply_rope(k, cos, sin, self.rope_fp32)
        if store is not None:
            store.append((k, v))
        if past is not None:
            k_all, v_all, index = past
            index = index.expand(-1, self.n_kv, -1, self.head_dim)
            k, v = k_all.scatter(2, index, k), v_all.scatter(2, index, v)
        if self.n_kv != self.n_heads:
            # GQA: query head j reads key/value head j // group
            group = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, attn_mask, causal=False, past=None, store=None):
        h = x + self.attn(self.attn_norm(x), cos, sin, attn_mask, causal, past, store)
        return h + self.mlp(self.mlp_norm(h))


def _gather_rows(x, positions):
    """x [B, L, D], positions [B, R] or None (all rows) -> [B, R, D]."""
    if positions is None:
        return x
    return torch.gather(x, 1, positions[..., None].expand(-1, -1, x.shape[-1]))


def _rows_in(query_positions, positions, L: int, name: str, check: bool = True):
    """Indices into the query rows [B, Q] of canvas ``positions`` [B, R] (None: every query row)."""
    if positions is None:
        return None
    B, Q = query_positions.shape
    where = torch.full((B, L), -1, dtype=torch.long, device=query_positions.device)
    where.scatter_(1, query_positions, torch.arange(Q, device=where.device).expand(B, Q))
    rows = where.gather(1, positions)
    # checked on the CPU only: on a GPU it would cost a host sync every step, and a missing row (-1) still stops
    # the later gather with a device-side index error, only with a less helpful message
    # (and not inside a compiled graph, where it would be a graph break)
    if check and not rows.is_cuda and not torch.compiler.is_compiling() and bool((rows < 0).any()):
        raise ValueError(f"{name} asks for positions that are not among query_positions; a cached step computes "
                         "only those rows: add the positions to query_positions")
    return rows


class DiffusionBackbone(nn.Module):
    """A frozen masked diffusion LM (LLaDA or Dream). Build it with `tracelock.load_model`."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @property
    def device(self):
        return self.embed.weight.device

    @property
    def dtype(self):
        return self.embed.weight.dtype

    def positions_for(self, attention_mask: torch.Tensor | None, B: int, L: int) -> torch.Tensor:
        """Per-row positions: real tokens count from 0 after any left padding, so a padded row sees the
        same RoPE positions as the prompt alone (pad positions get 0; they are never read)."""
        if attention_mask is None:
            return torch.arange(L, device=self.device).expand(B, L)
        return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    def predict(self, input_ids, positions, attention_mask=None, *, return_taps=False, tap_positions=None,
                return_hidden=False, head_op=None, tap_op=None, store_kv=False, kv_cache=None, query_positions=None,
                check_query=True):
        """Logits that predict the tokens at canvas ``positions`` [B, R] (or, with ``return_hidden``, the LM
        head's input there instead, or with ``head_op`` its outputs there), and optionally taps (or with
        ``tap_op`` the controller inputs folded from them); see `forward`.

        This is what decoding calls: the family's shift (`ModelSpec.output_rows`) is applied here, once,
        to the logits and to the tap positions (features get the same shift as the logits). ``query_positions``
        (a cached step) are output rows, not shifted here: they must include ``output_rows(positions)``.
        """
        first = None
        if attention_mask is not None and self.spec.logit_shift:
            first = attention_mask.to(torch.uint8).argmax(1)  # left padding: each row's first real position
        out = self.forward(input_ids, attention_mask, logit_positions=self.spec.output_rows(positions, first),
                           return_logits=not return_hidden and head_op is None, return_hidden=return_hidden,
                           return_taps=return_taps,
                           tap_positions=None if tap_positions is None else self.spec.output_rows(tap_positions,
                                                                                                  first),
                           head_op=head_op, tap_op=tap_op, store_kv=store_kv, kv_cache=kv_cache,
                           query_positions=query_positions, check_query=check_query)
        return out

    def forward(self, input_ids, attention_mask=None, position_ids=None, *, logit_positions=None,
                return_logits=None, return_hidden=False, return_taps=False, tap_positions=None,
                head_op=None, tap_op=None, causal=False, store_kv=False, kv_cache=None,
                query_positions=None, check_query=True) -> BackboneOutput:
        """Run the backbone (every position, or with ``kv_cache`` only the ``query_positions`` rows).

        Args:
            input_ids (torch.Tensor): [B, L] int64 tokens.
            attention_mask (torch.Tensor): [B, L] bool/int, 1 for real tokens, 0 for (left) padding keys.
                Default: None (every key visible).
            position_ids (torch.Tensor): [B, L] int64. Default: counted from the first real token of each row.
            logit_positions (torch.Tensor): [B, R] int64 output rows to apply the LM head to. Default: all rows.
            return_logits (bool): return the logits at ``logit_positions``. Default: True, or False with
                ``head_op`` (which replaces the LM head).
            return_hidden (bool): also return norm_f(h_n) at ``logit_positions``, the LM head's input (what
                `tracelock.ops.window_logits_stats` scores without writing the logits).
            return_taps (bool): also return h_{n-2}, h_{n-1} and norm_f(h_n) at ``tap_positions``
                (default: all rows): the last three entries of HF ``output_hidden_states``.
            head_op (callable, optional): ``head_op(hidden [B*R, D], lm_head_weight [V, D], eos_id)`` -> a
                tuple of [B*R] tensors, applied to norm_f(h_n) at ``logit_positions`` in place of the LM head
                (the fused loop passes `tracelock.ops.window_logits_stats`); its outputs come back as ``stats``,
                [B, R] each, and neither logits nor hidden are returned, so no [B, R, V] tensor is written.
            tap_op (callable, optional): ``tap_op(h1, h2, h3 each [B*T, D])`` -> [B*T, N], applied to the three
                taps (needs ``return_taps``; the fused loop passes `tracelock.ops.tap_project` with a TraceLock
                policy's fold ``h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c``). Its output comes back as
                ``tap_inputs`` [B, T, N] and ``taps`` is None. The rows of h_{n-2} and h_{n-1} are still
                gathered at their layers; they live only until the op runs, after the final norm gives the
                third tap, and the op reads the three in one pass.
            causal (bool): a causal attention mask instead of the diffusion models' full attention. Only the
                testbed's AR calibration (`tracelock.testbed.ar_calibration`) uses it; no decoder does.
            store_kv (bool): also return every position's keys and values (`KVCache`): a cache refresh.
            kv_cache (KVCache, optional): recompute only the rows at ``query_positions`` [B, Q] (canvas positions;
                a row may repeat its last position as padding): they attend to the cached keys/values of every
                other position and to their own fresh ones. ``logit_positions`` and ``tap_positions`` must lie
                among them. ``input_ids`` is still the whole canvas [B, L].
            check_query (bool): with ``kv_cache`` on a CPU, check that they do (one host read; a caller that
                builds its positions inside the query, as the static-shape engine does, passes False). Never
                checked on CUDA or inside a compiled graph.

        Returns:
            BackboneOutput: raw (unshifted) logits [B, R, V], the LM head's input [B, R, D], the taps
            (3 x [B, T, D]), head_op's stats ([B, R] each) and tap_op's inputs [B, T, N], each None unless
            asked for.
        """
        if return_logits is None:
            return_logits = head_op is None
        if (kv_cache is None) != (query_positions is None):
            raise ValueError("kv_cache and query_positions go together: pass both (a cached step) or neither")
        if kv_cache is not None and (causal or store_kv):
            raise ValueError("a cached step (kv_cache) cannot also be causal or store_kv; refresh with a full "
                             "forward (store_kv=True, no kv_cache)")
        if causal and attention_mask is not None:
            raise ValueError("causal=True takes no attention_mask (the causal mask is the only mask); pass "
                             "unpadded rows or causal=False")
        if head_op is not None and (return_logits or return_hidden):
            raise ValueError("head_op replaces the LM head and returns only its stats: pass return_logits=False "
                             "and return_hidden=False with it (or drop head_op to get logits or hidden)")
        if tap_op is not None and not return_taps:
            raise ValueError("tap_op folds the three taps, so it needs tap rows: pass return_taps=True (with "
                             "tap_positions, default all rows) or drop tap_op")
        if return_taps and len(self.blocks) < 3:
            raise ValueError(f"return_taps reads the last three layers' hidden states, but this model has "
                             f"{len(self.blocks)} layers; use a model with at least 3")
        B, L = input_ids.shape
        if L > self.spec.max_positions:
            raise ValueError(f"input_ids has {L} positions but the model supports at most {self.spec.max_positions} "
                             f"(max positions in config.json); shorten the prompt or gen_length")
        if position_ids is None:
            position_ids = self.positions_for(attention_mask, B, L)
        # key-padding mask only: pad keys are hidden from everyone; pad query rows are never read.
        # Callers pass None when nothing is padded (checking here would cost a host sync).
        attn_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        past = index = None
        if kv_cache is not None:
            # only the query rows run; positions asked for are re-indexed into them
            logit_positions = _rows_in(query_positions, logit_positions, L, "logit_positions", check_query)
            tap_positions = (_rows_in(query_positions, tap_positions, L, "tap_positions", check_query) if return_taps
                             else None)
            input_ids, position_ids = input_ids.gather(1, query_positions), position_ids.gather(1, query_positions)
            index = query_positions[:, None, :, None]
        cos, sin = rope_cos_sin(position_ids, self.spec.head_dim, self.spec.rope_theta)

        x = self.embed(input_ids)
        n = len(self.blocks)
        taps, stored = [], [] if store_kv else None
        for i, block in enumerate(self.blocks):
            if kv_cache is not None:
                past = (kv_cache.keys[i], kv_cache.values[i], index)
            x = block(x, cos, sin, attn_mask, causal, past, stored)
            if return_taps and i in (n - 3, n - 2):
                taps.append(_gather_rows(x, tap_positions))
        logits = hidden = stats = None
        if return_logits or return_hidden or head_op is not None:
            normed = self.norm(_gather_rows(x, logit_positions))
            logits = self.lm_head(normed) if return_logits else None
            hidden = normed if return_hidden else None
            if head_op is not None:
                R, D = normed.shape[1:]
                stats = tuple(t.reshape(B, R) for t in head_op(normed.reshape(B * R, D), self.lm_head.weight,
                                                               self.spec.eos_id))
        tap_inputs = None
        if return_taps:
            taps.append(self.norm(_gather_rows(x, tap_positions)))
            if tap_op is not None:
                T, D = taps[0].shape[1:]
                tap_inputs = tap_op(*(t.reshape(B * T, D) for t in taps)).reshape(B, T, -1)
        taps = tuple(taps) if return_taps and tap_op is None else None
        cache = KVCache([k for k, _ in stored], [v for _, v in stored]) if store_kv else None
        return BackboneOutput(logits=logits, taps=taps, hidden=hidden, stats=stats, tap_inputs=tap_inputs,
                              kv_cache=cache)
