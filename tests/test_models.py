"""Our LLaDA / Dream backbones against transformers' Llama / Qwen2 made bidirectional (docs/design.md, "Models")."""

import json

import pytest
import torch
from safetensors.torch import save_file

import tracelock
from tracelock.models import CheckpointError, write_tiny_checkpoint
from tracelock.models.query import Outputs
from tracelock.testing import assert_close, assert_lowp_close, hf_reference

FAMILIES = ["llada", "dream"]


@pytest.fixture(scope="module", params=FAMILIES)
def micro(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}-micro")
    write_tiny_checkpoint(path, family=request.param, profile="micro", seed=1)
    return path


def _tokens(model, B=2, L=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    # any id of the padded matrix except the mask: random models must cope with every row
    ids = torch.randint(0, model.spec.vocab_size, (B, L), generator=g)
    return ids.masked_fill(ids == model.spec.mask_id, 0)


def _check_parity(folder, atol):
    ours = tracelock.load_model(folder)
    hf = hf_reference(folder)
    ids = _tokens(ours)
    with torch.no_grad():
        out = ours(ids, outputs=Outputs(taps=True))
        ref = hf(ids, output_hidden_states=True)
    assert_close("logits", ref.logits, out.logits, atol=atol)
    assert len(ref.hidden_states) == ours.spec.num_layers + 1
    for name, r, t in zip(("h[n-2]", "h[n-1]", "norm_f(h[n])"), ref.hidden_states[-3:], out.taps):
        assert_close(name, r, t, atol=atol)


def test_parity_fp32_micro(micro):
    _check_parity(micro, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_fp32_kernel_profile(family, tmp_path):
    """head_dim 128, the real tile shape."""
    write_tiny_checkpoint(tmp_path, family=family, profile="kernel", seed=2)
    _check_parity(tmp_path, atol=1e-4)


def test_parity_bf16(micro):
    """err(ours bf16, HF fp32) <= 2 x err(HF bf16, HF fp32) + atol, for logits and every tap."""
    ids = _tokens(tracelock.load_model(micro))
    with torch.no_grad():
        ref32 = hf_reference(micro)(ids, output_hidden_states=True)
        ref16 = hf_reference(micro, torch.bfloat16)(ids, output_hidden_states=True)
        ours = tracelock.load_model(micro, dtype=torch.bfloat16)(ids, outputs=Outputs(taps=True))
    assert ours.logits.dtype == torch.bfloat16
    assert_lowp_close("logits", ref32.logits, ours.logits, ref16.logits, atol=2e-2)
    for i, tap in enumerate(ours.taps):
        assert_lowp_close(f"tap {i}", ref32.hidden_states[i - 3], tap, ref16.hidden_states[i - 3], atol=2e-2)


def test_selected_rows_equal_full_forward(micro):
    model = tracelock.load_model(micro)
    ids = _tokens(model)
    pos = torch.tensor([[3, 0, 36], [5, 5, 1]])
    full = model(ids, outputs=Outputs(taps=True))
    part = model(ids, outputs=Outputs(positions=pos, taps=True, tap_positions=pos))
    assert_close("logits", full.logits.gather(1, pos[..., None].expand(-1, -1, full.logits.shape[-1])), part.logits,
                 atol=1e-5)
    for a, b in zip(full.taps, part.taps):
        assert_close("tap", a.gather(1, pos[..., None].expand(-1, -1, a.shape[-1])), b, atol=1e-5)


def test_round_trip_and_shards(micro, tmp_path):
    """write -> load gives the written tensors; a 3-shard copy of the same seed gives the same outputs."""
    family = json.loads((micro / "config.json").read_text())["model_type"].lower()
    write_tiny_checkpoint(tmp_path, family=family, profile="micro", seed=1, shards=3)
    assert (tmp_path / "model.safetensors.index.json").exists()
    single, sharded = tracelock.load_model(micro), tracelock.load_model(tmp_path)
    for (n1, p1), (n2, p2) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    ids = _tokens(single)
    assert torch.equal(single(ids).logits, sharded(ids).logits)
    again = tracelock.load_model(micro)
    assert torch.equal(single(ids).logits, again(ids).logits)


def test_hand_written_config_loads(tmp_path):
    """A folder not made by our writer: an HF-style LLaDA config typed out here, weights saved directly."""
    config = {
        "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": 32, "n_heads": 2, "n_kv_heads": 2,
        "n_layers": 4, "mlp_hidden_size": 64, "mlp_ratio": 4, "vocab_size": 100, "embedding_size": 128,
        "max_sequence_length": 64, "rope": True, "rope_theta": 500000.0, "rope_full_precision": True,
        "rms_norm_eps": 1e-05, "layer_norm_type": "rms", "activation_type": "silu", "block_type": "llama",
        "include_bias": False, "weight_tying": False, "mask_token_id": 99, "eos_token_id": 98, "pad_token_id": 98,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    w = {"model.transformer.wte.weight": torch.randn(128, 32, generator=g),
         "model.transformer.ln_f.weight": torch.ones(32), "model.transformer.ff_out.weight": torch.randn(128, 32)}
    for i in range(4):
        p = f"model.transformer.blocks.{i}."
        for name, shape in [("attn_norm", (32,)), ("ff_norm", (32,)), ("q_proj", (32, 32)), ("k_proj", (32, 32)),
                            ("v_proj", (32, 32)), ("attn_out", (32, 32)), ("ff_proj", (64, 32)),
                            ("up_proj", (64, 32)), ("ff_out", (32, 64))]:
            w[p + name + ".weight"] = torch.randn(shape, generator=g) * 0.1
    save_file(w, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = tracelock.load_model(tmp_path)
    assert (model.spec.mask_id, model.spec.eos_id, model.spec.vocab_size) == (99, 98, 128)
    assert torch.equal(model.embed.weight, w["model.transformer.wte.weight"])
    ref = hf_reference(tmp_path)
    ids = torch.randint(0, 98, (1, 20))
    assert_close("logits", ref(ids).logits, model(ids).logits, atol=1e-4)


def test_left_padded_batch_equals_alone(micro):
    model = tracelock.load_model(micro)
    a, b = _tokens(model, 1, 30, seed=1)[0], _tokens(model, 1, 19, seed=2)[0]
    pad = model.spec.pad_id
    batch = torch.stack([a, torch.cat([torch.full((11,), pad), b])])
    mask = batch != -1
    mask[1, :11] = False
    padded = model(batch, mask)
    for row, alone, n in ((0, a, 30), (1, b, 19)):
        single = model(alone[None]).logits[0]
        got = padded.logits[row, -n:]
        assert_close(f"row {row}", single, got, atol=1e-4)
        assert torch.equal(single.argmax(-1), got.argmax(-1))


def test_logit_shift_is_applied_once(micro):
    """Decoding reads the token at j from output row j - shift: Dream's row j-1, LLaDA's row j.

    One topk step with k = gen_length commits every position from a single forward, so the tokens must be
    the argmax of the HF reference at exactly those rows (shifting twice or not at all fails).
    """
    model = tracelock.load_model(micro)
    shift = model.spec.logit_shift
    assert shift == (1 if model.spec.family == "dream" else 0)
    prompt = _tokens(model, 1, 9)
    G = 12
    tokens, stats = tracelock.reference_generate(model, prompt, policy="topk", policy_args={"k": G}, gen_length=G)
    assert stats.steps == [1]
    canvas = torch.cat([prompt, torch.full((1, G), model.spec.mask_id)], dim=1)
    with torch.no_grad():
        ref = hf_reference(micro)(canvas).logits[0].argmax(-1)
    P = prompt.shape[1]
    assert torch.equal(tokens[0, P:], ref[P - shift:P + G - shift])
    if shift:
        assert not torch.equal(tokens[0, P:], ref[P:P + G])


def test_errors_name_the_problem(micro, tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        tracelock.load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        tracelock.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="unknown model family.*llada.*dream"):
        tracelock.load_model(tmp_path)
    with pytest.raises(ValueError, match=r"dtype torch.float16 is not supported on cpu.*float32"):
        tracelock.load_model(micro, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype='bfloat61' is not a dtype name.*did you mean 'bfloat16'"):
        tracelock.load_model(micro, dtype="bfloat61")  # a name is taken ("bfloat16", "bf16"), a misspelt one named
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        tracelock.load_model(micro, dtype=16)
    model = tracelock.load_model(micro)
    with pytest.raises(ValueError, match=f"at most {model.spec.max_positions}"):
        model(torch.zeros(1, model.spec.max_positions + 1, dtype=torch.long))


def test_bad_tensors_name_the_key(micro, tmp_path):
    from safetensors.torch import load_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((micro / name).read_bytes())
    tensors = load_file(str(micro / "model.safetensors"))
    key = sorted(k for k in tensors if "blocks.1." in k or "layers.1." in k)[0]
    broken = dict(tensors)
    broken[key] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_file(broken, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{key}.*shape \[3, 3\]"):
        tracelock.load_model(tmp_path)
    del broken[key]
    save_file(broken, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' is missing"):
        tracelock.load_model(tmp_path)
