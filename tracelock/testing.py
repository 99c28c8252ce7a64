"""Test helpers shared by tests/ and bench/: the independent HF oracle, the tolerance rules,
random prompts for tiny checkpoints, and a count of host syncs on CUDA."""

import contextlib
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from tracelock.models.loading import _tensor_files
from tracelock.models.spec import ModelSpec

# official LLaDA key fragment -> transformers Llama fragment; Dream's names equal Qwen2's
_LLADA_TO_LLAMA = [
    ("model.transformer.wte.", "model.embed_tokens."),
    ("model.transformer.ln_f.", "model.norm."),
    ("model.transformer.ff_out.", "lm_head."),
    ("model.transformer.blocks.", "model.layers."),
    (".attn_norm.", ".input_layernorm."),
    (".q_proj.", ".self_attn.q_proj."),
    (".k_proj.", ".self_attn.k_proj."),
    (".v_proj.", ".self_attn.v_proj."),
    (".attn_out.", ".self_attn.o_proj."),
    (".ff_norm.", ".post_attention_layernorm."),
    (".ff_proj.", ".mlp.gate_proj."),
    (".up_proj.", ".mlp.up_proj."),
    (".ff_out.", ".mlp.down_proj."),
]


def _hf_key(spec: ModelSpec, key: str) -> str:
    if spec.family != "llada":
        return key
    # in order: the top-level renames come first, so the LM head's ff_out never meets the MLP's ff_out rule
    for old, new in _LLADA_TO_LLAMA:
        key = key.replace(old, new)
    return key


def hf_reference(folder, dtype=torch.float32):
    """transformers' Llama (for LLaDA) or Qwen2 (for Dream), made bidirectional, with the folder's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = ModelSpec.from_pretrained(folder)
    kwargs = dict(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  num_hidden_layers=spec.num_layers, vocab_size=spec.vocab_size, rms_norm_eps=spec.rms_norm_eps,
                  rope_theta=spec.rope_theta, max_position_embeddings=spec.max_positions,
                  tie_word_embeddings=False, is_causal=False, attn_implementation="sdpa")
    if spec.family == "llada":
        config, cls = LlamaConfig(**kwargs, attention_bias=False, mlp_bias=False), LlamaForCausalLM
    else:
        config, cls = Qwen2Config(**kwargs, use_sliding_window=False), Qwen2ForCausalLM
    model = cls(config)
    state = {}
    # the checkpoint's own weight files (model.safetensors or its index), not other safetensors in the folder
    for key, file in _tensor_files(Path(folder)).items():
        with safe_open(file, framework="pt") as f:
            state[_hf_key(spec, key)] = f.get_tensor(key)
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, *, atol: float, rtol: float = 0.0) -> None:
    """allclose with a failure message that gives the max abs error, the relative RMS error and the first index."""
    ref, got = ref.float(), got.float()
    diff = (ref - got).abs()
    bad = diff > atol + rtol * ref.abs()
    if bool(bad.any()):
        first = tuple(bad.nonzero()[0].tolist())
        rel_rms = (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()
        raise AssertionError(f"{name}: max abs err {diff.max().item():.3g}, rel RMS {rel_rms:.3g}, "
                             f"{int(bad.sum())} of {bad.numel()} beyond atol={atol} rtol={rtol}; first at {first}: "
                             f"ref {ref[first].item():.6g} got {got[first].item():.6g}")


def assert_lowp_close(name: str, ref32: torch.Tensor, got: torch.Tensor, same_lowp: torch.Tensor,
                      atol: float = 1e-3) -> None:
    """flash-attention's rule: err(candidate, ref_fp32) <= 2 * err(torch in the same low precision, ref_fp32) + atol."""
    err, base = max_err(got, ref32), max_err(same_lowp, ref32)
    if not err <= 2 * base + atol:
        raise AssertionError(f"{name}: low-precision error {err:.4g} exceeds 2 x reference error {base:.4g} + {atol}")


