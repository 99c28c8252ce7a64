"""Quality vs steps on the testbed: decode held-out items with each policy, score them, tabulate.

Math is scored by exact match of the extracted final number; code by running the completed function
against its hidden tests in the sandbox (pass@1). Every policy decodes the same items with the same
model and settings, so accuracy and steps are comparable row by row.
"""

from dataclasses import dataclass, field

import torch

from tracelock.generate import fused_generate
from tracelock.policies.oracle import OraclePolicy
from tracelock.sandbox import check_many
from tracelock.tasks import code_program, score
from tracelock.text import decode_answer, encode_prompt


def reference_rule(family: str) -> tuple[str, dict]:
    """(policy, arguments) of the family's own rule at one token per step, the quality reference of its tables:
    LLaDA's low-confidence remasking; for Dream the TraceLock paper's native baseline, exactly one token per step
    by Dream's neg-entropy. (Dream's ``entropy`` rule truncates its count per step: in blocks it commits nothing at
    a block's first step and two slots at its last, which cost this model half its code accuracy.)"""
    return ("confidence", {"score": "neg_entropy"}) if family == "dream" else ("confidence", {})


def reference_label(family: str) -> str:
    """The table label of `reference_rule`'s run."""
    return "neg-entropy 1/step" if family == "dream" else "confidence 1/step"


