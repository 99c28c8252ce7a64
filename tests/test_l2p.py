"""Learn2PD: the filter's shapes, files and thresholds, the decision (accepts plus the scheduled top-k), end-of-text
truncation on hand-made steps and against an independent upstream-style loop, chunked deployment at a larger block,
training examples from the trace store, the trainer, `tracelock train-l2p`, and L2P-Hidden."""

import json

import pytest
import torch

import tracelock
from tracelock import states
from tracelock.decode.canvas import truncate_after
from tracelock.features import LinearEncoder, TapEncoder, backbone_fingerprint
from tracelock.l2p import L2PFilter, load_filter, load_filters
from tracelock.l2p.data import block_examples
from tracelock.l2p.filter import FilterConfig
from tracelock.l2p.train import fit_filter, split_by_group
from tracelock.models import write_tiny_checkpoint
from tracelock.policies import make_policy
from tracelock.policies.base import Lookahead, StepInput
from tracelock.policies.l2p import L2PHiddenPolicy, L2PPolicy
from tracelock.recording.recorder import record
from tracelock.signals import Signals
from tracelock.testing import random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
G, BLOCK = 16, 4
EOS = 7


def _eos_prone(family, tmp_path_factory, seed=4):
    """A tiny model with a peaked head whose end token shadows its most proposed token: it proposes the end
    token at several positions, confidently, so end-of-text prediction has work to do."""
    m = tracelock.load_model(write_tiny_checkpoint(tmp_path_factory.mktemp(family), family=family, seed=seed))
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
        x, _ = tracelock.reference_generate(m, random_prompts(m), policy="confidence", gen_length=G, block=BLOCK)
        values, counts = x[:, -G:].flatten().unique(return_counts=True)
        m.lm_head.weight[m.spec.eos_id] = m.lm_head.weight[values[counts.argmax()]] * 1.02
    return m


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return _eos_prone("llada", tmp_path_factory)


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    return _eos_prone("dream", tmp_path_factory)


@torch.no_grad()
def ramp_filter(block=BLOCK, family="llada", eos_id=EOS, cut=0.3):
    """logit_i = relu(50 (c_i - cut)) - 3: accepts (sigmoid > 0.96) exactly where c_i > cut + 0.1236."""
    f = L2PFilter(FilterConfig(block=block, hidden=block, family=family, eos_id=eos_id))
    first, second = f.net[0], f.net[2]
    first.weight.copy_(50 * torch.eye(block))
    first.bias.fill_(-50 * cut)
    second.weight.copy_(torch.eye(block))
    second.bias.fill_(-3.0)
    return f


@torch.no_grad()
def constant_filter(logit, block=BLOCK, family="llada"):
    f = L2PFilter(FilterConfig(block=block, hidden=2, family=family, eos_id=EOS))
    for p in f.parameters():
        p.zero_()
    f.net[2].bias.fill_(logit)
    return f


def _step(conf, active, proposal=None, region_initial=4, step=0, lookahead=None, L=20, lo=10):
    conf = torch.tensor(conf, dtype=torch.float32)
    B, R = conf.shape
    proposal = torch.zeros(B, R, dtype=torch.long) if proposal is None else torch.tensor(proposal)
    signals = Signals(proposal, conf, conf, conf, conf)
    positions = (lo + torch.arange(R)).expand(B, R)
    state = torch.full((B, L), states.ACTIVE, dtype=torch.uint8)
    vec = torch.full((B,), 0, dtype=torch.long)
    return StepInput(signals=signals, active=torch.tensor(active), region_step=vec + step,
                     region_initial=vec + region_initial, region_active=vec + region_initial, steps_per_region=4,
                     positions=positions, state=state, rows=torch.arange(B), lookahead=lookahead)


