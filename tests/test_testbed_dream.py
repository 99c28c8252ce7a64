"""The Dream-family testbed: a Dream-format checkpoint, its one-position shift in training, resume, the bundled name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import tracelock
from tracelock.models import loading
from tracelock.models.spec import CheckpointError
from tracelock.testbed.evaluate import baseline_policies, demo_policies
from tracelock.testbed.model_files import NUMBER_TOKENS, export_weights, train_tokenizer
from tracelock.testbed.train import BackboneTrainConfig, Batches, draw_masks, mask_generator, sft_loss, train_backbone
from tracelock.testing import assert_close, hf_reference


def micro_config(out, **kw):
    kw = {"family": "dream", "ar_steps": 2, "steps": 4, "batch_size": 4, "d_model": 32, "n_layers": 4, "n_heads": 2,
          "mlp": 64, "vocab_size": 400, "tokenizer_corpus": 300, "save_every": 2, **kw}
    return BackboneTrainConfig(out=str(out), **kw)


@pytest.fixture(scope="module")
def dream_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("testbed-dream") / "run"
    train_backbone(micro_config(out), progress=False)
    return out


def test_the_run_is_a_dream_checkpoint(dream_run):
    config = json.loads((dream_run / "config.json").read_text())
    assert config["model_type"] == "Dream" and config["architectures"] == ["DreamModel"]
    assert "hidden_size" in config and "num_hidden_layers" in config and "d_model" not in config
    keys = load_file(str(dream_run / "model.safetensors")).keys()
    assert "lm_head.weight" in keys and "model.layers.0.self_attn.q_proj.bias" in keys
    model, tok = tracelock.load_model(dream_run), tracelock.load_tokenizer(dream_run)
    spec = model.spec
    assert spec.family == "dream" and spec.logit_shift == 1 and spec.qkv_bias
    assert tok.convert_ids_to_tokens([spec.mask_id, spec.eos_id, spec.eot_id]) == \
        ["<|mask|>", "<|endoftext|>", "<|im_end|>"]
    assert spec.pad_id == spec.eos_id
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_dream_tokenizer_keeps_task_numbers_whole_and_learns_the_system_turn():
    tok = train_tokenizer(("math", "code"), vocab_size=1024, corpus_size=300, seed=0, family="dream")
    for n in range(NUMBER_TOKENS):
        assert len(tok.encode(f"{n}").ids) == 1 and len(tok.encode(f" {n}").ids) == 1, n
    # the template's system turn, which every Dream prompt carries, is in the corpus: fewer tokens than without it
    llada = train_tokenizer(("math", "code"), vocab_size=1024, corpus_size=300, seed=0)
    system = "You are a helpful assistant."
    assert len(tok.encode(system).ids) < len(llada.encode(system).ids)


def test_dream_checkpoint_matches_bidirectional_qwen2(dream_run):
    """transformers' Qwen2 with is_causal=False on the run's weights gives our backbone's raw logits."""
    ours = tracelock.load_model(dream_run)
    ids = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close("logits", hf_reference(dream_run)(ids).logits, ours(ids).logits, atol=1e-4)


def _independent_loss(folder, x, region, answer_len, step, shift):
    """LLaDA's SFT loss written apart from the trainer: HF Qwen2/Llama logits, shifted by ``shift`` rows
    (Dream's sampler: ``cat(logits[:, :1], logits[:, :-1])`` for shift 1)."""
    spec = tracelock.load_model(folder).spec
    t, masked, supervised, region = draw_masks(region, answer_len, mask_generator(0, step), 1e-3)
    logits = hf_reference(folder)(x.masked_fill(masked, spec.mask_id)).logits
    for _ in range(shift):
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    B, L = x.shape
    token = torch.nn.functional.cross_entropy(logits[supervised], x[supervised], reduction="none")
    weights = t[:, None].expand(B, L)[supervised] * region.sum(1, keepdim=True).expand(B, L)[supervised]
    return (token / weights).sum() / B


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_training_loss_applies_the_family_shift_exactly_once(family, dream_run, tmp_path):
    """The masked loss equals the loss on Dream's shifted logits (row j - 1 predicts token j) for Dream and on the
    unshifted logits for LLaDA; the wrong shift (dropped, or applied twice) gives another value."""
    run = dream_run
    if family == "llada":
        run = tmp_path / "llada"
        train_backbone(micro_config(run, family="llada"), progress=False)
    # the run's files with random O(1) weights: a 4-step model predicts nearly the same everywhere, so every shift
    # would give about the same loss
    folder = tmp_path / "random"
    shutil.copytree(run, folder)
    model = tracelock.load_model(folder)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / (p.shape[1] ** 0.5 if p.dim() == 2 else 1.0))
    export_weights(folder, model)
    model, tok = tracelock.load_model(folder), tracelock.load_tokenizer(folder)
    x, region, answer_len = Batches(micro_config(folder, family=family), tok, model.spec)(7)
    with torch.no_grad():
        ours = sft_loss(model, x, region, mask_generator(0, 7), 1e-3, answer_len)
        right = model.spec.logit_shift
        losses = {s: _independent_loss(folder, x, region, answer_len, 7, s) for s in (0, 1, 2)}
    assert_close("loss", losses[right], ours, atol=1e-4)
    for wrong in set(losses) - {right}:
        assert abs(losses[wrong] - ours) > 1e-2, f"shift {wrong} gives the same loss: the test cannot tell"