def baseline_policies(gen_length: int, family: str = "llada") -> list:
    """(label, policy name, policy args): the heuristic rows of the quality-vs-steps table; the first row is the
    family's reference rule at one token per step (the oracle replays it). A Dream model adds Dream's own rules
    (their truncating schedule) and Fast-dLLM's Dream variant of the threshold rule."""
    name, args = reference_rule(family)
    label = reference_label(family).removesuffix(" 1/step")
    rows = [
        (f"{label} 1/step", name, args),
        (f"{label} 2/step", name, {**args, "steps": gen_length // 2}),
        (f"{label} 4/step", name, {**args, "steps": gen_length // 4}),
    ]
    if family == "dream":
        rows += [("entropy 1/step (Dream's schedule)", "entropy", {}), ("maskgit_plus 1/step", "maskgit_plus", {}),
                 ("topk_margin 1/step", "topk_margin", {}),
                 ("threshold 0.9 (Dream variant)", "threshold", {"tau": 0.9, "first_token": True})]
    return rows + [
        ("threshold 0.9", "threshold", {"tau": 0.9}),
        ("threshold 0.7", "threshold", {"tau": 0.7}),
        ("threshold 0.5", "threshold", {"tau": 0.5}),
        ("random 1/step", "random", {}),
    ]


def demo_policies(gen_length: int, family: str = "llada") -> list:
    """The rows `tracelock demo` can afford in about two minutes on a 2-core CPU."""
    ref = reference_label(family).removesuffix(" 1/step")
    keep = {f"{ref} 1/step", f"{ref} 4/step", "threshold 0.9", "threshold 0.5", "random 1/step",
            "entropy 1/step (Dream's schedule)", "threshold 0.9 (Dream variant)"}
    return [row for row in baseline_policies(gen_length, family) if row[0] in keep]


@dataclass
class PolicyResult:
    label: str
    accuracy: float
    avg_steps: float
    seconds_per_item: float
    correct: list = field(repr=False)
    completions: list = field(repr=False)
    canvas: torch.Tensor = field(repr=False, default=None)
    steps: list = field(repr=False, default=None)  # [N] forwards per item

    def summary(self) -> dict:
        """The row as saved and tabulated: label, accuracy, average steps, seconds per item, items, and the per-item
        record (``correct`` a string of 0/1, ``steps`` a list, in item order) so two rows can be compared paired."""
        return dict(policy=self.label, accuracy=self.accuracy, avg_steps=self.avg_steps,
                    seconds_per_item=self.seconds_per_item, n=len(self.correct),
                    correct="".join("1" if c else "0" for c in self.correct), steps=self.steps)


def decode(model, tokenizer, items, *, policy, policy_args=None, gen_length, block=None, window=None,
           batch_size=64, seed=0, on_batch=None):
    """Completions, per-item steps, seconds, and the final canvases [N, P + gen_length] (one layout);
    ``on_batch(n)``, when given, is called after each batch of ``n`` items (a progress bar's update)."""
    prompts = [encode_prompt(tokenizer, ex.prompt) for ex in items]
    # one left-padded layout for all items, so a reference canvas lines up with any later run's rows
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), model.spec.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), True
    canvases, steps, seconds = [], [], 0.0
    for start in range(0, len(items), batch_size):
        sl = slice(start, start + batch_size)
        pol = policy(start, sl) if callable(policy) and not isinstance(policy, str) else policy
        tokens, stats = fused_generate(model, ids[sl], attention_mask=mask[sl], policy=pol,
                                       policy_args=policy_args, gen_length=gen_length, block=block, window=window,
                                       seed=seed + start)
        canvases.append(tokens)
        steps += stats.steps
        seconds += stats.seconds
        if on_batch:
            on_batch(tokens.shape[0])
    canvas = torch.cat(canvases)
    completions = [decode_answer(tokenizer, row[P:].tolist(), model.spec.end_ids) for row in canvas]
    return completions, steps, seconds, canvas


# The sandbox's verdicts by (program, tests, entry point): a sweep decodes each item with many policies, which often
# write the very same function (on the verdict's code cells each program came 2.3-3.5 times), and the same program
# against the same tests passes or fails alike. Only runs that completed are remembered: a timeout or a kill (the CPU
# time limit's SIGXCPU among them) can come from a busy machine.
_COMPLETED = ("ok", "syntax_error", "runtime_error")
_VERDICTS: dict = {}
_VERDICTS_MAX = 200_000  # about 100 MB at worst; past it, new verdicts are simply not kept


def score_items(items, completions, workers: int = 2) -> list:
    """[bool] per item: exact match for math, hidden tests in the sandbox for code (each distinct program once)."""
    results = [score(ex, c) for ex, c in zip(items, completions)]
    jobs = {i: (code_program(items[i], completions[i]), items[i].target, items[i].entry_point)
            for i, r in enumerate(results) if r is None}
    new = list(dict.fromkeys(job for job in jobs.values() if job not in _VERDICTS))
    fresh = {}
    for job, run in zip(new, check_many(new, workers=workers, timeout=5.0)):
        fresh[job] = run.status == "ok"
        if run.status in _COMPLETED and len(_VERDICTS) < _VERDICTS_MAX:
            _VERDICTS[job] = fresh[job]
    for i, job in jobs.items():
        results[i] = fresh[job] if job in fresh else _VERDICTS[job]
    return results


def evaluate_policy(model, tokenizer, items, label, policy, policy_args=None, *, gen_length, block=None,
                    window=None, batch_size=64, workers=2, on_batch=None) -> PolicyResult:
    """Decode and score ``items`` with one policy (a name with ``policy_args``, or a per-batch factory);
    ``workers`` sandbox processes run the code answers' tests; ``on_batch`` as in `decode`."""
    completions, steps, seconds, canvas = decode(model, tokenizer, items, policy=policy, policy_args=policy_args,
                                                 gen_length=gen_length, block=block, window=window,
                                                 batch_size=batch_size, on_batch=on_batch)
    correct = score_items(items, completions, workers=workers)
    return PolicyResult(label, sum(correct) / len(items), sum(steps) / len(items), seconds / len(items), correct,
                        completions, canvas, list(steps))


def evaluate_oracle(model, tokenizer, items, reference_label: str, reference_canvas, **settings) -> PolicyResult:
    """The oracle of a reference run: commit exactly the proposals that already equal its final tokens."""
    return evaluate_policy(model, tokenizer, items, f"oracle (of {reference_label})",
                           lambda start, sl: OraclePolicy(reference_canvas[sl]), **settings)


def evaluate_policies(model, tokenizer, items, *, gen_length, block=None, window=None, policies=None,
                      oracle=True, batch_size=64, progress=None, on_batch=None) -> list:
    """One `PolicyResult` per policy, plus the oracle of the first row (the family's reference rule) when asked;
    ``progress(label)`` before each row, ``on_batch`` as in `decode`."""
    settings = dict(gen_length=gen_length, block=block, window=window, batch_size=batch_size, on_batch=on_batch)
    rows = []
    for label, name, args in policies or baseline_policies(gen_length, model.spec.family):
        if progress:
            progress(label)
        rows.append(evaluate_policy(model, tokenizer, items, label, name, args, **settings))
    if oracle:
        if progress:
            progress("oracle")
        rows.append(evaluate_oracle(model, tokenizer, items, rows[0].label, rows[0].canvas, **settings))
    return rows


def format_table(task: str, setting: str, rows: list) -> str:
    """A markdown table of one setting's rows (`PolicyResult.summary` dicts)."""
    lines = [f"{task}, {setting}, {rows[0]['n']} held-out items", "",
             "| policy | accuracy | avg steps | s / item |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {100 * r['accuracy']:.1f}% | {r['avg_steps']:.1f} | "
                     f"{r['seconds_per_item']:.3f} |")
    return "\n".join(lines)