def _policy(filt, **kw):
    policy = L2PPolicy(filt, **kw)
    policy.setup(gen_length=G, num_regions=G // filt.config.block)
    return policy


def test_filter_shapes_size_and_errors():
    f = L2PFilter(FilterConfig(block=32, hidden=32))
    assert sum(p.numel() for p in f.parameters()) == 2112  # upstream's "about 2K parameters" at block 32
    assert f(torch.rand(5, 32)).shape == (5, 32)
    hidden = L2PFilter(FilterConfig(block=16, hidden=8, features=3))
    assert hidden(torch.rand(5, 16, 3)).shape == (5, 16) and hidden.config.kind == "hidden"
    with pytest.raises(ValueError, match=r"reads \[N, 16, 3\] inputs"):
        hidden(torch.rand(5, 16))
    with pytest.raises(ValueError, match="FilterConfig.hidden=0"):
        L2PFilter(FilterConfig(block=4, hidden=0))


def test_files_round_trip(tmp_path):
    a, b = ramp_filter(4), ramp_filter(8)
    a.save(tmp_path), b.save(tmp_path)
    L2PFilter(FilterConfig(block=4, hidden=3, features=5)).save(tmp_path)
    found = load_filters(tmp_path)
    assert sorted(found) == [4, 8] and sorted(load_filters(tmp_path, "hidden")) == [4]
    x = torch.rand(3, 4)
    assert torch.equal(found[4](x), a(x)) and found[4].config == a.config
    assert load_filter(tmp_path / "block-8.json").config.eos_id == EOS
    with pytest.raises(FileNotFoundError, match="train-l2p"):
        load_filters(tmp_path / "missing")
    (tmp_path / "block-4.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_filter(tmp_path / "block-4.json")


def test_thresholds_by_family_and_strict():
    assert L2PPolicy(ramp_filter()).threshold == 0.96
    assert L2PPolicy(ramp_filter(family="dream")).threshold == 0.9
    logit96 = torch.logit(torch.tensor(0.96)).item()
    conf, active = [[0.1, 0.2, 0.3, 0.4]], [[True, True, True, False]]
    above = _policy(constant_filter(logit96 + 1e-3)).accepts(_step(conf, active))
    below = _policy(constant_filter(logit96 - 1e-3)).accepts(_step(conf, active))
    assert above.tolist() == [[True, True, True, False]] and not below.any()
    assert _policy(constant_filter(0.0), threshold=0.4).accepts(_step(conf, active)).all(1).tolist() == [False]
    with pytest.raises(ValueError, match="threshold=1.5"):
        L2PPolicy(ramp_filter(), threshold=1.5)


def test_decision_is_accepts_plus_scheduled_topk():
    policy = _policy(ramp_filter(), eotp=False)
    # ramp accepts c > 0.4236 at active slots; the schedule (4 active, 4 steps) adds the most confident one
    inp = _step([[0.9, 0.2, 0.5, 0.1], [0.1, 0.2, 0.3, 0.35]], [[False, True, True, True], [True] * 4])
    chosen, cut = policy.decide(inp)
    assert cut is None
    assert chosen.tolist() == [[False, False, True, False], [False, False, False, True]]
    # two steps budget: k = 2 per step
    policy = L2PPolicy(ramp_filter(), steps=8, eotp=False)
    policy.setup(gen_length=G, num_regions=G // BLOCK)
    assert policy.select(inp).sum(1).tolist() == [2, 2]


def test_end_of_text_prediction_rules():
    policy = _policy(ramp_filter())
    conf = [[0.9, 0.95, 0.5, 0.97]]
    # the filter accepts the end token at slots 1 and 3: the first one (canvas position 11) is the cut
    inp = _step(conf, [[False, True, True, True]], proposal=[[EOS, EOS, 3, EOS]])
    assert policy.decide(inp)[1].tolist() == [11]
    # no accepted end token: the most confident masked end-token proposal, the lookahead's included
    tail = Lookahead(Signals(torch.tensor([[EOS, EOS, 5]]), *[torch.tensor([[0.35, 0.35, 0.99]])] * 4),
                     torch.tensor([[True, True, True]]), torch.tensor([[14, 15, 16]]))
    inp = _step([[0.9, 0.3, 0.2, 0.1]], [[True] * 4], proposal=[[3, 3, EOS, 3]], lookahead=tail)
    assert policy.decide(inp)[1].tolist() == [14]  # 0.35 beats slot 2's 0.2; ties go left (14 before 15)
    # neither: no cut (L), and eotp=False never cuts
    inp = _step(conf, [[True] * 4], proposal=[[1, 2, 3, 4]])
    assert policy.decide(inp)[1].tolist() == [20]
    assert _policy(ramp_filter(), eotp=False).decide(inp)[1] is None


def test_truncate_after():
    x = torch.arange(12).reshape(2, 6)
    state = torch.tensor([[0, 0, 2, 1, 2, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.uint8)
    mask = torch.ones(2, 6, dtype=torch.bool)
    first = truncate_after(x, state, mask, torch.tensor([3, 6]), fill_id=99)
    assert x.tolist() == [[0, 1, 2, 3, 99, 99], list(range(6, 12))]
    assert state[0].tolist() == [0, 0, 2, 1, 3, 3] and mask[0].tolist() == [True] * 4 + [False] * 2
    assert mask[1].all() and first.tolist() == [3, 2]


@torch.no_grad()
def upstream_l2p(model, prompt, filt, threshold, gen_length, block):
    """Learn2PD's ``generate_l2p_eot`` at batch size 1, written from its rule: a real shorter canvas after
    each truncation. Two choices where upstream is undefined: a truncated block feeds zeros to the filter, and the
    scheduled k never exceeds the block's masked positions."""
    mask_id, eos = model.spec.mask_id, model.spec.eos_id
    x = torch.cat([torch.tensor(prompt), torch.full((gen_length,), mask_id)])
    P, steps = len(prompt), 0
    for b in range(gen_length // block):
        lo, hi = P + b * block, P + (b + 1) * block
        m = int((x[lo:hi] == mask_id).sum())
        schedule = [m // block + (i < m % block) for i in range(block)]
        i = 0
        while bool((x[lo:hi] == mask_id).any()):
            logits = model.forward(x[None]).logits[0].float()
            p = logits.softmax(-1)
            x0 = logits.argmax(-1)
            x0_p = p.gather(1, x0[:, None])[:, 0]
            masked = x == mask_id
            inputs = torch.zeros(block)
            inputs[:len(x0_p[lo:hi])] = x0_p[lo:hi]
            accept = torch.zeros_like(masked)
            width = len(x[lo:hi])
            accept[lo:hi] = (torch.sigmoid(filt(inputs[None])[0]) > threshold)[:width]
            accept &= masked
            accepted_end = (x0 == eos) & accept
            end_conf = torch.where((x0 == eos) & masked, x0_p, -torch.inf)
            conf = torch.where(masked, x0_p, -torch.inf)
            conf[hi:] = -torch.inf
            k = min(schedule[i], int(torch.isfinite(conf).sum()))
            transfer = accept.clone()
            transfer[conf.topk(k).indices] = True
            x = torch.where(transfer, x0, x)
            if accepted_end.any():
                x = x[:int(accepted_end.int().argmax()) + 1]
            elif torch.isfinite(end_conf).any():
                x = x[:int(end_conf.argmax()) + 1]
            i += 1
            steps += 1
    return x, steps


def test_matches_independent_upstream_loop(llada):
    """Tokens and steps of every prompt alone, and at least one truncation exercised."""
    filt = ramp_filter(eos_id=llada.spec.eos_id, cut=0.2)
    prompts = random_prompts(llada, lengths=(9, 5, 12, 7, 3), seed=11)
    cuts = 0
    for prompt in prompts:
        want, want_steps = upstream_l2p(llada, prompt, filt, 0.96, G, BLOCK)
        got, stats = tracelock.reference_generate(llada, [prompt], policy=L2PPolicy(filt), gen_length=G, block=BLOCK)
        got = got[0]
        assert torch.equal(got[:len(want)], want), (prompt, got, want)
        assert (got[len(want):] == llada.spec.pad_id).all() and stats.steps == [want_steps]
        cuts += len(want) < len(prompt) + G
    assert cuts >= 2


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
def test_fused_equals_reference(family, cache, request):
    model = request.getfixturevalue(family)
    filt = ramp_filter(family=family, eos_id=model.spec.eos_id, cut=0.2)
    prompts = random_prompts(model, lengths=(9, 5, 12, 7), seed=11)
    args = dict(policy=L2PPolicy(filt), gen_length=G, block=BLOCK, cache=cache)
    ref, ref_stats = tracelock.reference_generate(model, prompts, **args)
    got, got_stats = tracelock.fused_generate(model, prompts, **args)
    assert torch.equal(ref, got) and ref_stats.steps == got_stats.steps
    assert min(ref_stats.gen_lengths) < G  # some row was cut short
    if cache is None:  # rows decode alone as in the batch
        for row, prompt in enumerate(prompts):
            alone, stats = tracelock.reference_generate(model, [prompt], **args)
            assert torch.equal(alone[0, -G:], ref[row, -G:]) and stats.steps == [ref_stats.steps[row]]


def test_chunked_deployment_at_a_larger_block(llada):
    filt = ramp_filter(eos_id=llada.spec.eos_id)
    inp = _step([[0.9, 0.2, 0.5, 0.1, 0.6, 0.2, 0.1, 0.8]], [[True] * 8])
    with pytest.raises(ValueError, match="no Learn2PD filter for a 8-wide region .* pass filter_block=N"):
        _policy(filt).filter_logits(inp)
    wide = L2PPolicy(filt, filter_block=4)
    wide.setup(gen_length=G, num_regions=G // 8)
    logits = wide.filter_logits(inp)
    assert torch.equal(logits, filt(inp.signals.confidence.reshape(2, 4)).reshape(1, 8))
    with pytest.raises(ValueError, match="no Learn2PD filter for a 6-wide region"):
        wide.filter_logits(_step([[0.5] * 6], [[True] * 6]))
    with pytest.raises(ValueError, match="filter_block=8 has no filter"):
        L2PPolicy(filt, filter_block=8)
    prompts = random_prompts(llada)
    args = dict(policy=wide, gen_length=G, block=8)
    ref, ref_stats = tracelock.reference_generate(llada, prompts, **args)
    got, got_stats = tracelock.fused_generate(llada, prompts, **args)
    assert torch.equal(ref, got) and ref_stats.steps == got_stats.steps and max(got_stats.steps) <= G


def test_training_examples_from_traces(llada):
    prompts = random_prompts(llada)
    traces = record(llada, prompts, policy="confidence", gen_length=G, block=BLOCK, keep_confidence=True,
                    metas=[dict(id=str(i)) for i in range(3)])
    x, y, groups = block_examples(llada, traces, BLOCK)
    n = sum(len(t.steps) for t in traces)
    assert x.shape == (n, BLOCK) and y.shape == (n, BLOCK) and groups.tolist() == sum(
        ([i] * len(t.steps) for i, t in enumerate(traces)), [])
    # the first step's block is block 0; its active positions' stored confidences match the replayed inputs
    first = traces[0]
    stored = torch.from_numpy(first.confidence[0, :BLOCK].astype("float32"))
    assert torch.allclose(x[0], stored, atol=1e-3)
    labels = torch.from_numpy((first.proposals[0, :BLOCK] == first.final[:BLOCK]).astype("float32"))
    assert torch.equal(y[0], labels)
    # the last step's block is the last one, with the committed positions' labels (mostly 1) included
    last = len(first.steps) - 1
    assert y[last].shape == (BLOCK,)
    with pytest.raises(ValueError, match="collect them with `tracelock collect --block 8`"):
        block_examples(llada, traces, 8)
    encoder = TapEncoder(*(LinearEncoder.fit_pca(torch.randn(64, llada.spec.hidden_size), w) for w in (3, 2)),
                         backbone_fingerprint(llada))
    codes, _, _ = block_examples(llada, traces[:1], BLOCK, encoder=encoder)
    assert codes.shape == (len(first.steps), BLOCK, encoder.code_dim)


def test_fit_learns_a_separable_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(400, BLOCK, generator=g)
    y = (x > 0.5).float()
    groups = torch.arange(400) // 10
    train, val = split_by_group(groups, 0.25, seed=0)
    assert len(val) == 100 and not set(groups[train].tolist()) & set(groups[val].tolist())
    filt = fit_filter(x, y, groups, family="dream", eos_id=EOS, backbone={}, hidden=16, epochs=1000, lr=3e-2,
                      val_fraction=0.25)
    assert filt.config.train["val_metrics"]["accuracy"] > 0.95 and filt.config.family == "dream"
    assert not any(p.requires_grad for p in filt.parameters())
    with pytest.raises(ValueError, match="epochs=0"):
        fit_filter(x, y, groups, family="llada", eos_id=EOS, backbone={}, epochs=0)


def test_training_inside_no_grad_trains_the_same_weights():
    """A caller's torch.no_grad() (a notebook cell, an inference wrapper) does not stop the training functions."""
    from tracelock.features import train_autoencoder

    g = torch.Generator().manual_seed(1)
    x = torch.rand(80, BLOCK, generator=g)
    y, groups = (x > 0.5).float(), torch.arange(80) // 4
    fit = dict(family="dream", eos_id=EOS, backbone={}, hidden=8, epochs=20, val_fraction=0.25)
    torch.manual_seed(0)
    want = fit_filter(x, y, groups, **fit).state_dict()
    torch.manual_seed(0)
    want_ae = train_autoencoder(x, 2, steps=10).state_dict()
    with torch.no_grad():
        torch.manual_seed(0)
        got = fit_filter(x, y, groups, **fit).state_dict()
        torch.manual_seed(0)
        got_ae = train_autoencoder(x, 2, steps=10).state_dict()
        assert not torch.is_grad_enabled()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    for key in want_ae:
        torch.testing.assert_close(got_ae[key], want_ae[key], rtol=0, atol=0)


def test_train_l2p_cli_and_policies(tmp_path, capsys):
    from tracelock.cli import main
    from tracelock.features import fit_encoder
    from tracelock.traces.store import TraceWriter

    model_dir = write_tiny_checkpoint(tmp_path / "m", family="llada", seed=3)
    model = tracelock.load_model(model_dir)
    prompts = random_prompts(model)
    traces = record(model, prompts, policy="confidence", gen_length=G, block=BLOCK,
                    metas=[dict(id=str(i)) for i in range(3)])
    with TraceWriter(tmp_path / "traces") as writer:
        for t in traces:
            writer.add(t)
    common = ["--traces", str(tmp_path / "traces"), "--model", str(model_dir), "--block", str(BLOCK), "--out",
              str(tmp_path / "l2p"), "--epochs", "50"]
    assert main(["train-l2p", *common]) in (0, None)
    cfg = json.loads((tmp_path / "l2p" / "block-4.json").read_text())
    assert cfg["family"] == "llada" and cfg["eos_id"] == model.spec.eos_id and cfg["train"]["epochs"] == 50
    encoder = fit_encoder(model, traces, 4, 2, max_positions=256)
    encoder.save(tmp_path / "enc")
    assert main(["train-l2p", *common, "--input", "hidden", "--encoder", str(tmp_path / "enc")]) in (0, None)
    assert (tmp_path / "l2p" / "hidden-block-4.json").is_file() and (tmp_path / "l2p" / "encoder.json").is_file()
    for name in ("l2p", "l2p-hidden"):
        policy = make_policy(name, filters=tmp_path / "l2p", model=model)
        ref, ref_stats = tracelock.reference_generate(model, prompts, policy=policy, gen_length=G, block=BLOCK)
        got, got_stats = tracelock.fused_generate(model, prompts, policy=policy, gen_length=G, block=BLOCK,
                                                  cache="prefix" if name == "l2p" else None)
        if name == "l2p-hidden":
            assert torch.equal(ref, got) and ref_stats.steps == got_stats.steps
    assert isinstance(policy, L2PHiddenPolicy)
    assert main(["train-l2p", *common, "--input", "hidden"]) not in (0, None)
    assert "--input hidden (L2P-Hidden) needs --encoder FOLDER" in capsys.readouterr().err
    dream = tracelock.load_model(write_tiny_checkpoint(tmp_path / "dream", family="dream", seed=3))
    with pytest.raises(ValueError, match="trained on backbone"):
        L2PPolicy(tmp_path / "l2p", model=dream)
