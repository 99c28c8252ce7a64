"""Encoders, their fold, and replay of traces through the frozen backbone, on tiny random checkpoints."""

import numpy as np
import pytest
import torch

import tracelock
from tracelock import states
from tracelock.features import (
    FEATURE_SETS,
    AutoEncoder,
    LinearEncoder,
    TapEncoder,
    backbone_fingerprint,
    fit_encoder,
    fold,
    load_encoder,
    train_autoencoder,
)
from tracelock.models.query import Outputs
from tracelock.traces.replay import replay, sample_taps
from tracelock.traces.trace import NO_PROPOSAL, Trace


def record_traces(model, prompts, *, gen_length=16, policy="topk", policy_args=None, block=None, record_every=1,
                  seed=0, id_prefix="t"):
    """Decode equal-length ``prompts`` (no padding) and build one `Trace` per row from the observer's records.

    Steps ``0, record_every, ...`` and the last step are recorded; commit_step[p] is the last step at which p
    was still active.
    """
    spec, P = model.spec, len(prompts[0])
    seen = {r: [] for r in range(len(prompts))}

    def observer(rec):
        for j, r in enumerate(rec.rows.tolist()):
            props = np.full(gen_length, NO_PROPOSAL, np.int32)
            conf = np.full(gen_length, np.nan, np.float16)
            act = rec.active[j]
            pos = (rec.positions[j][act] - P).numpy()
            props[pos] = rec.signals.proposal[j][act].numpy()
            conf[pos] = rec.signals.confidence[j][act].numpy()
            seen[r].append((int(rec.step[j]), props, conf, rec.state[j, P:].numpy().copy()))

    canvas, stats = tracelock.fused_generate(model, torch.tensor(prompts), policy=policy, policy_args=policy_args or
                                             {"k": 2}, gen_length=gen_length, block=block, seed=seed,
                                             observer=observer)
    traces = []
    for r in range(len(prompts)):
        rec = sorted(seen[r], key=lambda s: s[0])
        n = len(rec)
        active = np.stack([s[3] == states.ACTIVE for s in rec])  # [S, G]
        commit_step = (n - 1 - np.argmax(active[::-1], axis=0)).astype(np.int32)
        final = canvas[r, P:].numpy().astype(np.int32)
        steps = np.array(sorted(set(range(0, n, record_every)) | {n - 1}), np.int32)
        traces.append(Trace(
            prompt=np.array(prompts[r], np.int32), final=final,
            final_state=np.where(np.isin(final, spec.end_ids), states.EOT, states.LOCKED).astype(np.uint8),
            commit_step=commit_step, steps=steps, proposals=np.stack([rec[s][1] for s in steps]),
            confidence=np.stack([rec[s][2] for s in steps]), mask_id=spec.mask_id, num_steps=n,
            meta={"id": f"{id_prefix}{r}", "policy": policy}))
    return traces


pytestmark = pytest.mark.usefixtures("one_thread")


def make_prompts(n, length, seed=0, vocab=200):
    rng = np.random.default_rng(seed)
    return rng.integers(5, vocab, size=(n, length)).tolist()


