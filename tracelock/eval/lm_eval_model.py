"""The lm-evaluation-harness model ``tracelock``: a LLaDA / Dream checkpoint decoded with a commitment policy.

    lm_eval --model tracelock \\
        --model_args pretrained=PATH,policy=threshold,tau=0.9,gen_length=256,block=32,cache=dual \\
        --tasks gsm8k --batch_size 32

It is declared as an entry point of this package in the ``lm_eval.models`` group (setup.py). ``tracelock lm-eval
...`` is lm-eval's own command line with that group registered first, for releases that do not discover model plugins
themselves (0.4.13, the current one; upstream has merged such discovery). Nothing of lm-eval is patched or copied.

``--model_args``: ``pretrained`` (a checkpoint folder or ``testbed``), ``policy`` (a name of
``tracelock.policies.POLICIES``), ``gen_length``, ``block`` or ``window`` (default ``block=32``), ``cache``
(``prefix`` | ``dual``), ``refresh_every``, ``refresh_shift``, ``controller`` (TraceLock's folder), ``l2p``
(Learn2PD's filters), ``dtype`` (``float32`` | ``bfloat16`` | ``float16``), ``quantize`` (``int8`` | ``int4`` |
``fp8``: `tracelock.models.quantize`), ``seed``, ``mc_samples`` / ``mc_batch``
/ ``check_greedy`` (log-likelihood, below); every other key is an argument of the policy (``tau=0.9``;
``per_step=k`` is ``steps=gen_length // k``). A rule with a memory per slot (``credit``, ``klass``, ``less``) decodes
greedily in blocks: ``window=`` is refused when the model is made, a task that samples when it decodes.
``--batch_size`` and ``--device`` are lm-eval's own options.

- ``generate_until`` decodes every request of a call with `tracelock.generate_many` (length-sorted batches of
  ``batch_size``; a row's tokens do not depend on its batch), then cuts the answer at the first end token and at the
  first of the request's ``until`` strings. The generation length is ``gen_length`` (the diffusion canvas, as in
  LLaDA's and Fast-dLLM's lm-eval scripts); a task's ``max_gen_toks`` does not change it. ``do_sample`` with a
  ``temperature`` samples; otherwise decoding is greedy.
- ``loglikelihood`` is LLaDA's Monte-Carlo estimate of the masked objective (`tracelock.eval.likelihood`), a lower
  bound on the log-likelihood; ``is_greedy`` is LLaDA's greedy check when ``check_greedy=true`` (one decode per
  request), else False, as LLaDA's script does by default.
- ``loglikelihood_rolling`` (perplexity tasks) raises: a masked diffusion model has no left-to-right likelihood,
  and the Monte-Carlo bound over long documents would need a chunking rule of its own.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from lm_eval.api.model import LM

log = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")


def _batch_size(value) -> int:
    """lm-eval's ``--batch_size``: an int, or ``auto`` / ``auto:N`` (here: 32, as decoding rows are independent)."""
    if isinstance(value, str) and value.startswith("auto"):
        return 32
    size = int(value)
    if size < 1:
        raise ValueError(f"batch_size={value!r} must be a positive int (or auto)")
    return size


