"""LLaDA's config in its released field names (OLMo's), with transformers' aliases (hidden_size, ...)."""

from transformers import PretrainedConfig


class LLaDAConfig(PretrainedConfig):
    model_type = "llada"
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"}

    def __init__(self, d_model=768, n_heads=12, n_kv_heads=None, n_layers=12, mlp_hidden_size=None, mlp_ratio=4,
                 vocab_size=50257, embedding_size=50304, max_sequence_length=1024, rope_theta=10000.0,
                 rms_norm_eps=1e-5, rope_full_precision=True, mask_token_id=None, **kwargs):
        self.d_model, self.n_heads, self.n_layers = d_model, n_heads, n_layers
        self.n_kv_heads = n_kv_heads or n_heads
        self.mlp_hidden_size = mlp_hidden_size or mlp_ratio * d_model
        self.mlp_ratio, self.vocab_size, self.embedding_size = mlp_ratio, vocab_size, embedding_size or vocab_size
        self.max_sequence_length, self.rope_theta, self.rms_norm_eps = max_sequence_length, rope_theta, rms_norm_eps
        self.rope_full_precision, self.mask_token_id = rope_full_precision, mask_token_id
        super().__init__(**kwargs)
