"""``tracelock generate``: prompts in, one JSON line per prompt out (text, ids, steps, seconds, settings)."""

import json
import sys

import torch

from tracelock.cli_common import policy_and_args
from tracelock.generate import fused_generate
from tracelock.models import load_model, load_tokenizer
from tracelock.progress import progress_bar
from tracelock.text import decode_answer, encode_prompt, read_prompt_rows


def read_prompts(args) -> list:
    if args.prompt is not None:
        return [args.prompt]
    return [row["prompt"] for row in read_prompt_rows(args.prompts)]


def run_generate(args) -> int:
    policy, policy_args = policy_and_args(args.policy, args.policy_arg)
    model = load_model(args.model, dtype=getattr(torch, args.model_dtype), device=args.device)
    tokenizer = load_tokenizer(args.model)
    prompts = read_prompts(args)
    settings = dict(model=str(args.model), policy=policy, policy_args=policy_args, gen_length=args.gen_length,
                    block=args.block, window=args.window, temperature=args.temperature, cfg_scale=args.cfg_scale,
                    stop_at_eot=args.stop_at_eot, idle_steps=args.idle_steps, seed=args.seed, dtype=args.model_dtype,
                    cache=args.cache, refresh_every=args.refresh_every, refresh_shift=args.refresh_shift)
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        bar = progress_bar(total=len(prompts), disable=len(prompts) < 2, desc="generate", unit="prompt")
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start:start + args.batch_size]
            ids = [encode_prompt(tokenizer, p, not args.no_chat_template) for p in batch]
            tokens, stats = fused_generate(model, ids, policy=policy, policy_args=policy_args,
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
