"""`tracelock testbed-ar-calibration`: the testbed backbone trained autoregressively, as a yardstick.

The shipped testbed model is far below its accuracy bar. This separates the two possible reasons: tasks too
hard for a 2-core CPU's budget, or a masked-diffusion objective that learns them slowly. It trains the same
LLaDA backbone (same config, tokenizer, batches, optimiser and schedule as `testbed-train`) with a causal
attention mask and the next-token loss on the answer, then scores greedy completions of held-out items with
the testbed's own scorers (exact match for math, the sandboxed hidden tests for code). It is a diagnostic:
no decoder uses a causal model, and the shipped weights come from `testbed-train` only. A run takes minutes,
so it is not resumable; the result JSON is written atomically.
"""

import dataclasses
import time
from pathlib import Path

from tracelock.atomic import atomic_write_json
from tracelock.testbed.train_config import BackboneTrainConfig


def _torch():
    # torch loads with the command, not at import: the CLI imports this module for its parser
    import torch

    return torch


def train_ar(cfg: BackboneTrainConfig, progress: bool = True):
    """A fresh backbone trained for ``cfg.steps`` next-token steps; returns (model, tokenizer, seconds)."""
    from tracelock.progress import progress_bar
    from tracelock.testbed.train import Batches, _build, _lr, ar_loss, check_config, make_optimizer

    check_config(cfg)
    torch = _torch()
    out = Path(cfg.out)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a run; choose another --out")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, tok = _build(cfg, out)
    model.train()
    opt = make_optimizer(cfg, model)
    batches = Batches(cfg, tok, model.spec)
    start = time.perf_counter()
    for step in progress_bar(range(cfg.steps), desc="AR training", unit="step", disable=not progress):
        x, region, _ = batches(step)
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        with torch.enable_grad():  # trains whatever the caller's grad mode (inside torch.no_grad() too)
            loss = ar_loss(model, x, region)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval(), tok, time.perf_counter() - start


def greedy_completion(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy causal decoding of one prompt until an end token (no KV cache: a few dozen tokens)."""
    from tracelock.text import encode_prompt

    torch = _torch()
    ids = encode_prompt(tokenizer, prompt)
    start = len(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids]), causal=True).logits[0, -1].argmax())
            if token in model.spec.end_ids:
                break
            ids.append(token)
    return tokenizer.decode(ids[start:])


def calibrate(cfg: BackboneTrainConfig, n: int, split: str = "validation", max_new_tokens: int = 64,
              progress: bool = True) -> dict:
    """Train (see `train_ar`) and score ``n`` held-out items per task; returns the result dict."""
    from tracelock.tasks import held_out
    from tracelock.testbed.evaluate import score_items

    model, tok, seconds = train_ar(cfg, progress)
    tasks = {}
    for task in cfg.tasks:
        items = held_out(task, split, n)
        completions = [greedy_completion(model, tok, ex.prompt, max_new_tokens) for ex in items]
        ok = score_items(items, completions)
        tasks[task] = {"accuracy": sum(ok) / len(ok), "n": len(ok), "examples": completions[:3]}
    return {"objective": "autoregressive (causal mask, next-token loss)", "split": split,
            "train_seconds": round(seconds, 1), "config": dataclasses.asdict(cfg), "tasks": tasks}


def _run(args):
    fields = {f.name for f in dataclasses.fields(BackboneTrainConfig)}
    cfg = BackboneTrainConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    result = calibrate(cfg, args.limit, args.split)
    atomic_write_json(Path(cfg.out) / "ar_calibration.json", result)
    for task, r in result["tasks"].items():
        print(f"{task}: {r['accuracy']:.1%} of {r['n']} {args.split} items (greedy, autoregressive)")
    print(f"trained {cfg.steps} steps in {result['train_seconds']:.0f} s; JSON in {cfg.out}/ar_calibration.json")


def add_parsers(sub):
    from tracelock.cli_options import add_limit, option_help
    from tracelock.cli_values import positive_int, seed_int, thread_count

    p = sub.add_parser("testbed-ar-calibration",
                       help="train the testbed backbone autoregressively and score it (a yardstick for testbed-train)")
    p.add_argument("--out", required=True, help="new run folder (tokenizer, config, ar_calibration.json)")
    add_limit(p, default=40, help="held-out items per task", old=("--n",))
    p.add_argument("--split", choices=["validation", "test"], default="validation", help="split of the scored items")
    defaults = BackboneTrainConfig(out="")
    # the same types as testbed-train's options: a count below 1 or a thread count past the machine is refused here
    types = dict(seed=seed_int, warmup=int)
    for name in ("seed", "steps", "batch_size", "d_model", "n_layers", "n_heads", "mlp", "vocab_size",
                 "tokenizer_corpus", "warmup"):
        p.add_argument("--" + name.replace("_", "-"), type=types.get(name, positive_int), default=None,
                       help=f"default {getattr(defaults, name)}")
    p.add_argument("--threads", type=thread_count, default=None, metavar="N", help=option_help("--threads"))
    p.add_argument("--lr", type=float, default=None, help=f"default {defaults.lr}")
    p.set_defaults(func=_run)
