"""``tracelock generate``: prompts in, one JSON line per prompt out (text, ids, steps, seconds, settings)."""

import json
import sys

import torch

from tracelock import ops
from tracelock.decode.schedule import validate_schedule
from tracelock.decode.settings import DecodeSettings
from tracelock.generate import fused_generate
from tracelock.models import load_model, load_tokenizer
from tracelock.models.loading import resolve_path
from tracelock.policies import POLICIES, resolve_policy
from tracelock.policy_specs import policy_and_args
from tracelock.progress import progress_bar
from tracelock.text import answer_ids, encode_prompt, read_prompt_rows


def read_prompts(args) -> list:
    if args.prompt is not None:
        return [args.prompt]
    return [row["prompt"] for row in read_prompt_rows(args.prompts)]


def check_arguments(args) -> tuple[str, dict]:
    """(policy, its arguments) of the command line, every option checked before the model loads (seconds on a
    CPU): the schedule, the policy and its values, the op implementation, the model folder and the prompts file."""
    policy, policy_args = policy_and_args(args.policy, args.policy_arg)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p:g} must lie in (0, 1] (1: every token)")
    try:
        validate_schedule(args.gen_length, args.block, args.window)
    except ValueError as err:  # its message speaks fused_generate's keywords
        raise ValueError(str(err).replace("gen_length=", "--gen-length ").replace("block=", "--block ")
                         .replace("window=", "--window ")) from None
    # built and set up without the model (a learned one reads its controller or filters here): every error says
    # its policy
    resolve_policy(policy, policy_args, gen_length=args.gen_length,
                   num_regions=args.gen_length // args.block if args.block else 1)
    if getattr(POLICIES.get(policy), "reads_vocab", False):  # `check_memory_rule`, in the command line's words
        if args.window:
            raise ValueError(f"--policy {policy} keeps a memory per slot of a block, which a sliding window moves: "
                             "use --block N (semi-AR blocks) or neither (the whole answer), not --window "
                             f"{args.window}")
        if args.temperature > 0:
            raise ValueError(f"--policy {policy} decodes greedily, as its authors' code is checked here: drop "
                             f"--temperature {args.temperature:g} (or pass --temperature 0)")
        if args.top_p not in (None, 1) or args.top_k is not None:
            raise ValueError(f"--policy {policy} reads each slot's whole distribution, as its authors' code does: "
                             "drop --top-p / --top-k")
    ops.check_impl(args.impl, args.device)
    resolve_path(args.model)  # a missing folder or unknown name fails here
    return policy, policy_args


def run_generate(args) -> int:
    policy, policy_args = check_arguments(args)
    prompts = read_prompts(args)
    model = load_model(args.model, dtype=getattr(torch, args.model_dtype), device=args.device,
                       quantize=args.quantize)
    tokenizer = load_tokenizer(args.model)
    settings = dict(model=str(args.model), policy=policy, policy_args=policy_args, gen_length=args.gen_length,
                    block=args.block, window=args.window, temperature=args.temperature, cfg_scale=args.cfg_scale,
                    top_p=args.top_p, top_k=args.top_k,
                    stop_at_eot=args.stop_at_eot, idle_steps=args.idle_steps, seed=args.seed, dtype=args.model_dtype,
                    quantize=args.quantize, cache=args.cache, refresh_every=args.refresh_every,
                    refresh_shift=args.refresh_shift)
    # built once (a learned policy reads its controller or filters from disk here), not per batch
    built = resolve_policy(policy, policy_args, gen_length=args.gen_length, model=model)
    decode = DecodeSettings(policy=built, gen_length=args.gen_length, block=args.block, window=args.window,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            cfg_scale=args.cfg_scale, stop_at_eot=args.stop_at_eot,
                            idle_steps=args.idle_steps, seed=args.seed, cache=args.cache,
                            refresh_every=args.refresh_every, refresh_shift=args.refresh_shift)
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        bar = progress_bar(total=len(prompts), disable=len(prompts) < 2, desc="generate", unit="prompt")
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start:start + args.batch_size]
            ids = [encode_prompt(tokenizer, p, not args.no_chat_template) for p in batch]
            tokens, stats = fused_generate(model, ids, decode, impl=args.impl)
            P = tokens.shape[1] - args.gen_length
            for row, prompt in enumerate(batch):
                # the answer ends before its first end token (the pad / end ids after it are filler, as the server cuts)
                answer = answer_ids(tokens[row, P:].tolist(), model.spec.end_ids)
                record = dict(prompt=prompt, text=tokenizer.decode(answer, skip_special_tokens=True),
                              token_ids=answer, steps=stats.steps[row],
                              seconds=stats.seconds / len(batch), settings=settings)
                out.write(json.dumps(record) + "\n")
            out.flush()
            bar.update(len(batch))
        bar.close()
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
