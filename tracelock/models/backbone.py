"""Our own LLaDA / Dream forward: a pre-norm bidirectional transformer (docs/design.md, "Models").

One module serves both families; a `ModelSpec` sets the sizes and the two numeric differences
(q/k/v biases, RoPE precision). Key names of the official checkpoints are mapped in ``keys.py``.

The forward returns only what a decoding step asks for: logits at chosen positions, and on request
the three hidden-state taps with HF ``output_hidden_states`` semantics at chosen positions. No
all-layer hidden states and no ``[B, L, V]`` logits unless asked for. The fused decode loop hands it two
ops to run in place of the LM head and of the raw taps (``head_op``, ``tap_op``), so it returns the
greedy signals and the controller inputs instead.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from tracelock.models.query import CacheQuery, Outputs
from tracelock.models.spec import ModelSpec


@dataclass
class BackboneOutput:
    logits: torch.Tensor | None  # [B, R, V] raw (unshifted) logits at the outputs' positions
    taps: tuple | None  # 3 x [B, T, D]: h_{n-2}, h_{n-1}, norm_f(h_n) at tap_positions
    hidden: torch.Tensor | None = None  # [B, R, D] norm_f(h_n) there (the LM head's input)
    stats: tuple | None = None  # [B, R] each: head_op's outputs there
    tap_inputs: torch.Tensor | None = None  # [B, T, N]: tap_op's outputs at tap_positions
    kv_cache: "KVCache | None" = None  # a refresh (CacheQuery.store): every position's keys and values


@dataclass
class KVCache:
    """Keys and values of every canvas position, per layer, from one full forward (a *refresh*).

    Keys are stored after RoPE: a canvas position keeps its position for the whole decode, so the rotation done at
    the refresh is the one a later step would do (Fast-dLLM stores them before RoPE and rotates all of them again
    on every call). A cached step writes the fresh keys and values of the rows it recomputes into the cache in place
    (what it reads for them is its own anyway, and the decoders recompute a row until the next refresh once they
    have recomputed it). Shapes: ``keys[i]``, ``values[i]`` [B, n_kv, L, head_dim] (an engine's hold one spare
    position more).
    """

    keys: list
    values: list

    def select(self, rows: torch.Tensor) -> "KVCache":
        """The cache of batch rows ``rows`` (a copy)."""
        return KVCache([k[rows] for k in self.keys], [v[rows] for v in self.values])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # upcast for the statistics, cast back, *then* scale in the input dtype (as LLaDA, Llama and Qwen2 do);
        # `kernels.ref.add_rms_norm_ref` is the same with the residual add in front
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
        # q, k and v as one product; the released q_proj / k_proj / v_proj are its row blocks (`released_weights`)
        self.qkv = nn.Linear(d, (self.n_heads + 2 * self.n_kv) * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def released_weights(self) -> dict:
        """{released name: view}: q_proj, k_proj, v_proj (weight, and bias where the family has one) as views into
        the fused product's rows, and o_proj."""
        hd = self.head_dim
        cuts = {"q_proj": (0, self.n_heads * hd), "k_proj": (self.n_heads * hd, (self.n_heads + self.n_kv) * hd),
                "v_proj": ((self.n_heads + self.n_kv) * hd, (self.n_heads + 2 * self.n_kv) * hd)}
        out = {}
        for name, (a, b) in cuts.items():
            out[f"{name}.weight"] = self.qkv.weight[a:b]
            if self.qkv.bias is not None:
                out[f"{name}.bias"] = self.qkv.bias[a:b]
        out["o_proj.weight"] = self.o_proj.weight
        return out

    def forward(self, x, cos, sin, attn_mask, kernels, causal=False, past=None):
        """(output before o_proj [B, Q, n_heads * hd], keys, values) of the layer's attention. ``past`` = (keys, values,
        index, L): the cached
        keys/values of every position [B, n_kv, Lc, hd] (Lc >= the canvas's L: an engine keeps a spare position
        for its padding rows), into which this call's fresh keys/values are written in place at canvas positions
        ``index`` [B, Q], so the Q query rows attend to the first L keys; then keys and values are None. Without
        ``past``, this call's own keys and values [B, n_kv, Q, hd] (a refresh stores them)."""
        B, Q, _ = x.shape
        qkv = kernels.linear(x, self.qkv.weight, self.qkv.bias)
        if past is None:
            q, k, v = kernels.rope_qkv(qkv, cos, sin, self.n_heads, self.n_kv, self.head_dim, self.rope_fp32)
            keys, values = k, v
        else:
            cache_k, cache_v, index, L = past
            q, k, v = kernels.rope_qkv(qkv, cos, sin, self.n_heads, self.n_kv, self.head_dim, self.rope_fp32,
                                       cache_k, cache_v, index)
            k, v, keys, values = k[:, :, :L], v[:, :, :L], None, None
        # grouped heads (Dream): query head j reads key/value head j // group, inside SDPA
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                             enable_gqa=self.n_kv != self.n_heads)
        return out.transpose(1, 2).reshape(B, Q, -1), keys, values


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.intermediate = spec.intermediate_size
        # the gate and up projections as one product (gate rows first; the released names: `released_weights`)
        self.gate_up = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def released_weights(self) -> dict:
        F_ = self.intermediate
        return {"gate_proj.weight": self.gate_up.weight[:F_], "up_proj.weight": self.gate_up.weight[F_:],
                "down_proj.weight": self.down_proj.weight}

    def act(self, x, kernels):
        """SiLU(gate) x up of ``x`` [B, Q, D]: [B, Q, F], the down projection's input."""
        if kernels.epilogues:
            return kernels.linear(x, self.gate_up.weight, activation="silu_mul")
        gate_up = kernels.linear(x, self.gate_up.weight)
        return kernels.silu_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(*x.shape[:-1], -1)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    # one layer's graph, compiled once and reused for every layer inside a compiled step (regional compilation;
    # a no-op when not compiling). Its outputs never alias its inputs, and it appends to nothing, as such a region
    # must not.
    @torch.compiler.nested_compile_region
    def forward(self, h, delta, cos, sin, attn_mask, kernels, causal=False, past=None, keep_kv=False):
        """One layer on the residual stream ``h`` plus the previous layer's MLP output ``delta`` (None at the first
        layer, and always with ``kernels.epilogues``, where the products add the residual themselves). Each residual
        add runs fused with the norm after it, or in the product before it. Returns (h, delta) of this layer (its
        output is ``h + delta``), and with ``keep_kv`` (a refresh, no ``past``) also the layer's keys and values."""
        normed, h = _add_norm(kernels, h, delta, self.attn_norm)
        a, keys, values = self.attn(normed, cos, sin, attn_mask, kernels, causal, past)
        o_proj, down = self.attn.o_proj.weight, self.mlp.down_proj.weight
        if kernels.epilogues:
            h = kernels.linear(a, o_proj, residual=h)
            normed, h = _add_norm(kernels, h, None, self.mlp_norm)
            out = (kernels.linear(self.mlp.act(normed, kernels), down, residual=h), None)
        else:
            normed, h = _add_norm(kernels, h, kernels.linear(a, o_proj), self.mlp_norm)
            out = (h, kernels.linear(self.mlp.act(normed, kernels), down))
        return out + (keys, values) if keep_kv else out


