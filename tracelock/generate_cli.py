"""``tracelock generate``: prompts in, one JSON line per prompt out (text, ids, steps, seconds, settings)."""

import json
import sys

import torch
from tqdm import tqdm

from tracelock.generate import fused_generate
from tracelock.models import load_model, load_tokenizer
from tracelock.text import decode_answer, encode_prompt, read_prompt_rows


def read_prompts(args) -> list:
    if args.prompt is not None:
        return [args.prompt]
    return [row["prompt"] for row in read_prompt_rows(args.prompts)]


def parse_policy_args(pairs) -> dict:
    """["tau=0.9", "steps=32"] -> {"tau": 0.9, "steps": 32}; values are JSON when they parse, else strings."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--policy-arg {pair!r} must look like key=value, e.g. tau=0.9")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run_generate(args) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be >= 1")
    model = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    tokenizer = load_tokenizer(args.model)
    prompts = read_prompts(args)
    policy_args = parse_policy_args(args.policy_arg)
    settings = dict(model=str(args.model), policy=args.policy, policy_args=policy_args, gen_length=args.gen_length,
                    block=args.block, window=args.window, temperature=args.temperature, cfg_scale=args.cfg_scale,
                    stop_at_eot=args.stop_at_eot, idle_steps=args.idle_steps, seed=args.seed, dtype=args.dtype,
                    cache=args.cache, refresh_every=args.refresh_every, refresh_shift=args.refresh_shift)
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        bar = tqdm(total=len(prompts), disable=len(prompts) < 2, file=sys.stderr, unit="prompt")
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start:start + args.batch_size]
            ids = [encode_prompt(tokenizer, p, not args.no_chat_template) for p in batch]
            tokens, stats = fused_generate(model, ids, policy=args.policy, policy_args=policy_args,
                                           gen_length=args.gen_length, block=args.block, window=args.window,
                                           temperature=args.temperature, cfg_scale=args.cfg_scale,
                                           stop_at_eot=args.stop_at_eot, idle_steps=args.idle_steps,
                                           seed=args.seed, impl=args.impl, cache=args.cache,
                                           refresh_every=args.refresh_every, refresh_shift=args.refresh_shift)
            P = tokens.shape[1] - args.gen_length
            for row, prompt in enumerate(batch):
                generated = tokens[row, P:].tolist()
                record = dict(prompt=prompt, text=decode_answer(tokenizer, generated, model.spec.end_ids),
                              token_ids=generated, steps=stats.steps[row],
                              seconds=stats.seconds / len(batch), settings=settings)
                out.write(json.dumps(record) + "\n")
            out.flush()
            bar.update(len(batch))
        bar.close()
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
