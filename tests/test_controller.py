"""The controller module: forward == projected path == fold with the encoder, masking, save/load, fingerprints."""

import json

import pytest
import torch

from tracelock import states
from tracelock.controller import Controller, ControllerConfig, controller_fingerprint
from tracelock.features import LinearEncoder, TapEncoder, fold
from tracelock.train.fit import controller_loss

GROUPS = {"h1": (0, 4), "h2": (4, 8), "h3": (8, 12), "d21": (12, 14), "d32": (14, 16)}
SMALL = dict(width=32, layers=2, heads=4, ffn=48, dropout=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")


def _controller(**kw):
    torch.manual_seed(1)
    return Controller(ControllerConfig(code_dim=16, groups=GROUPS, **{**SMALL, **kw})).eval()


def _inputs(B=2, T=11):
    g = torch.Generator().manual_seed(0)
    codes = torch.randn(B, T, 16, generator=g)
    state = torch.full((B, T), states.ACTIVE, dtype=torch.long)
    state[:, :4] = states.PROMPT
    state[:, 5] = states.LOCKED
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[-1, 8:] = False
    return codes, state, key_mask, torch.rand(B, T, generator=g)


@pytest.mark.parametrize("features", ["last", "deltas", "hidden", "all"])
def test_forward_equals_projected_path(features):
    model = _controller(features=features, confidence_input=True, state_embedding=True)
    codes, state, key_mask, conf = _inputs()
    a, tau = model(codes, state, key_mask, conf)
    a2, tau2 = model.forward_projected(model.project(codes), state, key_mask, conf)
    assert a.shape == (2, 11) and tau.shape == (2,)
    torch.testing.assert_close(a, a2, rtol=0, atol=0)
    torch.testing.assert_close(tau, tau2, rtol=0, atol=0)
    # the full-width input weight reads only the selected groups
    weight, bias = model.full_input_weight()
    used = {c for g in {"last": ["h3"], "deltas": ["d21", "d32"], "hidden": ["h1", "h2", "h3"]}.get(
        features, list(GROUPS)) for c in range(*GROUPS[g])}
    unused = [c for c in range(16) if c not in used]
    assert torch.count_nonzero(weight[:, unused]) == 0
    torch.testing.assert_close(codes @ weight.T + bias, model.project(codes))


def test_fold_with_linear_encoder_matches_codes_path():
    D = 24
    samples = torch.randn(200, D, dtype=torch.float64)
    enc = TapEncoder(LinearEncoder.fit_pca(samples, 4), LinearEncoder.fit_pca(samples, 2),
                     backbone=dict(family="llada", hidden_size=D, num_layers=4, vocab_size=10))
    model = _controller()
    h = [torch.randn(2, 9, D) for _ in range(3)]
    A, c = fold(enc, *model.full_input_weight())
    folded = h[0] @ A[0] + h[1] @ A[1] + h[2] @ A[2] + c
    torch.testing.assert_close(folded, model.project(enc.codes(*h)), rtol=1e-4, atol=1e-4)


def test_masked_positions_do_not_leak():
    model = _controller()
    codes, state, key_mask, _ = _inputs()
    a, tau = model(codes, state, key_mask)
    changed = codes.clone()
    changed[1, 8:] += 100.0
    a2, tau2 = model(changed, state, key_mask)
    torch.testing.assert_close(a[1, :8], a2[1, :8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tau, tau2, rtol=1e-5, atol=1e-5)
    # unmasked, the same change moves the scores
    assert not torch.allclose(model(changed, state, torch.ones_like(key_mask))[0][1, :8], a[1, :8], atol=1e-3)


def test_left_padding_is_invisible_and_positions_count_from_the_first_real_token():
    model = _controller(state_embedding=True)
    codes, state, key_mask, _ = _inputs(B=1)
    pad = 3
    padded = torch.cat([torch.randn(1, pad, 16), codes], dim=1)
    pstate = torch.cat([torch.full((1, pad), states.PROMPT), state], dim=1)
    pmask = torch.cat([torch.zeros(1, pad, dtype=torch.bool), key_mask], dim=1)
    a, tau = model(codes, state, key_mask)
    pa, ptau = model(padded, pstate, pmask)
    torch.testing.assert_close(pa[:, pad:], a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ptau, tau, rtol=1e-5, atol=1e-5)


def test_save_load_roundtrip_and_fingerprint(tmp_path):
    fp = dict(backbone=dict(family="llada", hidden_size=64, num_layers=4, vocab_size=512), encoder="abc")
    model = _controller(confidence_input=True)
    model.config.fingerprint = fp
    path = model.save(tmp_path / "best.safetensors")
    assert (tmp_path / "best.json").exists() and not list(tmp_path.glob(".*"))
    loaded = Controller.load(tmp_path)
    codes, state, key_mask, conf = _inputs()
    for x, y in zip(model(codes, state, key_mask, conf), loaded(codes, state, key_mask, conf)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert loaded.config == model.config

    class Spec:
        family, hidden_size, num_layers, vocab_size = "dream", 112, 4, 512

    with pytest.raises(ValueError, match=r"trained for backbone \{'family': 'llada'.*used with \{'family': 'dream'"):
        Controller.load(path, model=Spec())
    assert controller_fingerprint(Spec())["backbone"]["family"] == "dream"
    with pytest.raises(FileNotFoundError, match="no controller"):
        Controller.load(tmp_path / "missing")


@pytest.mark.parametrize("kw, match", [
    (dict(features="everything"), "features='everything' must be one of"),
    (dict(features="all", groups={"h3": (0, 4)}), r"needs code groups \['h1', 'h2', 'd21', 'd32'\]"),
    (dict(width=30), "width=30 must be a multiple of heads=4"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ControllerConfig(code_dim=16, **{"groups": GROUPS, **SMALL, **kw})


def test_confidence_required_and_shape_errors():
    model = _controller(confidence_input=True)
    codes, state, key_mask, _ = _inputs()
    with pytest.raises(ValueError, match="pass confidence"):
        model(codes, state, key_mask)
    with pytest.raises(ValueError, match="must be \\[B, T\\]"):
        model(codes, state[:, :5], key_mask, None)


def test_one_training_step_lowers_the_loss():
    model = _controller().train()
    codes, state, key_mask, _ = _inputs(B=4, T=16)
    label = (codes[..., 8] > 0).long()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        a, tau = model(codes, state, key_mask)
        loss = controller_loss(a, tau, label, state, key_mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[1] < losses[0]


def test_the_commit_rule_is_checked_saved_and_absent_in_older_files(tmp_path):
    from tracelock.controller import commit_rule_named

    for bad, match in (({"hold_end": 1}, "hold_end=1 must be true or false"),
                       ({"fallback": "greedy"}, "fallback='greedy' must be one of score, confidence, neg_entropy"),
                       ({"cap": 4}, "must be a dict of hold_end"), ([], "must be a dict of hold_end")):
        with pytest.raises(ValueError, match=match):
            _controller(commit_rule=bad)
    ctrl = _controller(commit_rule={"hold_end": True, "fallback": "neg_entropy"})
    ctrl.save(tmp_path / "best.safetensors")
    assert Controller.load(tmp_path).config.commit_rule == {"hold_end": True, "fallback": "neg_entropy"}
    raw = json.loads((tmp_path / "best.json").read_text())
    del raw["commit_rule"]  # a controller saved before the field existed deploys with the paper's rule
    (tmp_path / "best.json").write_text(json.dumps(raw))
    assert Controller.load(tmp_path).config.commit_rule == {}
    fingerprint = {"backbone": {"family": "dream"}}
    assert commit_rule_named("hold-end", fingerprint) == {"hold_end": True, "fallback": "neg_entropy"}
    assert commit_rule_named("paper", fingerprint) == {}
    with pytest.raises(ValueError, match="backbone family is None"):
        commit_rule_named("hold-end", {})
