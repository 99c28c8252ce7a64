"""Rewards of completed rollouts behind one interface: ``reward(items, completions) -> [n] float tensor``.

- `TaskReward`: the task's own checker (testbed math: exact match; testbed code: its hidden tests in the sandbox;
  any `tracelock.eval.tasks.Task` with a checker), 1.0 for correct, 0.0 otherwise.
- `RewardModelReward`: a transformers sequence-classification reward model (the paper uses Skywork-Reward-V2) that
  scores the chat ``[user: prompt, assistant: completion]``; its first logit is the reward.
- `CodePenalty`: the paper's code adjustment around another reward. With ``R_bar`` the group's mean reward before
  adjustment, a program with a syntax error loses ``|R_bar|`` and one that fails at runtime (or times out) loses
  ``|R_bar| / 2``; the program runs (with the item's tests, when it has any) only inside the sandbox.
"""

from __future__ import annotations

import abc

import torch

__all__ = ["CodePenalty", "Reward", "RewardModelReward", "TaskReward"]


class Reward(abc.ABC):
    @abc.abstractmethod
    def __call__(self, items: list, completions: list[str]) -> torch.Tensor:
        """[n] float rewards of ``completions`` (one per item, in order)."""


class TaskReward(Reward):
    """1.0 where the task's checker accepts the completion.

    Args:
        task: a `tracelock.eval.tasks.Task` (``score(items, completions)`` -> bools), e.g.
            ``make_task("testbed:math")``.
        workers (int): sandbox processes for code. Default: 2.
    """

    def __init__(self, task, workers: int = 2):
        if getattr(task, "judged", False):
            raise ValueError(f"task {task.name} has no checker (it is judged); use a reward model instead")
        self.task, self.workers = task, workers

    def __call__(self, items, completions):
        return torch.tensor([float(bool(c)) for c in self.task.score(items, completions, workers=self.workers)])


class RewardModelReward(Reward):
    """A transformers ``AutoModelForSequenceClassification`` reward model over the chat of prompt and completion.

    Args:
        path: the reward model's folder (loaded with ``local_files_only``: nothing is downloaded).
        batch_size (int): completions per forward. Default: 8.
        device: Default: "cpu".
    """

    def __init__(self, path, batch_size: int = 8, device="cpu"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path), local_files_only=True).to(device)
        self.model.eval()
        self.batch_size, self.device = batch_size, device

    def _text(self, prompt: str, completion: str) -> str:
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        return f"User: {prompt}\nAssistant: {completion}"

    @torch.no_grad()
    def __call__(self, items, completions):
        texts = [self._text(it.prompt, c) for it, c in zip(items, completions)]
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        out = []
        for lo in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[lo:lo + self.batch_size], return_tensors="pt", padding=True).to(self.device)
            out.append(self.model(**enc).logits[:, 0].float().cpu())
        return torch.cat(out)


def code_status(program: str, tests: str | None, entry_point: str | None, timeout: float = 5.0) -> str:
    """"ok", "syntax_error" or "runtime_error" (a timeout counts as one) of a program run in the sandbox."""
    from tracelock.sandbox import check_program, run_python

    result = run_python(program, timeout=timeout) if tests is None else check_program(
        program, tests, entry_point=entry_point, timeout=timeout)
    return {"ok": "ok", "syntax_error": "syntax_error"}.get(result.status, "runtime_error")


class CodePenalty(Reward):
    """``base``'s rewards with the paper's code penalties, per group of ``group_size`` rollouts.

    Args:
        base (Reward): the reward before adjustment.
        program: ``program(item, completion) -> (program, tests or None, entry_point or None)``, or None for a code
            item that is not code; the default reads testbed code items.
        group_size (int): rollouts per prompt (R_bar is each group's mean). Default: 4.
    """

    def __init__(self, base: Reward, group_size: int = 4, program=None):
        self.base, self.group_size, self.program = base, group_size, program or testbed_program

    def __call__(self, items, completions):
        rewards = self.base(items, completions).float()
        if len(rewards) % self.group_size:
            raise ValueError(f"{len(rewards)} rollouts do not split into groups of {self.group_size}")
        mean = rewards.reshape(-1, self.group_size).mean(1).repeat_interleave(self.group_size)
        penalty = torch.zeros_like(rewards)
        for i, (item, text) in enumerate(zip(items, completions)):
            job = self.program(item, text)
            if job is None:
                continue
            status = code_status(*job)
            penalty[i] = {"ok": 0.0, "syntax_error": 1.0, "runtime_error": 0.5}[status] * mean[i].abs()
        return rewards - penalty


def testbed_program(item, completion):
    """(program, tests, entry point) of a testbed code item's completion; None for other items."""
    example = getattr(item, "reference", None) or getattr(item, "example", None)
    if example is None or getattr(example, "entry_point", None) is None:
        return None
    from tracelock.tasks import code_program

    return code_program(example, completion), example.target, example.entry_point
