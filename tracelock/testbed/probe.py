"""`tracelock testbed-probe`: what a testbed model can fill in when only one answer token is masked.

Each answer token of held-out math items is masked alone (the prompt and the rest of the answer visible) and
the model's top-1 prediction is scored per token class: the object word (copied from the prompt: "stickers"),
the person's name, numbers after "=" (arithmetic), other numbers (copied operands), everything else. With
full context every class but the phrasing is determined, so a low class accuracy names a missing skill
rather than a decoding problem. It also reports how alike the ten object words' embeddings are: a masked
objective that never learns to copy them makes them interchangeable (cosine near 1). Last, each equation result
is predicted again with everything from it on masked (`left_context_result_accuracy`): the arithmetic itself; and
how often the training masks ask for that (`compute_case_share`).
"""

import json
from pathlib import Path

from tracelock.atomic import atomic_write_json
from tracelock.tasks.math_task import NAMES, OBJECTS
from tracelock.text import encode_prompt

# torch is imported in the functions: the CLI imports this module to build its parser, which must stay light

CLASSES = ("object", "name", "result", "operand", "other")


def token_classes(pieces: list[str]) -> list[str]:
    """The class of each decoded answer token (see the module docstring); ``pieces`` stripped of spaces."""
    names = {n[0] for n in NAMES}
    out = []
    for i, p in enumerate(pieces):
        if p in OBJECTS:
            out.append("object")
        elif p in names:
            out.append("name")
        elif p.isdigit():
            out.append("result" if i > 0 and pieces[i - 1] == "=" else "operand")
        else:
            out.append("other")
    return out


def single_mask_accuracy(model, tokenizer, items, gen_length: int = 64) -> dict:
    """{class: (correct, total)} over every answer token of ``items``, each masked alone, in a generation
    region of ``gen_length`` (the answer, <|eot_id|>, then eos as decoding ends up with)."""
    import torch

    from tracelock.progress import progress_bar

    spec = model.spec
    counts = {c: [0, 0] for c in CLASSES}
    for ex in progress_bar(items, desc="single-mask probe", unit="item"):
        prompt = encode_prompt(tokenizer, ex.prompt)
        answer = tokenizer(ex.answer, add_special_tokens=False)["input_ids"]
        tail = [spec.eot_id] + [spec.eos_id] * max(0, gen_length - len(answer) - 1)
        row = torch.tensor(prompt + answer + tail)
        rows = row.repeat(len(answer), 1)
        positions = torch.arange(len(answer)) + len(prompt)
        rows[torch.arange(len(answer)), positions] = spec.mask_id
        with torch.no_grad():
            logits = model.predict(rows, positions[:, None]).logits[:, 0]
        hits = (logits.argmax(-1) == torch.tensor(answer)).tolist()
        for cls, hit in zip(token_classes([tokenizer.decode([t]).strip() for t in answer]), hits):
            counts[cls][0] += hit
            counts[cls][1] += 1
    return {c: tuple(v) for c, v in counts.items()}


def left_context_result_accuracy(model, tokenizer, items, gen_length: int = 64) -> tuple:
    """(correct, total) over the equation results of ``items`` (the number after "="), each predicted with the
    answer before it visible and everything from it on masked.

    That is the state semi-AR decoding commits a result in (minus the rest of its block). With the rest of the
    answer visible, as in `single_mask_accuracy`, a result can be copied from where it appears later (the next
    equation's operand, "#### N"); here it has to be computed from the operands.
    """
    import torch

    spec = model.spec
    correct = total = 0
    for ex in items:
        prompt = encode_prompt(tokenizer, ex.prompt)
        answer = tokenizer(ex.answer, add_special_tokens=False)["input_ids"]
        classes = token_classes([tokenizer.decode([t]).strip() for t in answer])
        results = [k for k, cls in enumerate(classes) if cls == "result"]
        if not results:
            continue
        rows = torch.tensor([prompt + answer[:k] + [spec.mask_id] * (gen_length - k) for k in results])
        with torch.no_grad():
            logits = model.predict(rows, torch.tensor(results)[:, None] + len(prompt)).logits[:, 0]
        correct += int((logits.argmax(-1) == torch.tensor([answer[k] for k in results])).sum())
        total += len(results)
    return correct, total


