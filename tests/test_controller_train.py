"""Controller training: the loss by hand, crops and batches, metrics by hand, a learnable run, resume, DDP."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import tracelock
from tracelock import states
from tracelock.train import metrics
from tracelock.train.fit import TrainConfig, batch_items, collate, controller_loss, crop_lengths, train

GROUPS = {"h1": [0, 4], "h2": [4, 8], "h3": [8, 12], "d21": [12, 14], "d32": [14, 16]}
TINY = dict(width=32, layers=1, heads=2, ffn=48)


pytestmark = pytest.mark.usefixtures("one_thread")


class SyntheticCache:
    """The feature cache's item API over in-memory items whose label is a function of the codes (learnable)."""

    groups, code_dim = GROUPS, 16

    def __init__(self, traces=40, steps=3, seed=0):
        rng = np.random.default_rng(seed)
        self.items = []
        for t in range(traces):
            P, G = int(rng.integers(3, 7)), int(rng.integers(8, 17))
            for s in range(steps):
                codes = rng.normal(size=(P + G, 16)).astype(np.float32)
                state = np.full(P + G, states.PROMPT, np.uint8)
                state[P:] = np.where(rng.random(G) < 0.3, states.LOCKED, states.ACTIVE)
                label = np.where(codes[:, 9] + 0.5 * codes[:, 13] > 0, 1, 0).astype(np.int8)
                label[state != states.ACTIVE] = -1
                self.items.append(dict(codes=codes, state=state, label=label, eot=rng.random(P + G) < 0.1,
                                       confidence=rng.random(P + G).astype(np.float32), prompt_len=P,
                                       trace_id=f"t{t}", step=s))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def split(self, fraction, seed):
        ids = sorted({it["trace_id"] for it in self.items})
        val = set(np.random.default_rng(seed).permutation(ids)[:max(1, round(fraction * len(ids)))])
        is_val = np.array([it["trace_id"] in val for it in self.items])
        return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def test_loss_by_hand():
    a = torch.tensor([[2.0, -1.0, 0.0, 3.0, 1.0]])
    tau = torch.tensor([0.5])
    state = torch.tensor([[states.PROMPT, states.ACTIVE, states.ACTIVE, states.ACTIVE, states.ACTIVE]])
    label = torch.tensor([[1, 1, 0, -1, 1]])
    eot = torch.tensor([[False, False, True, False, False]])
    key_mask = torch.tensor([[True, True, True, True, False]])
    loss = controller_loss(a, tau, label, state, key_mask, eot, k=4.0, lambda_tau=0.1, eot_weight=2.0)
    # Omega = {1, 2}: slot 1 m = -1.5, y = 1, wrong decision (w = 4); slot 2 m = -0.5, y = 0, right (w = 1, eot x2);
    # slot 0 is prompt, slot 3 unlabelled, slot 4 beyond the crop
    want = (4 * math.log1p(math.exp(1.5)) + 2 * math.log1p(math.exp(-0.5))) / 2 + 0.1 * 0.25
    assert loss.item() == pytest.approx(want, rel=1e-6)
    # an empty Omega leaves only the tau term
    empty = controller_loss(a, tau, label, state, torch.zeros_like(key_mask), lambda_tau=0.1)
    assert empty.item() == pytest.approx(0.025, rel=1e-6)


def test_crop_lengths_and_collate():
    assert crop_lengths([8, 8, 3, 1], [0.25, 1.0, 0.25, 0.3]).tolist() == [2, 8, 1, 1]
    cache = SyntheticCache(traces=2, steps=1)
    items = [cache[0], cache[1]]
    batch = collate(items, np.array([0.5, 1.0]))
    L = max(len(it["state"]) for it in items)
    assert batch["codes"].shape == (2, L, 16) and batch["key_mask"].dtype == torch.bool
    for b, (it, r) in enumerate(zip(items, [0.5, 1.0])):
        P, n = it["prompt_len"], len(it["state"])
        end = P + crop_lengths([n - P], [r])[0]
        assert batch["key_mask"][b].tolist() == [i < end for i in range(L)]
        assert (batch["label"][b, n:] == -1).all()
        # confidence only at active positions
        conf = batch["confidence"][b, :n].numpy()
        active = it["state"] == states.ACTIVE
        assert np.array_equal(conf[~active], np.zeros((~active).sum())) and np.allclose(conf[active],
                                                                                       it["confidence"][active])