class TraceLockLM(LM):
    """See the module docstring."""

    def __init__(self, pretrained: str = "testbed", policy: str = "threshold", gen_length: int = 256,
                 block: int | None = None, window: int | None = None, cache: str | None = None,
                 refresh_every: int | None = None, refresh_shift: int | None = None, controller: str | None = None,
                 l2p: str | None = None, dtype: str = "float32", quantize: str | None = None,
                 device: str | None = None, batch_size=16,
                 max_batch_size=None, seed: int = 0, mc_samples: int = 128, mc_batch: int = 32,
                 check_greedy: bool = False, **policy_args):
        super().__init__()
        import torch

        from tracelock.decode.context import check_memory_rule
        from tracelock.decode.settings import DecodeSettings
        from tracelock.eval.runner import PolicySpec, build_policy
        from tracelock.models import load_model, load_tokenizer

        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {', '.join(_DTYPES)}")
        if block is None and window is None:
            block = min(32, gen_length)
        # checked before the model loads; the policy is built after it
        settings = DecodeSettings(policy=policy, gen_length=int(gen_length), block=block, window=window, cache=cache,
                                  refresh_every=refresh_every, refresh_shift=refresh_shift, seed=int(seed))
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            # lm-eval passes its default cuda:0 also where there is no GPU (its HF model falls back the same way)
            if device is not None:
                log.warning("device=%s asked for but CUDA is not available; decoding on the CPU", device)
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = load_model(pretrained, dtype=getattr(torch, dtype), device=device, quantize=quantize)
        self.tokenizer = load_tokenizer(pretrained)
        self.pretrained, self.seed = str(pretrained), int(seed)
        self.batch_size = _batch_size(batch_size)
        self.mc_samples, self.mc_batch, self.check_greedy = int(mc_samples), int(mc_batch), bool(check_greedy)
        spec = PolicySpec(policy, policy, dict(policy_args))
        self.settings = replace(settings, policy=build_policy(spec, self.model, controller=controller, l2p=l2p,
                                                              gen_length=int(gen_length)))
        check_memory_rule(self.settings.policy, self.settings)  # a rule with a memory per slot: blocks, not a window
        self._device = self.model.device

    # -- prompts ----------------------------------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained.replace("/", "__")

    def chat_template(self, chat_template=False) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list:
        from tracelock.text import encode_text

        return encode_text(self.tokenizer, text)

    def _fit(self, ids: list, room: int) -> list:
        """The last ``room`` tokens of a context too long for the model (lm-eval's HF model truncates the same way)."""
        if len(ids) > room:
            log.warning("a context of %d tokens leaves no room for %s; keeping its last %d", len(ids),
                        "the generation" if room < self.model.spec.max_positions else "the model", room)
            return ids[-room:]
        return ids

    # -- generation -------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list:
        from tracelock.text import cut_at_stop, decode_answer
        from tracelock.throughput import generate_many

        gen_length = self.settings.gen_length
        room = self.model.spec.max_positions - gen_length
        groups = {}  # (until, temperature) -> request indices: one decode call per distinct setting
        for i, req in enumerate(requests):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0) or 0.0) if kwargs.get("do_sample") else 0.0
            if temperature > 0 and self.settings.policy.reads_vocab:
                raise ValueError(f"policy {self.settings.policy.name!r} decodes greedily, but this task samples "
                                 f"(do_sample with temperature={temperature:g}); run it greedy with --gen_kwargs "
                                 "do_sample=false, or choose a policy that samples")
            groups.setdefault((tuple(until), temperature), []).append(i)
        results = [None] * len(requests)
        for (until, temperature), indices in groups.items():
            prompts = [self._fit(self._encode(requests[i].args[0]), room) for i in indices]
            outputs, _ = generate_many(self.model, prompts, replace(self.settings, temperature=temperature),
                                       batch_size=self.batch_size)
            for i, (generated, _) in zip(indices, outputs):
                text, _ = cut_at_stop(decode_answer(self.tokenizer, generated, self.model.spec.end_ids), until)
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    # -- likelihood -------------------------------------------------------------------------------------------

    def _pair(self, context: str, continuation: str) -> tuple[list, list]:
        """(context ids, continuation ids), split on the tokens of the whole text as lm-eval's HF model does; an
        empty context conditions on the BOS token alone."""
        if not context:
            bos = self.model.spec.bos_id
            if bos is None:
                raise ValueError("an empty context needs a BOS token to condition on, and this model has none")
            return [bos], self.tokenizer(continuation, add_special_tokens=False)["input_ids"]
        whole, prefix = self._encode(context + continuation), self._encode(context)
        return whole[:len(prefix)], whole[len(prefix):]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list:
        from tracelock.eval.likelihood import greedy_matches, masked_loglikelihood

        results = []
        for req in requests:
            prefix, target = self._pair(*req.args)
            if not target:
                raise ValueError(f"the continuation {req.args[1]!r} encodes to no tokens; nothing to score")
            prefix = self._fit(prefix, self.model.spec.max_positions - len(target))
            ll = masked_loglikelihood(self.model, prefix, target, samples=self.mc_samples, batch_size=self.mc_batch,
                                      seed=self.seed)
            greedy = greedy_matches(self.model, prefix, target) if self.check_greedy else False
            results.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, (ll, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list:
        raise NotImplementedError(
            "the tracelock model does not score perplexity tasks (loglikelihood_rolling): a masked diffusion model "
            "has no left-to-right likelihood, and its Monte-Carlo bound (used for loglikelihood) over documents "
            "longer than the model's context would need a chunking rule of its own; use generation or "
            "multiple-choice tasks")
