"""LLaDA (a bidirectional Llama block under OLMo's names): ``LLaDAModelLM.model.transformer`` holds ``wte``, the
``blocks`` (attn_norm, q/k/v_proj, attn_out, ff_norm, ff_proj = the gate, up_proj, ff_out = the down projection),
``ln_f`` and ``ff_out`` (the LM head), as the released safetensors name them. RoPE in fp32 (rope_full_precision)."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_llada import LLaDAConfig


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


class LLaDABlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c.d_model, c.d_model // c.n_heads
        self.heads, self.kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, hd
        self.attn_norm, self.ff_norm = RMSNorm(d, c.rms_norm_eps), RMSNorm(d, c.rms_norm_eps)
        self.q_proj = nn.Linear(d, c.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, c.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, c.n_kv_heads * hd, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj = nn.Linear(d, c.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(d, c.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(c.mlp_hidden_size, d, bias=False)

    def forward(self, x, cos, sin, mask):
        B, L, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        x = x + self.attn_out(a.transpose(1, 2).reshape(B, L, -1))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDAModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.embedding_size, c.d_model),
            blocks=nn.ModuleList(LLaDABlock(c) for _ in range(c.n_layers)),
            ln_f=RMSNorm(c.d_model, c.rms_norm_eps),
            ff_out=nn.Linear(c.d_model, c.embedding_size, bias=False)))

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        c, t = self.config, self.transformer
        x = t.wte(input_ids)
        L, hd = input_ids.shape[1], c.d_model // c.n_heads
        inv = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
        freqs = torch.arange(L, device=x.device, dtype=torch.float32)[:, None] * inv
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # key padding
        hidden = [x]
        for block in t.blocks:
            x = block(x, cos, sin, mask)
            hidden.append(x)
        x = t.ln_f(x)
        hidden[-1] = x  # as transformers' tuple: the last entry is the final-normed output
        return t.ff_out(x), tuple(hidden) if output_hidden_states else None


class LLaDAModelLM(PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDABlock"]

    def __init__(self, config):
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def get_output_embeddings(self):
        return self.model.transformer.ff_out

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, return_dict=True, **_):
        logits, hidden = self.model(input_ids, attention_mask, output_hidden_states)
        return CausalLMOutputWithPast(logits=logits, hidden_states=hidden)
