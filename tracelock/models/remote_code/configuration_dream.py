"""Dream's config in its released field names (Qwen2's)."""

from transformers import PretrainedConfig


class DreamConfig(PretrainedConfig):
    model_type = "Dream"

    def __init__(self, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, rope_theta=10000.0,
                 rms_norm_eps=1e-6, mask_token_id=None, tie_word_embeddings=False, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.max_position_embeddings, self.rope_theta, self.rms_norm_eps = max_position_embeddings, rope_theta, \
            rms_norm_eps
        self.mask_token_id = mask_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
