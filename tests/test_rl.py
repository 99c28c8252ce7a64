"""RL refinement: the sampling rule, advantages and the loss by hand, the sampled policy (decisions, fallback,
recomputed terms with gradients, fused == reference), the rewards (task checker, reward model, code penalties) and
`tracelock rl` end to end with resume."""

import json
import math

import pytest
import torch

import tracelock
from tracelock.eval.tasks import EvalItem
from tracelock.models import write_tiny_checkpoint
from tracelock.rl.objective import bernoulli_terms, group_advantages, rescaled_probs, rl_loss
from tracelock.rl.policy import SampledTraceLockPolicy
from tracelock.rl.rewards import CodePenalty, Reward, RewardModelReward, TaskReward
from tracelock.testing import fresh_controller, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sampling_rule_rescales_and_clips():
    p = torch.tensor([0.3, 0.5, 0.6, 0.99, 0.7])
    p_tilde, eligible = rescaled_probs(p, eta=0.5, eps=0.05)
    assert torch.allclose(p_tilde, torch.tensor([0.05, 0.05, 0.2, 0.95, 0.4]))
    assert eligible.tolist() == [False, False, True, True, True]
    assert torch.allclose(rescaled_probs(p, 0.0, 0.01)[0], torch.tensor([0.3, 0.5, 0.6, 0.99, 0.7]))
    with pytest.raises(ValueError, match="eta=1"):
        rescaled_probs(p, 1, 0.05)
    with pytest.raises(ValueError, match="eps=0.5"):
        rescaled_probs(p, 0.5, 0.5)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4, eps=1e-6)
    # group 1: mean 0.5, population std 0.5; group 2: all equal, so zero advantage
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (0.5 + 1e-6))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def test_loss_on_a_hand_computed_example():
    p_tilde = torch.tensor([[0.2, 0.95, 0.5]], requires_grad=True)
    u = torch.tensor([[True, False, True]])
    eligible = torch.tensor([[True, True, False]])
    logp, entropy = bernoulli_terms(p_tilde, u, eligible)
    want_logp = math.log(0.2) + math.log(0.05)
    want_h = -(0.2 * math.log(0.2) + 0.8 * math.log(0.8)) - (0.95 * math.log(0.95) + 0.05 * math.log(0.05))
    assert logp.item() == pytest.approx(want_logp, rel=1e-6) and entropy.item() == pytest.approx(want_h, rel=1e-6)
    loss = rl_loss(logp, entropy, torch.tensor([2.0]), beta=0.1)
    assert loss.item() == pytest.approx(-2 * want_logp - 0.1 * want_h, rel=1e-6)
    loss.backward()
    # d/dp of -2 log p at 0.2 and of -2 log(1 - p) at 0.95, plus the entropy's; the ineligible slot gets none
    dh = lambda q: -math.log(q / (1 - q))  # noqa: E731
    grad = p_tilde.grad[0]
    assert grad[0].item() == pytest.approx(-2 / 0.2 - 0.1 * dh(0.2), rel=1e-5)
    assert grad[1].item() == pytest.approx(2 / 0.05 - 0.1 * dh(0.95), rel=1e-5)
    assert grad[2].item() == 0.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    model_dir = write_tiny_checkpoint(root / "llada", family="llada", seed=3)
    model = tracelock.load_model(model_dir)
    fresh_controller(model, folder=root / "ctrl")
    return root, model_dir, model


@torch.no_grad()
def _set_score(policy, a):
    ctrl = policy.controller
    ctrl.score_head.weight.zero_()
    ctrl.score_head.bias.fill_(a)
    ctrl.tau_head[-1].weight.zero_()
    ctrl.tau_head[-1].bias.zero_()


def test_sampled_policy_decisions(setup):
    root, _, model = setup
    prompts = random_prompts(model)
    # p = sigmoid(0) = 0.5 > eta = 0.25: every active slot is eligible with p~ = (0.5 - 0.25) / 0.75 = 1/3
    policy = SampledTraceLockPolicy(root / "ctrl", model=model, eta=0.25, eps=0.05)
    _set_score(policy, 0.0)
    for seed in range(6):
        tracelock.fused_generate(model, prompts, policy=policy, gen_length=16, window=8, seed=seed)
    decided = torch.cat([r["u"][r["eligible"]] for r in policy.records]).float()
    assert all(r["eligible"].equal(r["active"]) for r in policy.records)
    # each decision is Bernoulli(1/3) given the past (Azuma-Hoeffding): |mean - 1/3| > 0.1 has probability
    # < 2 exp(-2 n 0.01) < 1e-3 for n >= 400
    assert len(decided) >= 400 and abs(decided.mean().item() - 1 / 3) < 0.1
    # below eta nothing is eligible: the fallback commits exactly one slot per step, so gen_length steps
    low = SampledTraceLockPolicy(root / "ctrl", model=model, eta=0.5)
    _set_score(low, -3.0)
    _, stats = tracelock.fused_generate(model, prompts, policy=low, gen_length=16, window=8, seed=1)
    assert stats.steps == [16, 16, 16] and not any(r["u"].any() for r in low.records)


