"""The testbed's autoregressive yardstick: the backbone's causal mode, the loss, and a micro calibration run."""

import json
from pathlib import Path

import pytest
import torch

from tracelock.cli import main
from tracelock.testbed.ar_calibration import calibrate
from tracelock.testbed.train import BackboneTrainConfig, Batches, _build, ar_loss


def micro_config(out, **kw):
    return BackboneTrainConfig(out=str(out), steps=3, batch_size=4, d_model=32, n_layers=3, n_heads=2, mlp=64,
                       vocab_size=400, tokenizer_corpus=300, **kw)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    out = tmp_path_factory.mktemp("ar") / "run"
    cfg = micro_config(out)
    model, tok = _build(cfg, out)
    return cfg, model, tok


def test_causal_rows_ignore_later_tokens_and_full_attention_does_not(micro):
    _, model, _ = micro
    x = torch.randint(10, 300, (2, 12))
    y = x.clone()
    y[:, 8:] = torch.randint(10, 300, (2, 4))
    with torch.no_grad():
        causal_x, causal_y = (model(t, causal=True).logits for t in (x, y))
        full_x, full_y = (model(t).logits for t in (x, y))
    torch.testing.assert_close(causal_x[:, :8], causal_y[:, :8])
    assert not torch.allclose(full_x[:, :8], full_y[:, :8])


def test_causal_refuses_a_padding_mask(micro):
    _, model, _ = micro
    x = torch.randint(10, 300, (1, 6))
    with pytest.raises(ValueError, match="causal=True takes no attention_mask"):
        model(x, torch.ones_like(x), causal=True)


def test_ar_loss_learns_a_fixed_batch(micro):
    cfg, _, tok = micro
    model, _ = _build(cfg, Path(cfg.out))  # a fresh copy: this test trains it
    x, region, _ = Batches(cfg, tok, model.spec)(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = ar_loss(model, x, region).item()
    for _ in range(30):
        loss = ar_loss(model, x, region)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first


def test_calibration_scores_held_out_items_and_writes_json(tmp_path):
    result = calibrate(micro_config(tmp_path / "run"), n=2, max_new_tokens=8, progress=False)
    assert set(result["tasks"]) == {"math", "code"}
    for r in result["tasks"].values():
        assert r["n"] == 2 and 0.0 <= r["accuracy"] <= 1.0 and all(isinstance(c, str) for c in r["examples"])
    with pytest.raises(FileExistsError, match="already holds a run"):
        calibrate(micro_config(tmp_path / "run"), n=2, progress=False)


def test_cli_writes_the_result(tmp_path):
    out = tmp_path / "cli"
    assert main(["testbed-ar-calibration", "--out", str(out), "--n", "1", "--steps", "2", "--batch-size", "2",
                 "--d-model", "32", "--n-layers", "3", "--n-heads", "2", "--mlp", "64", "--vocab-size", "400",
                 "--tokenizer-corpus", "300"]) == 0
    result = json.loads((out / "ar_calibration.json").read_text())
    assert result["config"]["steps"] == 2 and result["tasks"]["math"]["n"] == 1


@pytest.mark.parametrize("field, value, match", [
    ("tokenizer_corpus", 10**20, "pass --tokenizer-corpus in that range"),
    ("vocab_size", 1 << 20, "a smaller --vocab-size"),
    ("d_model", 10**8, "pass smaller --d-model"),
])
def test_sizes_that_would_hang_or_abort_are_refused_before_any_work(tmp_path, field, value, match):
    """testbed-ar-calibration builds its model without `train`: it ran a huge tokenizer corpus inside the tokenizers
    library past any time limit (found by the CLI fuzzing); it checks the config as `train` does."""
    with pytest.raises(ValueError, match=match):
        calibrate(BackboneTrainConfig(out=str(tmp_path / "run"), **{field: value}), n=1, progress=False)
    assert not (tmp_path / "run").exists()
