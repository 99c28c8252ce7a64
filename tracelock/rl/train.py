"""`tracelock rl`: refine a supervised controller with group-relative policy gradients (paper appendix).

Each step draws ``prompts_per_step`` prompts (a pure function of the seed and the step), decodes each ``group_size``
times with sampled commits (`SampledTraceLockPolicy`), scores the completions with the `Reward`, and takes one AdamW
step on ``mean_j [-A_j sum_t log pi - beta sum_t H]``. The controller starts from the supervised checkpoint (RL from
scratch does not bootstrap, per the paper) and runs without dropout, so rollouts and the loss see the same network.

The run folder holds ``best.safetensors`` (the last weights; with the copied encoder it deploys as a TraceLock run
folder), ``history.jsonl`` (one line per step: mean reward, loss, steps), ``reward_curve.png`` and the resumable
state (``state.json`` + weights and optimiser moments), written every ``save_every`` steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tracelock.atomic import atomic_write, atomic_write_text, folder_lock, remove_stale_temps

__all__ = ["reward_curve_png", "rl_train"]


def _save(out: Path, step: int, controller, opt, history: list, settings: dict) -> None:
    from tracelock.integrity import save_tensors
    from tracelock.train.state import training_tensors

    # one file per step: with a single name, a kill before the JSON would pair new weights with the old step
    name = f"state-{step:08d}.safetensors"
    save_tensors(out / name, training_tensors(controller, opt))
    controller.save(out / "best.safetensors")
    atomic_write_text(out / "history.jsonl", "".join(json.dumps(h) + "\n" for h in history))
    atomic_write(out / "reward_curve.png", lambda tmp: Path(tmp).write_bytes(reward_curve_png(history)))
    # the JSON last: a crash before it leaves the previous consistent state
    atomic_write_text(out / "state.json", json.dumps(dict(step=step, settings=settings, file=name), indent=1))
    for old in [*out.glob("state-*.safetensors"), out / "state.safetensors"]:
        if old.name != name:
            old.unlink(missing_ok=True)


def _load(out: Path, controller, opt, settings: dict) -> tuple[int, list]:
    from tracelock.integrity import CorruptFileError, load_tensors, read_json
    from tracelock.train.state import load_training_tensors

    fix = f"restore {out} from a copy, or delete it to start the RL run again"
    state = read_json(out / "state.json", fix=fix)
    changed = [k for k in settings if k != "steps" and state["settings"].get(k) != settings[k]]
    if changed:
        raise ValueError(f"{out} holds an RL run with other {', '.join(changed)}; pass the same arguments to resume "
                         "it or another --out")
    load_training_tensors(load_tensors(out / state.get("file", "state.safetensors"), fix=fix), controller, opt)
    try:
        history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        raise CorruptFileError(f"{out / 'history.jsonl'} is missing or damaged ({err}); {fix}") from None
    return state["step"], history[:state["step"]]


def reward_curve_png(history: list) -> bytes:
    """Mean reward per RL step (and a 10-step running mean) as PNG bytes."""
    import io

    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2, 3.4))
    ax = fig.add_subplot(1, 1, 1)
    steps = [h["step"] for h in history]
    rewards = np.array([h["reward_mean"] for h in history], dtype=float)
    ax.plot(steps, rewards, lw=0.8, alpha=0.5, label="mean reward per step")
    if len(rewards) >= 2:
        k = min(10, len(rewards))
        smooth = np.convolve(rewards, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, lw=2, label=f"running mean ({k} steps)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward")
    ax.set_title("TraceLock-RL: reward over training")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def rl_train(model_path, controller, prompts: str, out, *, reward, num=None, steps=100, group_size=4,
             prompts_per_step=4, eta=0.5, eps=0.05, beta=0.01, lr=1e-5, clip=1.0, gen_length=64, window=16,
             seed=0, save_every=10, device="cpu", progress=None, step_cost=0.0) -> Path:
    """Run (or resume) an RL refinement into ``out``; returns ``out``.

    Args:
        model_path: the frozen backbone. controller: the supervised run folder (warm start; holds its encoder).
        prompts (str): training prompts (`tracelock.recording.collect.load_items` spec), ``num`` per testbed task.
        reward (Reward): scores completions (`tracelock.rl.rewards`).
        group_size (int): rollouts per prompt, G. Default: 4. prompts_per_step (int): prompts per step. Default: 4.
        eta, eps (float): the sampling rule (`rescaled_probs`). beta (float): entropy bonus. Default: 0.01.
        lr, clip: AdamW learning rate and gradient-norm clip.
        step_cost (float): the price of a step: each rollout's objective is its reward minus
            ``step_cost * steps / gen_length``, so the refinement trades accuracy for steps at that rate (0: the
            reward alone, the paper's). Default: 0.0.
    """
    for name, value in (("steps", steps), ("group_size", group_size), ("prompts_per_step", prompts_per_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if group_size < 2:
        raise ValueError(f"group_size={group_size} must be >= 2: advantages compare rollouts within a group")
    if isinstance(step_cost, bool) or not isinstance(step_cost, int | float) or not 0 <= step_cost < math.inf:
        raise ValueError(f"step_cost={step_cost!r} must be a finite number >= 0 (0: the reward alone)")
    out = Path(out)
    with folder_lock(out):  # one writer per run folder
        _rl_loop(model_path, controller, prompts, out, reward=reward, num=num, steps=steps, group_size=group_size,
                 prompts_per_step=prompts_per_step, eta=eta, eps=eps, beta=beta, lr=lr, clip=clip,
                 gen_length=gen_length, window=window, seed=seed, save_every=save_every, device=device,
                 progress=progress, step_cost=float(step_cost))
        remove_stale_temps(out)  # files a killed run left half-written
    return out


def _rl_loop(model_path, controller, prompts, out: Path, *, reward, num, steps, group_size, prompts_per_step, eta, eps,
             beta, lr, clip, gen_length, window, seed, save_every, device, progress, step_cost) -> None:
    # torch and the package's training code load here, not at import: the CLI imports this module for its parser
    import torch

    from tracelock.eval.tasks import EvalItem
    from tracelock.features import load_encoder
    from tracelock.generate import fused_generate
    from tracelock.models import load_model, load_tokenizer
    from tracelock.recording.collect import load_items
    from tracelock.rl.objective import group_advantages, rl_loss
    from tracelock.rl.policy import SampledTraceLockPolicy
    from tracelock.text import decode_answer, encode_prompt

    model = load_model(model_path, device=device)
    tokenizer = load_tokenizer(model_path)
    items = load_items(prompts, num, seed)
    policy = SampledTraceLockPolicy(controller, model=model, eta=eta, eps=eps)
    net = policy.controller.to(device).eval().requires_grad_(True)  # eval: no dropout, rollouts = loss network
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    settings = dict(model=str(model_path), controller=str(controller), prompts=prompts, num=num, group_size=group_size,
                    prompts_per_step=prompts_per_step, eta=eta, eps=eps, beta=beta, lr=lr, clip=clip,
                    gen_length=gen_length, window=window, seed=seed, steps=steps)
    if step_cost:  # recorded only when set, so runs from before the option still resume
        settings["step_cost"] = step_cost
    start, history = 0, []
    if (out / "state.json").exists():
        start, history = _load(out, net, opt, settings)
    else:
        out.mkdir(parents=True, exist_ok=True)
        load_encoder(controller).save(out)
    for step in range(start, steps):
        pick = np.random.default_rng([seed, step]).choice(len(items), min(prompts_per_step, len(items)),
                                                          replace=False)
        chosen = [items[int(i)] for i in pick for _ in range(group_size)]
        ids = [encode_prompt(tokenizer, it.prompt) for it in chosen]
        policy.records.clear()
        canvas, stats = fused_generate(model, ids, policy=policy, gen_length=gen_length, window=window,
                                       seed=int(np.random.SeedSequence([seed, step, 1]).generate_state(1)[0]))
        texts = [decode_answer(tokenizer, row[-gen_length:].tolist(), model.spec.end_ids) for row in canvas]
        rewards = reward([EvalItem(it.id, it.prompt, it.example) for it in chosen], texts).float()
        objective = rewards - step_cost * torch.tensor(stats.steps, dtype=torch.float) / gen_length
        advantages = group_advantages(objective, group_size)
        with torch.enable_grad():  # trains whatever the caller's grad mode (inside torch.no_grad() too)
            logp, entropy = policy.step_terms(len(chosen))
            loss = rl_loss(logp, entropy, advantages.to(logp.device), beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        history.append(dict(step=step + 1, reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                            loss=loss.item(), entropy=entropy.mean().item(), avg_steps=float(np.mean(stats.steps)),
                            objective_mean=float(objective.mean())))
        if progress:
            progress(step + 1, f"reward {rewards.mean():.3f}, loss {loss.item():.4f}, steps {np.mean(stats.steps):.1f}")
        if (step + 1) % save_every == 0 or step + 1 == steps:
            _save(out, step + 1, net, opt, history, settings)
    policy.records.clear()


def make_reward(spec: str, prompts: str, group_size: int, code_penalty: bool, workers: int = 2, device="cpu"):
    """``task`` (the testbed task's checker) or ``model:PATH`` (a reward model), with the code penalties when asked."""
    from tracelock.rl.rewards import CodePenalty, RewardModelReward, TaskReward

    if spec == "task":
        if not prompts.startswith("testbed:") or "," in prompts:
            raise ValueError("--reward task scores with the testbed task's checker: use --prompts testbed:math or "
                             "testbed:code (one task), or --reward model:PATH")
        from tracelock.eval.tasks import make_task

        base = TaskReward(make_task(prompts.split("@")[0]), workers=workers)
    elif spec.startswith("model:"):
        base = RewardModelReward(spec[len("model:"):], device=device)
    else:
        raise ValueError(f"--reward {spec!r} must be task or model:PATH (a sequence-classification reward model)")
    return CodePenalty(base, group_size=group_size) if code_penalty else base


def _rl(args):
    from tracelock.extras import require_extra

    require_extra("report", "rl", "draws reward_curve.png")
    from tracelock.progress import progress_bar

    reward = make_reward(args.reward, args.prompts, args.group_size, args.code_penalty, device=args.device)
    bar = progress_bar(total=args.steps, desc="rl", unit="step")

    def on_step(step: int, line: str) -> None:
        bar.n = step
        bar.set_postfix_str(line)

    out = rl_train(args.model, args.controller, args.prompts, args.out, reward=reward, num=args.limit, steps=args.steps,
                   group_size=args.group_size, prompts_per_step=args.prompts_per_step, eta=args.eta, eps=args.eps,
                   beta=args.beta, lr=args.lr, gen_length=args.gen_length, window=args.window, seed=args.seed,
                   save_every=args.save_every, device=args.device, step_cost=args.step_cost,
                   progress=on_step)
    bar.close()
    print(f"RL controller in {out / 'best.safetensors'}; reward curve in {out / 'reward_curve.png'}")


def add_parsers(sub):
    from tracelock.cli_options import add_device, add_model, add_prompt_limit, add_setting_spelling
    from tracelock.cli_values import bounded_int, gen_length_int, input_folder, positive_int, seed_int

    p = sub.add_parser("rl", help="refine a controller with group-relative policy gradients (resumable)")
    add_model(p)
    p.add_argument("--controller", required=True, type=input_folder("a controller folder (`tracelock train --out`)"),
                   help="the supervised (or self-trained) controller run folder")
    p.add_argument("--prompts", required=True, help="training prompts: one testbed task (testbed:math) or a JSONL "
                                                    "file, as `tracelock collect --prompts`")
    add_prompt_limit(p)
    p.add_argument("--out", required=True, help="run folder (re-running with the same arguments resumes)")
    p.add_argument("--reward", default="task", help="task (the testbed checker) or model:PATH (a reward model)")
    p.add_argument("--code-penalty", action="store_true", help="the paper's syntax/runtime penalties for code")
    p.add_argument("--steps", type=positive_int, default=100, help="RL steps")
    p.add_argument("--group-size", type=bounded_int(256, "rollouts decoded together"), default=4,
                   help="rollouts per prompt, G (at least 2)")
    p.add_argument("--prompts-per-step", type=bounded_int(256, "prompts decoded together"), default=4,
                   help="prompts drawn per step")
    p.add_argument("--eta", type=float, default=0.5, help="sample threshold on sigmoid(m)")
    p.add_argument("--eps", type=float, default=0.05, help="clip of the rescaled probabilities")
    p.add_argument("--beta", type=float, default=0.01, help="entropy bonus")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--step-cost", type=float, default=0.0, metavar="C",
                   help="price of a step: a rollout's objective is its reward minus C x steps / gen-length, so the "
                        "refinement trades accuracy for steps at that rate (default: 0, the reward alone)")
    p.add_argument("--gen-length", type=gen_length_int, default=64, metavar="N",
                   help="tokens generated per prompt (LLaDA's gen_length), per rollout")
    p.add_argument("--window", type=gen_length_int, default=16, metavar="W",
                   help="soft-crop window width (TraceLock's schedule) of the controller's rollouts")
    add_setting_spelling(p, width="window")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the prompt draws and the sampled commits")
    p.add_argument("--save-every", type=positive_int, default=10, help="steps between resumable checkpoints")
    add_device(p)
    p.set_defaults(func=_rl)