def test_resumed_dream_run_equals_an_uninterrupted_one(dream_run, tmp_path):
    out = tmp_path / "run"
    train_backbone(micro_config(out), progress=False, stop_after=2)  # saved at the AR -> masked switch
    with pytest.raises(ValueError, match="holds a dream checkpoint but family='llada'"):
        train_backbone(micro_config(out, family="llada"), progress=False)
    train_backbone(micro_config(out), progress=False)
    a, b = load_file(str(dream_run / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_family_is_checked(tmp_path):
    with pytest.raises(ValueError, match="family='gpt'"):
        train_backbone(micro_config(tmp_path / "x", family="gpt"), progress=False)


def test_dream_tables_use_dreams_rules():
    rows = baseline_policies(64, "dream")
    # the reference: the paper's native Dream baseline, exactly one token per step by neg-entropy
    assert rows[0] == ("neg-entropy 1/step", "confidence", {"score": "neg_entropy"})
    assert rows[1] == ("neg-entropy 2/step", "confidence", {"score": "neg_entropy", "steps": 32})
    names = {name for _, name, _ in rows}
    assert {"entropy", "maskgit_plus", "topk_margin", "threshold", "random"} <= names
    assert ("threshold 0.9 (Dream variant)", "threshold", {"tau": 0.9, "first_token": True}) in rows
    assert {r[0] for r in demo_policies(64, "dream")} >= {"neg-entropy 1/step", "entropy 1/step (Dream's schedule)",
                                                         "threshold 0.9 (Dream variant)"}
    assert baseline_policies(64)[0] == ("confidence 1/step", "confidence", {})


def test_dream_reference_commits_one_per_step_where_dreams_schedule_does_not():
    """Why the Dream reference is not Dream's ``entropy`` rule: its truncated count int(n (1 - s/t)) commits nothing
    at a block's first step and two slots at its last; the reference commits exactly one at every step."""
    dream_model, prompt = tracelock.load_model("testbed-dream"), [[5, 6, 7, 8]]
    _, ours = tracelock.fused_generate(dream_model, prompt, policy="confidence", policy_args={"score": "neg_entropy"},
                             gen_length=16, block=8)
    _, dreams = tracelock.fused_generate(dream_model, prompt, policy="entropy", gen_length=16, block=8)
    assert ours.commits_per_step[0] == [1] * 16
    assert dreams.commits_per_step[0] == ([0] + [1] * 6 + [2]) * 2


def test_bundled_names(monkeypatch, tmp_path):
    assert loading.resolve_path("testbed-llada") == loading.resolve_path("testbed")
    monkeypatch.setitem(loading.BUNDLED, "testbed-dream", tmp_path / "absent")
    with pytest.raises(CheckpointError, match="--family dream"):
        tracelock.load_model("testbed-dream")


def test_a_second_stage_starts_from_the_init_runs_tokenizer_and_weights(dream_run, tmp_path):
    from tracelock.testbed.train import _build

    cfg = micro_config(tmp_path / "stage2", ar_steps=0, init=str(dream_run), seed=1)
    (tmp_path / "stage2").mkdir()
    model, tok = _build(cfg, tmp_path / "stage2")
    init = tracelock.load_model(dream_run)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), init.state_dict().values()))
    assert (tmp_path / "stage2" / "tokenizer.json").read_text() == (dream_run / "tokenizer.json").read_text()
    train_backbone(micro_config(tmp_path / "a", ar_steps=0, init=str(dream_run), seed=1), progress=False)
    out = tmp_path / "b"
    train_backbone(micro_config(out, ar_steps=0, init=str(dream_run), seed=1), progress=False, stop_after=2)
    train_backbone(micro_config(out, ar_steps=0, init=str(dream_run), seed=1), progress=False)
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="--init .*hidden_size.: 32.*asks for.*64"):
        train_backbone(micro_config(tmp_path / "c", ar_steps=0, init=str(dream_run), d_model=64), progress=False)