def random_prompts(model, lengths=(9, 5, 12), seed: int = 7) -> list:
    """Token-id prompts of the given lengths for a tiny checkpoint: random ids below 400, never the mask id."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, 400, (n,), generator=g)
        out.append(ids.masked_fill(ids == model.spec.mask_id, 1).tolist())
    return out


def fresh_controller(model, *, seed: int = 2, folder=None):
    """(Controller, TapEncoder): a freshly initialised small controller on PCA encoders of random hidden states,
    for tests that need a TraceLock policy without training one. With ``folder``, both are saved there the way
    `tracelock train --out` does (best.safetensors + encoder files), so the folder works as ``--controller``."""
    from tracelock.controller import Controller, ControllerConfig, controller_fingerprint
    from tracelock.features import LinearEncoder, TapEncoder, backbone_fingerprint

    samples = torch.randn(256, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    enc = TapEncoder(LinearEncoder.fit_pca(samples, 8), LinearEncoder.fit_pca(samples, 4), backbone_fingerprint(model))
    torch.manual_seed(seed)
    cfg = ControllerConfig(code_dim=enc.code_dim, groups=enc.groups, width=32, layers=1, heads=2, ffn=48,
                           dropout=0.0, confidence_input=True, fingerprint=controller_fingerprint(model, enc))
    controller = Controller(cfg).eval()
    if folder is not None:
        controller.save(Path(folder) / "best.safetensors")
        enc.save(folder)
    return controller, enc


def eos_prone_model(folder, family: str, gen_length: int = 16):
    """A tiny checkpoint with a peaked LM head whose end token shadows its most proposed token: threshold rules
    commit several per step, batch rows finish at different steps, and end-of-text prediction has work."""
    import tracelock
    from tracelock.models import write_tiny_checkpoint

    m = tracelock.load_model(write_tiny_checkpoint(folder, family=family, seed=4))
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
        x, _ = tracelock.reference_generate(m, random_prompts(m), policy="confidence", gen_length=gen_length,
                                            block=4)
        values, counts = x[:, -gen_length:].flatten().unique(return_counts=True)
        m.lm_head.weight[m.spec.eos_id] = m.lm_head.weight[values[counts.argmax()]] * 1.02
    return m


def step_l2p_filter(model, features: int = 1):
    """A Learn2PD filter of block 4 for ``model``: with ``features=1`` (confidences) it accepts the slots with
    confidence above 0.5 (logit 40 (c - 0.5)); with more (an encoder's code width, for l2p-hidden) it is random."""
    from tracelock.features import backbone_fingerprint
    from tracelock.l2p.filter import FilterConfig, L2PFilter

    torch.manual_seed(5)
    f = L2PFilter(FilterConfig(block=4, hidden=4, features=features, family=model.spec.family,
                               eos_id=model.spec.eos_id, backbone=backbone_fingerprint(model)))
    if features == 1:
        with torch.no_grad():
            f.net[0].weight.copy_(40 * torch.eye(4))
            f.net[0].bias.fill_(-20.0)
            f.net[2].weight.copy_(torch.eye(4))
            f.net[2].bias.zero_()
    return f.eval()


def decode_on_engine(model, prompts, slots=None, bucket=None, **settings) -> tuple:
    """Every prompt through one `DecodeEngine` (all admitted at once): ([(tokens, stats)] per prompt, engine)."""
    from tracelock.decode.engine import DecodeEngine, prompt_bucket

    bucket = bucket or prompt_bucket(max(map(len, prompts)), settings["gen_length"], model.spec.max_positions)
    engine = DecodeEngine(model, slots=slots or len(prompts), prompt_len=bucket, **settings)
    return engine.run(prompts), engine


def assert_same_decode(got, want, label: str = "") -> None:
    """Two single-row decodes, (tokens, DecodeStats) each, are the same: tokens, steps, commits, refreshes, lengths."""
    (tokens, stats), (ref_tokens, ref_stats) = got, want
    assert torch.equal(tokens, ref_tokens), f"{label}: tokens differ"
    assert stats.steps == ref_stats.steps, f"{label}: steps {stats.steps} != {ref_stats.steps}"
    assert stats.commits_per_step == ref_stats.commits_per_step, label
    assert stats.refreshes == ref_stats.refreshes and stats.gen_lengths == ref_stats.gen_lengths, label


# torch's sync debug mode warns once per sync with this text; its one-time notice that the mode is a prototype also
# mentions synchronization, so matching on "synchroniz" alone counts one sync too many
_SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def counting_cuda_syncs():
    """Counts the host syncs of the CUDA work inside the ``with`` block (torch's sync debug mode). Yields a list that
    holds one entry per sync once the block ends."""
    syncs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(0)
            syncs.extend(w for w in caught if _SYNC_WARNING in str(w.message))