def _add_norm(kernels, h, delta, norm: RMSNorm) -> tuple:
    """(norm(h + delta), h + delta) of [..., D] rows through the kernels' fused add + RMSNorm ([M, D] rows)."""
    D = h.shape[-1]
    normed, summed = kernels.add_rms_norm(h.reshape(-1, D), None if delta is None else delta.reshape(-1, D),
                                          norm.weight, norm.eps)
    return normed.view(h.shape), summed.view(h.shape)


_FUSED_PARTS = tuple(f"{n}.{kind}" for n in ("q_proj", "k_proj", "v_proj") for kind in ("weight", "bias")) + (
    "gate_proj.weight", "up_proj.weight")


def _layer_output(h, delta, positions):
    """A layer's output ``h + delta`` at ``positions`` [B, R] only (None: all rows)."""
    rows = _gather_rows(h, positions)
    return rows if delta is None else rows + _gather_rows(delta, positions)


def _gather_rows(x, positions):
    """x [B, L, D] (or None), positions [B, R] or None (all rows) -> [B, R, D]."""
    if positions is None or x is None:
        return x
    return torch.gather(x, 1, positions[..., None].expand(-1, -1, x.shape[-1]))


def _key_padding_mask(attention_mask, B: int, L: int, dtype):
    """Key-padding mask only: pad keys are hidden from everyone; pad query rows are never read. Built once per
    forward as the additive mask SDPA uses (a boolean one is converted in every layer). Callers pass None when
    nothing is padded (checking here would cost a host sync)."""
    if attention_mask is None:
        return None
    return torch.zeros((B, 1, 1, L), dtype=dtype, device=attention_mask.device).masked_fill_(
        ~attention_mask.bool()[:, None, None, :], float("-inf"))