def test_batches_are_a_pure_function_of_seed_and_step():
    train_idx = np.arange(10, 30)
    first = [batch_items(train_idx, s, 8, seed=5) for s in range(5)]
    again = [batch_items(train_idx, s, 8, seed=5) for s in range(5)]
    for (i1, r1), (i2, r2) in zip(first, again):
        assert np.array_equal(i1, i2) and np.array_equal(r1, r2)
        assert ((r1 >= 0.25) & (r1 < 1.0)).all()
    # 40 draws = two epochs of 20: each item exactly twice
    counts = np.bincount(np.concatenate([i for i, _ in first]))
    assert counts[10:30].tolist() == [2] * 20
    assert not np.array_equal(batch_items(train_idx, 0, 8, seed=6)[0], first[0][0])


def test_metrics_by_hand_with_ties():
    scores = np.array([2.0, 1.0, 1.0, -0.5, -2.0])
    labels = np.array([1, 0, 1, 0, 1])
    # pairs (pos, neg): (2,1) 1, (2,-.5) 1, (1,1) tie 1/2, (1,-.5) 1, (-2,1) 0, (-2,-.5) 0
    assert metrics.auroc(scores, labels) == pytest.approx(3.5 / 6)
    # thresholds 2: P 1 R 1/3; 1 (tie, both enter): P 2/3 R 2/3; -0.5: R unchanged; -2: P 3/5 R 1
    assert metrics.average_precision(scores, labels) == pytest.approx(1 / 3 + 1 / 3 * 2 / 3 + 1 / 3 * 3 / 5)
    assert metrics.accuracy_at(scores, labels) == pytest.approx(3 / 5)
    # commit m > 1.5: TP 1 of 1 committed, 1 of 3 stable: F0.5 = 1.25 * (1/3) / (0.25 + 1/3)
    assert metrics.f_beta(scores, labels, threshold=1.5) == pytest.approx(5 / 7)
    assert metrics.f_beta(scores, labels, beta=1.0) == pytest.approx(2 / 3)
    assert metrics.f_beta(scores, labels, threshold=5.0) == 0.0
    assert math.isnan(metrics.auroc(scores, np.ones(5, int)))
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        metrics.auroc(scores, np.array([1, 0, -1, 0, 1]))


def test_auroc_and_ap_match_brute_force():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 6, 200).astype(float)  # many ties
    labels = (rng.random(200) < 0.4).astype(int)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean()
    assert metrics.auroc(scores, labels) == pytest.approx(pairs)
    ap, prev_recall = 0.0, 0.0
    for t in sorted(set(scores), reverse=True):
        pred = scores >= t
        recall = (pred & (labels == 1)).sum() / labels.sum()
        ap += (recall - prev_recall) * (pred & (labels == 1)).sum() / pred.sum()
        prev_recall = recall
    assert metrics.average_precision(scores, labels) == pytest.approx(ap)


def _config(tmp_path, name, **kw):
    return TrainConfig(cache="(in memory)", out=str(tmp_path / name), **{**dict(
        steps=6, batch_size=8, eval_every=3, lr=1e-3, device="cpu", **TINY), **kw})


def test_training_learns_selects_best_and_writes_metrics(tmp_path):
    cache = SyntheticCache()
    out = train(_config(tmp_path, "run", steps=60, batch_size=16, eval_every=20, lr=3e-3, dropout=0.0), cache=cache)
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [20, 40, 60]
    best = max(history, key=lambda h: h["val_f0_5"])
    result = json.loads((out / "metrics.json").read_text())
    assert result["best_step"] == best["step"]
    for crop in ("fixed_crop", "full"):
        assert result[crop]["auroc"] > 0.9 and result[crop]["f0_5"] > 0.8, result
    assert result["full"]["positions"] > result["fixed_crop"]["positions"]
    # the validation crop is fixed: the best checkpoint's F0.5 on it is the one recorded at selection
    assert result["fixed_crop"]["f0_5"] == pytest.approx(best["val_f0_5"])
    cfg = json.loads((out / "best.json").read_text())
    assert cfg["kind"] == "tracelock-controller" and cfg["width"] == 32