def compute_case_share(tokenizer, spec, block_fraction: float, steps: int = 60, seed: int = 0):
    """Share of equation results in `testbed-train`'s math batches that its masks make the model compute: the result
    supervised, both operands (``a op b = c``) visible, every later use of the number masked. None without results.

    The first ``steps`` batches of a run with ``seed`` (math only, batch 32) and their masks as `draw_masks` draws
    them with ``block_fraction``.
    """
    from tracelock.testbed.train import BackboneTrainConfig, Batches, draw_masks, mask_generator

    cfg = BackboneTrainConfig(out="", seed=seed, tasks=("math",), block_fraction=block_fraction)
    batches = Batches(cfg, tokenizer, spec)
    computed = total = 0
    for step in range(steps):
        x, region, answer_len = batches(step)
        _, masked, supervised, _ = draw_masks(region, answer_len, mask_generator(seed, step), cfg.eps, block_fraction,
                                              cfg.block_sizes)
        for i, row in enumerate(x.tolist()):
            start = int(region[i].float().argmax())
            answer = row[start:start + int(answer_len[i])]
            for k, cls in enumerate(token_classes([tokenizer.decode([t]).strip() for t in answer])):
                if cls != "result":
                    continue
                later = [start + j for j in range(k + 1, len(answer)) if answer[j] == answer[k]]
                total += 1
                computed += bool(supervised[i, start + k] and not masked[i, start + k - 4]
                                 and not masked[i, start + k - 2] and masked[i, later].all())
    return computed / total if total else None


def object_embedding_cosine(model, tokenizer) -> dict:
    """Mean pairwise cosine of the object words' input embeddings and LM-head rows."""
    import torch

    ids = [tokenizer(" " + w, add_special_tokens=False)["input_ids"][0] for w in OBJECTS]
    off = ~torch.eye(len(ids), dtype=torch.bool)
    out = {}
    for name, weight in (("embedding", model.embed.weight), ("lm_head", model.lm_head.weight)):
        v = torch.nn.functional.normalize(weight[ids].float(), dim=-1)
        out[name] = round((v @ v.T)[off].mean().item(), 3)
    return out


def _run(args):
    import tracelock
    from tracelock.tasks import held_out

    model, tok = tracelock.load_model(args.model), tracelock.load_tokenizer(args.model)
    items = held_out("math", args.split, args.limit)
    counts = single_mask_accuracy(model, tok, items)
    k, n = left_context_result_accuracy(model, tok, items)
    result = {"model": str(args.model), "items": args.limit, "split": args.split,
              "single_mask_accuracy": {c: round(k / n, 3) if n else None for c, (k, n) in counts.items()},
              "tokens": {c: n for c, (_, n) in counts.items()},
              "result_left_context_accuracy": round(k / n, 3) if n else None, "results": n,
              "training_compute_share": {str(f): compute_case_share(tok, model.spec, f) for f in (0.0, 0.5, 1.0)},
              "object_embedding_cosine": object_embedding_cosine(model, tok)}
    print(json.dumps(result, indent=1))
    if args.out:
        atomic_write_json(Path(args.out), result)


def add_parsers(sub):
    from tracelock.cli_options import add_limit, add_model
    from tracelock.cli_values import output_file

    p = sub.add_parser("testbed-probe", help="per-token-class accuracy of a testbed model with one answer token "
                                             "masked (which skills it lacks); JSON on stdout")
    add_model(p, default="testbed")
    add_limit(p, default=60, help="held-out math items", old=("--n",))
    p.add_argument("--split", choices=["validation", "test"], default="test", help="split of the items")
    p.add_argument("--out", type=output_file, help="also write the JSON here (default: stdout only)")
    p.set_defaults(func=_run)