@pytest.fixture(scope="module", params=["llada", "dream"])
def backbone(request, tmp_path_factory):
    path = tracelock.write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param)
    return tracelock.load_model(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def traces(backbone):
    return record_traces(backbone, make_prompts(3, 7), gen_length=16, block=8, record_every=2)


def test_replay_proposals_equal_recorded(backbone, traces):
    for trace in traces:
        seen = 0
        for i, (step, taps, props, conf) in enumerate(replay(backbone, trace, batch_size=3)):
            assert step == trace.steps[i]
            assert [t.shape for t in taps] == [(len(trace.prompt) + 16, backbone.spec.hidden_size)] * 3
            assert all(t.dtype == torch.float32 for t in taps)
            rec = trace.proposals[i]
            has = rec != NO_PROPOSAL
            np.testing.assert_array_equal(props.numpy()[has], rec[has])
            np.testing.assert_allclose(conf.numpy()[has], trace.confidence[i][has].astype(np.float32), rtol=2e-3)
            seen += has.sum()
        assert seen > 0


def test_replay_taps_shifted_like_predict(backbone, traces):
    # the taps of canvas position i come from output row output_rows(i): the same rows the logits use
    trace = traces[0]
    step, taps, _, _ = next(replay(backbone, trace, steps=[1]))
    x = torch.from_numpy(trace.x_at(1))[None]
    raw = backbone(x, outputs=Outputs(logits=False, taps=True)).taps
    rows = backbone.spec.output_rows(torch.arange(x.shape[1]))
    for got, ref in zip(taps, raw):
        torch.testing.assert_close(got, ref[0, rows])


def test_replay_rejects_bad_steps(backbone, traces):
    with pytest.raises(ValueError, match="steps must lie"):
        next(replay(backbone, traces[0], steps=[traces[0].num_steps]))


def _linear_encoder(D, dh, dd, seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = torch.randn(500, D, generator=gen) * torch.linspace(0.5, 3, D) + torch.randn(D, generator=gen)
    deltas = torch.randn(500, D, generator=gen) * 0.1
    fp = dict(family="llada", hidden_size=D, num_layers=4, vocab_size=512)
    return TapEncoder(LinearEncoder.fit_pca(samples, dh), LinearEncoder.fit_pca(deltas, dd), fp)


def test_fold_equals_unfolded_random():
    D, N = 24, 10
    enc = _linear_encoder(D, 8, 3)
    weight, bias = torch.randn(N, enc.code_dim), torch.randn(N)
    h1, h2, h3 = (torch.randn(5, 7, D) * 2 + 1 for _ in range(3))
    ref = enc.codes(h1, h2, h3) @ weight.T + bias
    A, c = fold(enc, weight, bias)
    assert A.shape == (3, D, N) and A.dtype == torch.float32 and c.shape == (N,)
    torch.testing.assert_close(h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c, ref, rtol=1e-4, atol=1e-4 * ref.abs().max())
    # folded with the identity, A and c write the codes themselves
    Ac, cc = fold(enc, torch.eye(enc.code_dim), torch.zeros(enc.code_dim))
    codes = enc.codes(h1, h2, h3)
    torch.testing.assert_close(h1 @ Ac[0] + h2 @ Ac[1] + h3 @ Ac[2] + cc, codes, rtol=1e-4,
                               atol=1e-4 * codes.abs().max())


def test_fold_equals_unfolded_real_taps(backbone, traces):
    enc = fit_encoder(backbone, traces, hidden_dim=16, delta_dim=4, max_positions=400)
    _, (h1, h2, h3), _, _ = next(replay(backbone, traces[1], steps=[2]))
    weight, bias = torch.randn(12, enc.code_dim), torch.randn(12)
    ref = enc.codes(h1, h2, h3) @ weight.T + bias
    A, c = fold(enc, weight, bias)
    torch.testing.assert_close(h1 @ A[0] + h2 @ A[1] + h3 @ A[2] + c, ref, rtol=1e-4, atol=1e-4 * ref.abs().max())
    with pytest.raises(ValueError, match="weight must be"):
        fold(enc, weight[:, :-1], bias)


def test_pca_standardisation_and_variance_order():
    gen = torch.Generator().manual_seed(1)
    D = 16
    samples = torch.randn(2000, D, generator=gen) @ torch.randn(D, D, generator=gen) * 5 + 40
    enc = LinearEncoder.fit_pca(samples, 6)
    torch.testing.assert_close(enc.mean.double(), samples.double().mean(0), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(enc.std.double(), samples.double().std(0), rtol=1e-5, atol=1e-4)
    assert enc(samples.mean(0)).abs().max() < 1e-4
    var = enc(samples).var(0)
    assert torch.all(var[:-1] >= var[1:]) and var[0] > var[-1] * 1.5
    # orthonormal axes: the codes are decorrelated
    torch.testing.assert_close(enc.proj.T @ enc.proj, torch.eye(6), atol=1e-5, rtol=0)
    cov = torch.cov(enc(samples).T)
    assert (cov - torch.diag(cov.diag())).abs().max() < 1e-3 * var[0]


def test_codes_layout_and_groups():
    enc = _linear_encoder(20, 8, 3)
    g = enc.groups
    assert g == {"h1": (0, 8), "h2": (8, 16), "h3": (16, 24), "d21": (24, 27), "d32": (27, 30)}
    assert enc.code_dim == 30 and set(FEATURE_SETS["all"]) == set(g)
    h1, h2, h3 = torch.randn(3, 4, 20).unbind(0)
    codes = enc.codes(h1, h2, h3)
    torch.testing.assert_close(codes[:, slice(*g["h2"])], enc.hidden(h2))
    torch.testing.assert_close(codes[:, slice(*g["d32"])], enc.delta(h3 - h2))


def test_fit_encoder_widths(backbone, traces):
    D = backbone.spec.hidden_size
    enc = fit_encoder(backbone, traces, max_positions=300)
    assert (enc.hidden.width, enc.delta.width) == (min(256, D), min(32, D))
    assert enc.fit["positions"] == 300 and enc.backbone == backbone_fingerprint(backbone)
    with pytest.raises(ValueError, match="hidden_dim=.*hidden size"):
        fit_encoder(backbone, traces, hidden_dim=D + 1, max_positions=100)


def test_sample_taps_uniform_without_replacement(backbone, traces):
    taps = sample_taps(backbone, traces, 50, seed=3)
    assert taps.shape == (50, 3, backbone.spec.hidden_size)
    assert len(torch.unique(taps[:, 2], dim=0)) == 50
    torch.testing.assert_close(sample_taps(backbone, traces, 50, seed=3), taps)
    total = sum(len(t.steps) * (len(t.prompt) + 16) for t in traces)
    assert len(sample_taps(backbone, traces, 10**6)) == total


def test_save_load_round_trip_and_fingerprint(tmp_path):
    enc = _linear_encoder(20, 8, 3)
    enc.save(tmp_path / "enc")
    back = load_encoder(tmp_path / "enc")
    assert back.digest() == enc.digest() and back.groups == enc.groups
    h = torch.randn(3, 5, 20)
    torch.testing.assert_close(back.codes(*h), enc.codes(*h))
    spec = tracelock.ModelSpec(family="dream", mask_id=0, eos_id=1, pad_id=1, eot_id=None, bos_id=None,
                               logit_shift=1, vocab_size=512, hidden_size=20, num_layers=4, num_heads=4,
                               num_kv_heads=4, head_dim=5, intermediate_size=8, max_positions=64, rope_theta=1e4,
                               rms_norm_eps=1e-6, qkv_bias=True, rope_fp32=False)
    with pytest.raises(ValueError, match="was fit on backbone"):
        load_encoder(tmp_path / "enc", spec)
    with pytest.raises(FileNotFoundError, match="holds no encoder"):
        load_encoder(tmp_path / "missing")


def test_autoencoder_trains_and_matches_layout(tmp_path):
    gen = torch.Generator().manual_seed(0)
    D = 24
    latent = torch.randn(1000, 4, generator=gen)
    samples = torch.tanh(latent @ torch.randn(4, D, generator=gen)) * 3 + 1
    before = train_autoencoder(samples, 4, steps=0).reconstruction_error(samples)
    ae = train_autoencoder(samples, 4, steps=150, lr=3e-3)
    assert ae.reconstruction_error(samples) < 0.5 * before
    fp = dict(family="llada", hidden_size=D, num_layers=4, vocab_size=512)
    enc = TapEncoder(ae, train_autoencoder(samples, 2, steps=5), fp)
    lin = TapEncoder(LinearEncoder.fit_pca(samples, 4), LinearEncoder.fit_pca(samples, 2), fp)
    assert enc.kind == "ae" and enc.groups == lin.groups and enc.code_dim == lin.code_dim
    h = torch.randn(3, 2, 6, D)
    assert enc.codes(*h).shape == (2, 6, enc.code_dim)
    with pytest.raises(ValueError, match="cannot be folded"):
        fold(enc, torch.zeros(3, enc.code_dim), torch.zeros(3))
    enc.save(tmp_path)
    back = load_encoder(tmp_path)
    assert isinstance(back.hidden, AutoEncoder) and back.digest() == enc.digest()
    torch.testing.assert_close(back.codes(*h), enc.codes(*h))
    with pytest.raises(TypeError, match="both be LinearEncoder or both AutoEncoder"):
        TapEncoder(ae, LinearEncoder.fit_pca(samples, 2), fp)


def test_fit_encoder_ae(backbone, traces):
    enc = fit_encoder(backbone, traces, hidden_dim=8, delta_dim=4, kind="ae", max_positions=200, ae_steps=20)
    assert enc.kind == "ae" and enc.code_dim == 32