def _in_query(outputs: Outputs, cache: CacheQuery, L: int) -> Outputs:
    """``outputs`` with its positions re-indexed into a cached step's query rows."""
    q, check = cache.query_positions, cache.check_query
    taps = _rows_in(q, outputs.tap_positions, L, "tap_positions", check) if outputs.taps else None
    return replace(outputs, positions=_rows_in(q, outputs.positions, L, "positions", check), tap_positions=taps)


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

    def released_weights(self) -> dict:
        """{name: tensor} of every weight under the released layout's names (``blocks.0.attn.q_proj.weight``, ...,
        in the order the released layout has them): the fused q/k/v and gate/up products appear as views of their
        row blocks. What checkpoints load into (`load_released`), fingerprints sample and peers share."""
        out = {"embed.weight": self.embed.weight}
        for i, block in enumerate(self.blocks):
            b = f"blocks.{i}."
            out[b + "attn_norm.weight"] = block.attn_norm.weight
            out.update({b + "attn." + k: v for k, v in block.attn.released_weights().items()})
            out[b + "mlp_norm.weight"] = block.mlp_norm.weight
            out.update({b + "mlp." + k: v for k, v in block.mlp.released_weights().items()})
        out["norm.weight"] = self.norm.weight
        out["lm_head.weight"] = self.lm_head.weight
        return out

    def load_released(self, state: dict) -> None:
        """Load ``state`` keyed by `released_weights`'s names: q/k/v and gate/up are concatenated into the fused
        products (assigned, so the tensors' device and dtype are kept)."""
        missing = sorted(set(self.released_weights()) - set(state))
        unexpected = sorted(set(state) - set(self.released_weights()))
        if missing or unexpected:
            raise KeyError(f"load_released: missing {missing[:3]}, unexpected {unexpected[:3]}")
        fused = {k: v for k, v in state.items() if not k.endswith(_FUSED_PARTS)}
        for i in range(len(self.blocks)):
            a, m = f"blocks.{i}.attn.", f"blocks.{i}.mlp."
            fused[a + "qkv.weight"] = torch.cat([state.pop(a + f"{n}_proj.weight") for n in "qkv"])
            if a + "q_proj.bias" in state:
                fused[a + "qkv.bias"] = torch.cat([state.pop(a + f"{n}_proj.bias") for n in "qkv"])
            fused[m + "gate_up.weight"] = torch.cat([state.pop(m + f"{n}_proj.weight") for n in ("gate", "up")])
        self.load_state_dict(fused, strict=True, assign=True)

    @property
    def dtype(self):
        return self.embed.weight.dtype

    def positions_for(self, attention_mask: torch.Tensor | None, B: int, L: int) -> torch.Tensor:
        """Per-row positions: real tokens count from 0 after any left padding, so a padded row sees the
        same RoPE positions as the prompt alone (pad positions get 0; they are never read)."""
        if attention_mask is None:
            return torch.arange(L, device=self.device).expand(B, L)
        return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    def predict(self, input_ids, positions, attention_mask=None, *, outputs: Outputs | None = None,
                cache: CacheQuery | None = None, kernels=None) -> BackboneOutput:
        """The forward's outputs at canvas ``positions`` [B, R], the positions whose tokens are predicted: the logits
        there by default, or what ``outputs`` asks for (its ``tap_positions`` canvas positions too, its ``positions``
        left None); see `forward`.

        This is what decoding calls: the family's shift (`ModelSpec.output_rows`) is applied here, once, to the
        logits and to the tap positions (features get the same shift as the logits). A cached step's query positions
        are output rows, not shifted here: they must include ``output_rows(positions)``.
        """
        outputs = outputs or Outputs()
        if outputs.positions is not None:
            raise ValueError("predict takes the canvas positions as its own argument: leave outputs.positions None")
        first = None
        if attention_mask is not None and self.spec.logit_shift:
            first = attention_mask.to(torch.uint8).argmax(1)  # left padding: each row's first real position
        taps = outputs.tap_positions
        outputs = replace(outputs, positions=self.spec.output_rows(positions, first),
                          tap_positions=None if taps is None else self.spec.output_rows(taps, first))
        return self.forward(input_ids, attention_mask, outputs=outputs, cache=cache, kernels=kernels)

    def _check_forward(self, input_ids, attention_mask, outputs: Outputs, cache: CacheQuery | None, causal) -> None:
        """`forward`'s argument checks: the combinations that cannot go together, each error saying what to pass."""
        if cache is not None and (cache.kv is None) != (cache.query_positions is None):
            raise ValueError("cache.kv and cache.query_positions go together: pass both (a cached step) or neither")
        if cache is not None and cache.kv is not None and (causal or cache.store):
            raise ValueError("a cached step (cache.kv) cannot also be causal or store; refresh with a full forward "
                             "(CacheQuery(store=True), no kv)")
        if causal and attention_mask is not None:
            raise ValueError("causal=True takes no attention_mask (the causal mask is the only mask); pass "
                             "unpadded rows or causal=False")
        if outputs.head_op is not None and (outputs.wants_logits or outputs.hidden):
            raise ValueError("outputs.head_op replaces the LM head and returns only its stats: pass logits=False "
                             "and hidden=False with it (or drop head_op to get logits or hidden)")
        if outputs.tap_op is not None and not outputs.taps:
            raise ValueError("outputs.tap_op folds the three taps, so it needs tap rows: pass taps=True (with "
                             "tap_positions, default all rows) or drop tap_op")
        if outputs.taps and len(self.blocks) < 3:
            raise ValueError(f"outputs.taps reads the last three layers' hidden states, but this model has "
                             f"{len(self.blocks)} layers; use a model with at least 3")
        L = input_ids.shape[1]
        if L > self.spec.max_positions:
            raise ValueError(f"input_ids has {L} positions but the model supports at most {self.spec.max_positions} "
                             f"(max positions in config.json); shorten the prompt or gen_length")

    def forward(self, input_ids, attention_mask=None, position_ids=None, *, outputs: Outputs | None = None,
                cache: CacheQuery | None = None, causal=False, kernels=None) -> BackboneOutput:
        """Run the backbone (every position, or with a cached step only the query rows).

        Args:
            input_ids (torch.Tensor): [B, L] int64 tokens (with a cached step still the whole canvas; the cache may
                hold more positions than L, only the first L are keys).
            attention_mask (torch.Tensor): [B, L] bool/int, 1 for real tokens, 0 for (left) padding keys.
                Default: None (every key visible).
            position_ids (torch.Tensor): [B, L] int64. Default: counted from the first real token of each row.
            outputs (Outputs, optional): what to return (`tracelock.models.query.Outputs`). Default: the logits of
                every row.
            cache (CacheQuery, optional): a refresh or a cached step (`tracelock.models.query.CacheQuery`).
                Default: None (no cache).
            causal (bool): a causal attention mask instead of the diffusion models' full attention. Only the
                testbed's AR calibration (`tracelock.testbed.ar_calibration`) uses it; no decoder does.
            kernels (optional): the per-layer ops (``add_rms_norm``, ``rope_qkv``, ``silu_mul``, ``linear``), e.g.
                a `tracelock.ops.OpSet`. Default: their plain-PyTorch specs (`tracelock.ops.spec_set`).

        Returns:
            BackboneOutput: raw (unshifted) logits [B, R, V], the LM head's input [B, R, D], the taps
            (3 x [B, T, D]), head_op's stats ([B, R] each), tap_op's inputs [B, T, N] and the refresh's
            `KVCache`, each None unless asked for.
        """
        outputs = outputs or Outputs()
        self._check_forward(input_ids, attention_mask, outputs, cache, causal)
        B, L = input_ids.shape
        if position_ids is None:
            position_ids = self.positions_for(attention_mask, B, L)
        if kernels is None:  # the specs: imported here, so that loading a model never loads tracelock._C
            from tracelock.ops import spec_set

            kernels = spec_set()
        attn_mask = _key_padding_mask(attention_mask, B, L, self.dtype)
        past = None
        if cache is not None and cache.kv is not None:
            # only the query rows run; positions asked for are re-indexed into them
            outputs = _in_query(outputs, cache, L)
            q = cache.query_positions
            input_ids, position_ids = input_ids.gather(1, q), position_ids.gather(1, q)
            past = (cache.kv, q if cache.kv_positions is None else cache.kv_positions, L)
        store = cache is not None and cache.store
        h, delta, taps, stored = self._layers(input_ids, position_ids, attn_mask, kernels, causal, past, store,
                                              outputs)
        logits, hidden, stats = self._head(h, delta, outputs)
        taps, tap_inputs = self._taps(h, delta, taps, outputs)
        return BackboneOutput(logits=logits, taps=taps, hidden=hidden, stats=stats, tap_inputs=tap_inputs,
                              kv_cache=KVCache([k for k, _ in stored], [v for _, v in stored]) if store else None)

    def _layers(self, input_ids, position_ids, attn_mask, kernels, causal, past, store, outputs: Outputs) -> tuple:
        """(h, delta) after the last layer, the first two taps' rows, and with ``store`` every layer's keys and
        values. ``past`` = (cache, write positions, L) for a cached step."""
        cos, sin = rope_cos_sin(position_ids, self.spec.head_dim, self.spec.rope_theta)
        h, delta = self.embed(input_ids), None
        n = len(self.blocks)
        taps, stored = [], []
        for i, block in enumerate(self.blocks):
            layer_past = None if past is None else (past[0].keys[i], past[0].values[i], past[1], past[2])
            out = block(h, delta, cos, sin, attn_mask, kernels, causal, layer_past, store)
            h, delta = out[:2]
            if store:
                stored.append(out[2:])
            if outputs.taps and i in (n - 3, n - 2):
                # the layer's output h + delta, at the tap rows only
                taps.append(_layer_output(h, delta, outputs.tap_positions))
        return h, delta, taps, stored

    def _head(self, h, delta, outputs: Outputs) -> tuple:
        """(logits, hidden, stats) at the outputs' positions, each None unless asked for."""
        logits = hidden = stats = None
        if outputs.wants_logits or outputs.hidden or outputs.head_op is not None:
            # the final norm as its module, on the gathered rows only (a few: no kernel needed; hooks on it still fire)
            normed = self.norm(_layer_output(h, delta, outputs.positions))
            logits = self.lm_head(normed) if outputs.wants_logits else None
            hidden = normed if outputs.hidden else None
            if outputs.head_op is not None:
                B, R, D = normed.shape
                stats = tuple(t.reshape(B, R) for t in outputs.head_op(normed.reshape(B * R, D), self.lm_head.weight,
                                                                       self.spec.eos_id))
        return logits, hidden, stats

    def _taps(self, h, delta, taps: list, outputs: Outputs) -> tuple:
        """(taps, tap_inputs): the three taps, or with ``tap_op`` the controller inputs folded from them."""
        if not outputs.taps:
            return None, None
        taps.append(self.norm(_layer_output(h, delta, outputs.tap_positions)))
        if outputs.tap_op is None:
            return tuple(taps), None
        B, T, D = taps[0].shape
        return None, outputs.tap_op(*(t.reshape(B * T, D) for t in taps)).reshape(B, T, -1)