def test_sampled_policy_terms_and_gradients(setup):
    root, _, model = setup
    prompts = random_prompts(model)
    args = dict(gen_length=16, window=8, seed=5)
    policies = [SampledTraceLockPolicy(root / "ctrl", model=model, eta=0.3) for _ in range(3)]
    ref, ref_stats = tracelock.reference_generate(model, prompts, policy=policies[0], **args)
    got, got_stats = tracelock.fused_generate(model, prompts, policy=policies[1], **args)
    again, _ = tracelock.fused_generate(model, prompts, policy=policies[2], **args)
    assert torch.equal(ref, got) and torch.equal(got, again) and ref_stats.steps == got_stats.steps
    policy = policies[1]
    logp, entropy = policy.step_terms(len(prompts))
    # by hand from the records: the same sums
    want = torch.zeros(len(prompts))
    for rec in policy.records:
        with torch.no_grad():
            p_tilde, _ = policy._probs(rec)
        want.index_add_(0, rec["rows"], bernoulli_terms(p_tilde, rec["u"], rec["eligible"])[0])
    assert torch.allclose(logp.detach(), want, atol=1e-5)
    rl_loss(logp, entropy, torch.tensor([1.0, -1.0, 0.5]), beta=0.01).backward()
    grads = [p.grad for p in policy.controller.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


class Constant(Reward):
    def __init__(self, value):
        self.value = value

    def __call__(self, items, completions):
        return torch.full((len(items),), self.value)


def test_task_reward_and_code_penalties():
    from tracelock.eval.tasks import make_task
    from tracelock.tasks import held_out

    task = make_task("testbed:math")
    items = task.items(2)
    reward = TaskReward(task, workers=1)
    assert reward(items, [items[0].reference.answer, "no idea"]).tolist() == [1.0, 0.0]
    code = held_out("code", "test", 1)[0]
    item = EvalItem("c", code.prompt, code)
    completions = ["    return (\n", "    raise ValueError('no')\n", code.answer, code.answer]
    # base reward 2 everywhere: R_bar = 2, so syntax -2, runtime -1, a passing program nothing
    adjusted = CodePenalty(Constant(2.0), group_size=4)([item] * 4, completions)
    assert adjusted.tolist() == [0.0, 1.0, 2.0, 2.0]
    # R_bar is the group's mean before adjustment, in absolute value
    adjusted = CodePenalty(Constant(-1.0), group_size=2)([item] * 4, completions)
    assert adjusted.tolist() == [-2.0, -1.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="judged"):
        TaskReward(type("QA", (), {"judged": True, "name": "qa"})())


def test_reward_model_backend(tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(str(write_tiny_checkpoint(tmp_path / "tok", family="llada", seed=0)))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rm = RewardModelReward(tmp_path / "rm", batch_size=2)
    items = [EvalItem(str(i), "What is 2 + 3?", None) for i in range(3)]
    scores = rm(items, ["5", "The answer is 5.", "5"])
    assert scores.shape == (3,) and torch.isfinite(scores).all()
    assert scores[0] == pytest.approx(scores[2].item(), abs=1e-5) and scores[0] != scores[1]


def test_rl_command_end_to_end_and_resume(setup, tmp_path):
    from tracelock.cli import main
    from tracelock.policies.tracelock import TraceLockPolicy

    root, model_dir, model = setup
    common = ["rl", "--model", str(model_dir), "--controller", str(root / "ctrl"), "--prompts", "testbed:math",
              "--num", "6", "--gen-length", "16", "--window", "8", "--prompts-per-step", "2", "--save-every", "1",
              "--lr", "1e-3", "--eta", "0.3"]
    assert main([*common, "--out", str(tmp_path / "straight"), "--steps", "3"]) in (0, None)
    assert main([*common, "--out", str(tmp_path / "resumed"), "--steps", "2"]) in (0, None)
    assert main([*common, "--out", str(tmp_path / "resumed"), "--steps", "3"]) in (0, None)
    lines = [(tmp_path / run / "history.jsonl").read_text().splitlines() for run in ("straight", "resumed")]
    assert len(lines[0]) == 3 and lines[0] == lines[1]
    history = [json.loads(line) for line in lines[0]]
    assert all(0 <= h["reward_mean"] <= 1 and h["avg_steps"] <= 16 for h in history)
    assert (tmp_path / "straight" / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    policy = TraceLockPolicy(tmp_path / "straight", model=model)
    tracelock.fused_generate(model, random_prompts(model), policy=policy, gen_length=16, window=8)
    assert main([*common, "--out", str(tmp_path / "straight"), "--steps", "4", "--beta", "0.5"]) == 2


def test_step_cost_prices_the_steps(setup, tmp_path):
    """With --step-cost C each rollout's objective is its reward minus C x steps / gen-length (advantages from it);
    a negative price is refused."""
    from tracelock.cli import main

    root, model_dir, _ = setup
    common = ["rl", "--model", str(model_dir), "--controller", str(root / "ctrl"), "--prompts", "testbed:math",
              "--num", "6", "--gen-length", "16", "--window", "8", "--prompts-per-step", "2", "--eta", "0.3",
              "--steps", "2"]
    assert main([*common, "--out", str(tmp_path / "priced"), "--step-cost", "0.5"]) in (0, None)
    history = [json.loads(line) for line in (tmp_path / "priced" / "history.jsonl").read_text().splitlines()]
    for h in history:
        assert h["objective_mean"] == pytest.approx(h["reward_mean"] - 0.5 * h["avg_steps"] / 16, abs=1e-5)
        assert h["objective_mean"] < h["reward_mean"]
    assert main([*common, "--out", str(tmp_path / "negative"), "--step-cost", "-1"]) == 2