def test_resume_repeats_the_uninterrupted_run(tmp_path):
    cache = SyntheticCache(traces=12, steps=2)
    straight = train(_config(tmp_path, "a"), cache=cache)
    train(_config(tmp_path, "b", steps=3), cache=cache)
    resumed = train(_config(tmp_path, "b"), cache=cache, resume=True)
    a, b = (load_file(str(run / "state-00000006.safetensors")) for run in (straight, resumed))
    assert a.keys() == b.keys() and any(k.startswith("opt.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    with pytest.raises(ValueError, match="already holds a training run; pass --resume"):
        train(_config(tmp_path, "a"), cache=cache)
    with pytest.raises(ValueError, match=r"changed settings \['lr'\]"):
        train(_config(tmp_path, "a", lr=5e-4), cache=cache, resume=True)


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    """A feature cache of real traces: tiny LLaDA, recorded decodes, a fitted linear encoder, featurize."""
    from tracelock.features import fit_encoder
    from tracelock.traces.cache import featurize

    # the trace builder lives in test_features.py (--import-mode=importlib: no sibling imports)
    spec = importlib.util.spec_from_file_location("_features_tests", Path(__file__).with_name("test_features.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    root = tmp_path_factory.mktemp("real")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tracelock.load_model(tracelock.write_tiny_checkpoint(root / "llada", family="llada", seed=3))
    traces = []
    for i in range(3):
        traces += helpers.record_traces(model, helpers.make_prompts(2, 5 + i, seed=i), gen_length=16, block=8,
                                        id_prefix=f"p{i}")
    encoder = fit_encoder(model, traces, hidden_dim=8, delta_dim=4, max_positions=400)
    encoder.save(root / "encoder")
    featurize(model, encoder, traces, root / "cache")
    torch.set_num_threads(threads)
    return model, root


def _cli(cache, out, *extra):
    return ["--cache", cache, "--out", out, "--steps", "4", "--batch-size", "8", "--eval-every", "2", "--lr", "1e-3",
            "--dropout", "0", "--width", "32", "--layers", "1", "--heads", "2", "--ffn", "48", "--device", "cpu",
            *extra]


def test_end_to_end_cli_train_then_decode(real_cache, tmp_path, capsys):
    from tracelock.cli import main
    from tracelock.policies.tracelock import TraceLockPolicy

    model, root = real_cache
    assert main(["train", *_cli(str(root / "cache"), str(tmp_path / "run"), "--encoder", str(root / "encoder"),
                                "--confidence-input")]) == 0
    result = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert result["full"]["positions"] > 0 and 0 <= result["full"]["auroc"] <= 1
    config = json.loads((tmp_path / "run" / "best.json").read_text())
    assert config["fingerprint"]["backbone"]["family"] == "llada" and config["confidence_input"]
    policy = TraceLockPolicy(tmp_path / "run", model=model, reference_release=True)
    prompts = [[5, 9, 13, 2, 7], [11, 4, 8]]
    ref_tokens, ref_stats = tracelock.reference_generate(model, prompts, policy=policy, gen_length=16, window=8)
    tokens, stats = tracelock.fused_generate(model, prompts, policy=policy, gen_length=16, window=8)
    assert torch.equal(tokens, ref_tokens) and stats.steps == ref_stats.steps
    assert all(1 <= n <= 4 for row in stats.commits_per_step for n in row)
    # the wrong encoder for this cache is refused before training
    other = tmp_path / "other"
    from tracelock.features import load_encoder

    enc = load_encoder(root / "encoder")
    enc.hidden.mean += 1.0
    enc.save(other)
    assert main(["train", *_cli(str(root / "cache"), str(tmp_path / "run2"), "--encoder", str(other))]) == 2
    assert "is not the encoder that wrote the cache" in capsys.readouterr().err


def test_the_testbed_preset_trains_its_recipe_and_explicit_options_win(real_cache, tmp_path):
    from tracelock.cli import main
    from tracelock.train.cli import PRESETS

    _, root = real_cache
    assert main(["train", "--cache", str(root / "cache"), "--out", str(tmp_path / "run"), "--preset", "testbed",
                 "--steps", "2", "--eval-every", "1", "--device", "cpu"]) == 0
    config = json.loads((tmp_path / "run" / "best.json").read_text())
    preset = PRESETS["testbed"]
    assert (config["width"], config["layers"], config["heads"], config["ffn"]) == (64, 2, 4, 128)
    assert config["confidence_input"] and preset["confidence_input"]
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["config"]["steps"] == 2 != preset["steps"]  # --steps beats the preset
    assert state["config"]["batch_size"] == preset["batch_size"]
    # the preset's commit rule, with the fallback of the codes' backbone family (LLaDA: max-prob)
    assert config["commit_rule"] == {"hold_end": True, "fallback": "confidence"}


def test_the_commit_rule_is_fresh_paper_kept_by_a_warm_start_and_set_by_name(real_cache, tmp_path, capsys):
    from tracelock.cli import main
    from tracelock.policies.tracelock import TraceLockPolicy

    model, root = real_cache
    cache = str(root / "cache")
    assert main(["train", *_cli(cache, str(tmp_path / "paper"), "--encoder", str(root / "encoder"))]) == 0
    assert json.loads((tmp_path / "paper" / "best.json").read_text())["commit_rule"] == {}
    assert main(["train", *_cli(cache, str(tmp_path / "held"), "--encoder", str(root / "encoder"),
                                "--commit-rule", "hold-end", "--confidence-input")]) == 0
    assert main(["train", *_cli(cache, str(tmp_path / "warm"), "--encoder", str(root / "encoder"),
                                "--init", str(tmp_path / "held"))]) == 0
    assert json.loads((tmp_path / "warm" / "best.json").read_text())["commit_rule"]["hold_end"] is True
    # the policy deploys with the controller's rule unless told otherwise
    held, paper = TraceLockPolicy(tmp_path / "warm", model=model), TraceLockPolicy(tmp_path / "paper", model=model)
    assert (held.hold_end, held.fallback) == (True, "confidence")
    assert (paper.hold_end, paper.fallback) == (False, "score")
    told = TraceLockPolicy(tmp_path / "warm", model=model, hold_end=False, fallback="score")
    assert (told.hold_end, told.fallback) == (False, "score")
    with_release = TraceLockPolicy(tmp_path / "warm", model=model, reference_release=True)
    assert (with_release.hold_end, with_release.fallback) == (False, "score")  # the release's rule is the paper's
    prompts = [[5, 9, 13, 2, 7], [11, 4, 8]]
    ref_tokens, ref_stats = tracelock.reference_generate(model, prompts, policy=held, gen_length=16, window=8)
    tokens, stats = tracelock.fused_generate(model, prompts, policy=held, gen_length=16, window=8)
    assert torch.equal(tokens, ref_tokens) and stats.steps == ref_stats.steps
    with pytest.raises(ValueError, match="commit_rule='greedy' must be one of paper, hold-end"):
        TrainConfig(cache=cache, out=str(tmp_path / "bad"), commit_rule="greedy")


def test_ddp_two_ranks_match_one_process(real_cache, tmp_path):
    """`torchrun --nproc-per-node 2 -m tracelock train` (gloo): each rank half of the global batch gives the weights
    of one process on the whole batch (dropout 0; the difference is fp reassociation of the gradient all-reduce).

    NOTE: the attention key bias is excluded: softmax is invariant to it, so its true gradient is 0 and Adam
    turns the ~1e-10 rounding noise into lr-sized steps of random sign (6e-5 after 4 steps at lr 1e-3, measured).
    """
    from tracelock.cli import main

    _, root = real_cache
    cache = str(root / "cache")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           "29517", "-m", "tracelock", "train", *_cli(cache, str(tmp_path / "ddp"))],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["train", *_cli(cache, str(tmp_path / "single"))]) == 0
    one = load_file(str(tmp_path / "single" / "state-00000004.safetensors"))
    two = load_file(str(tmp_path / "ddp" / "state-00000004.safetensors"))
    w = TINY["width"]
    for key in one:
        if key.endswith("self_attn.in_proj_bias"):
            one[key], two[key] = (torch.cat([t[key][:w], t[key][2 * w:]]) for t in (one, two))
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6, msg=key)
    assert json.loads((tmp_path / "ddp" / "metrics.json").read_text())["best_step"] in (2, 4)


def test_cli_help_defaults_match_train_config():
    from tracelock.train.cli import DEFAULTS

    cfg = TrainConfig(cache="", out="")
    for name, kind, default in DEFAULTS:
        assert getattr(cfg, name.replace("-", "_")) == default and isinstance(default, kind), name


def _share_of_new(mix, new, indices) -> float:
    """Share of the given mix indices whose item is one of the self-training pool ``new``'s (the same object)."""
    from_new = {id(item) for item in new.items}
    return float(np.mean([id(mix[int(i)]) in from_new for i in indices]))


def test_self_training_mix_ratio_keeps_the_old_pool():
    from tracelock.train.mix import MixedCache, mixed_counts

    assert mixed_counts(10, 3, 0.5) == 10 and mixed_counts(10, 3, 0.25) == 3 and mixed_counts(4, 50, 0.9) == 36
    for bad in (0, 1, 1.5, True):
        with pytest.raises(ValueError, match="alpha="):
            mixed_counts(10, 3, bad)
    pre, new = SyntheticCache(traces=20, seed=0), SyntheticCache(traces=6, seed=1)
    for alpha in (0.25, 0.5, 0.8):
        mix = MixedCache(pre, new, alpha)
        train_idx, val_idx = mix.split(0.2, seed=0)
        pre_train, pre_val = pre.split(0.2, 0)
        new_train, new_val = new.split(0.2, 0)
        n_new = round(alpha / (1 - alpha) * len(pre_train))
        assert len(train_idx) == len(pre_train) + n_new and len(val_idx) == len(pre_val) + len(new_val)
        assert _share_of_new(mix, new, train_idx) == pytest.approx(alpha, abs=1 / len(train_idx))
        # every item of the old pool's training split is in the mix, once
        assert [mix[int(i)] for i in train_idx[:len(pre_train)]] == [pre[int(i)] for i in pre_train]
        assert {id(mix[int(i)]) for i in train_idx[len(pre_train):]} == {id(new[int(i)]) for i in new_train}
    other = SyntheticCache(traces=6, seed=1)
    other.index = {"encoder": {"digest": "another"}}
    with pytest.raises(ValueError, match="different encoders"):
        MixedCache(pre, other, 0.5)
    with pytest.raises(RuntimeError, match="split"):
        len(MixedCache(pre, new, 0.5))


def test_warm_start_continues_from_the_controller(tmp_path):
    from tracelock.controller import Controller
    from tracelock.train.mix import MixedCache

    cache = SyntheticCache(traces=12, steps=2)
    first = train(_config(tmp_path, "first", dropout=0.0), cache=cache)
    # lr 0: the warm-started run's best checkpoint is exactly its initialisation
    warm = train(_config(tmp_path, "warm", init=str(first), lr=0.0, width=64),
                 cache=MixedCache(cache, SyntheticCache(traces=6, seed=1), 0.5))
    a, b = Controller.load(first), Controller.load(warm)
    assert a.config.width == b.config.width == 32  # the architecture is the checkpoint's, not the config's
    state = json.loads((warm / "state.json").read_text())
    assert state["config"]["width"] == 32 and state["config"]["dropout"] == 0.0  # and so is the record
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    with pytest.raises(ValueError, match="mix_cache and alpha go together"):
        _config(tmp_path, "bad", mix_cache="somewhere")


def test_self_train_end_to_end(real_cache, tmp_path):
    """On-policy traces at the stricter threshold, featurized with the controller's encoder, mixed, warm-started."""
    from tracelock.cli import main
    from tracelock.traces.store import iter_traces

    model, root = real_cache
    assert main(["train", *_cli(str(root / "cache"), str(tmp_path / "ctrl"), "--encoder", str(root / "encoder"))]) == 0
    assert main(["self-train", "--model", str(root / "llada"), "--controller", str(tmp_path / "ctrl"), "--cache",
                 str(root / "cache"), "--prompts", "testbed:math", "--num", "6", "--out", str(tmp_path / "st"),
                 "--gen-length", "16", "--window", "8", "--steps", "2", "--batch-size", "8", "--alpha", "0.3"]) in (0,
                                                                                                                None)
    traces = list(iter_traces(tmp_path / "st" / "traces"))
    assert traces and all(t.meta["policy"] == "tracelock" and t.meta["policy_args"]["theta"] == 0.97 for t in traces)
    state = json.loads((tmp_path / "st" / "controller" / "state.json").read_text())
    assert state["config"]["init"] == str(tmp_path / "ctrl") and state["config"]["alpha"] == 0.3
    assert (tmp_path / "st" / "controller" / "best.safetensors").is_file()
    assert (tmp_path / "st" / "controller" / "encoder.json").is_file()
