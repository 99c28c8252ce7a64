"""Dream (a bidirectional Qwen2 with q/k/v biases): ``DreamModel.model`` holds ``embed_tokens``, the ``layers``
(input_layernorm, self_attn.q/k/v_proj with biases, o_proj, post_attention_layernorm, mlp.gate/up/down_proj) and
``norm``, beside ``lm_head``, as the released safetensors name them. RoPE's cos / sin in fp32, cast to the activations'
dtype. The logits are the model's own: row i predicts token i + 1 (Dream's sampler shifts them)."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_dream import DreamConfig


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class DreamAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c.hidden_size, c.hidden_size // c.num_attention_heads
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.heads * hd, bias=True)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(d, self.kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=False)

    def forward(self, h, cos, sin, mask):
        B, L, _ = h.shape
        q = self.q_proj(h).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.o_proj(a.transpose(1, 2).reshape(B, L, -1))


class DreamMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DreamDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn, self.mlp = DreamAttention(c), DreamMLP(c)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DreamBaseModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DreamDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, input_ids, attention_mask=None, position_ids=None, output_hidden_states=False):
        c = self.config
        x = self.embed_tokens(input_ids)
        B, L = input_ids.shape
        hd = c.hidden_size // c.num_attention_heads
        if position_ids is None:
            position_ids = torch.arange(L, device=x.device).expand(B, L)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
        freqs = position_ids.float()[..., None] * inv
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        # Dream's masks: None or "full" (no mask), else a 4-D bool [B, 1, L, L] (True = attend), used as given
        mask = None if attention_mask is None or isinstance(attention_mask, str) else attention_mask
        hidden = [x]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
            hidden.append(x)
        x = self.norm(x)
        hidden[-1] = x
        return x, tuple(hidden) if output_hidden_states else None


class DreamModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    _no_split_modules = ["DreamDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, output_hidden_states=False,
                return_dict=True, **_):
        x, hidden = self.model(input_ids, attention_mask, position_ids, output_hidden_states)
        return MaskedLMOutput(logits=self.lm_head(x), hidden_states=hidden)
