"""`LLM` and `SamplingParams`: text in, text out, in the shape of vLLM's offline API.

``LLM(model=...)`` loads the backbone and its tokenizer once; ``generate(prompts, params)`` takes strings (or
``{"prompt_token_ids": [...]}``), ``chat(messages, params)`` one conversation or a list of them, and both return one
`RequestOutput` per prompt, in order, each with ``n`` `CompletionOutput`s (text, token ids, steps, finish reason).
Prompts are decoded in length-sorted batches of ``max_num_seqs`` (`tracelock.generate_many`); rows decode
independently, so batching changes the cost, never the tokens.

What vLLM's ``SamplingParams`` names keeps its meaning; what a masked diffusion decoder adds (the policy, the block or
window, the KV cache) are more fields of the same object. ``max_tokens`` is rounded up to a multiple of the block
(or window) for decoding and the answer is cut back to it, as `tracelock serve` does.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields

from tracelock.names import SAMPLING_NAMES, unknown_name_hint
from tracelock.text import did_you_mean

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

DEFAULT_BLOCK = 32


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"SamplingParams: {name}={value!r} must be an int >= {minimum}")


@dataclass(frozen=True)
class SamplingParams:
    """How to decode each prompt: vLLM's fields, then the decoder's own.

    Args:
        n (int): completions per prompt (with ``temperature > 0``, completion i samples with ``seed + i``). Default: 1.
        temperature (float): 0 = greedy (the default here; vLLM's is 1.0); > 0 samples. Default: 0.0.
        top_p (float): nucleus sampling, in (0, 1]; 1 keeps every token. Default: 1.0.
        top_k (int): keep the k most likely tokens; 0 or -1 keeps all. Default: 0.
        seed (int, optional): seed of sampling and random policies. Default: the `LLM`'s seed.
        max_tokens (int): generated tokens at most. Default: 64.
        stop (str | list[str], optional): the text is cut before the first of these. Default: None.
        skip_special_tokens (bool): drop special tokens from ``text``. Default: True.
        logprobs: not supported (None).
        policy (str | Policy): the commitment policy (`tracelock.policies`). Default: "threshold".
        policy_args (dict, optional): its arguments. Default: ``{"tau": 0.9}`` for "threshold", else none.
        block (int, optional): semi-AR block length. Default: 32 when no ``window`` is given.
        window (int, optional): soft-crop window width instead of blocks. Default: None.
        cache (str, optional): "prefix" or "dual" KV cache. Default: None.
        stop_at_eot (bool): a committed end token finishes its row (fewer steps). Default: False.
    """

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 64
    stop: str | list | None = None
    skip_special_tokens: bool = True
    logprobs: int | None = None
    policy: object = "threshold"
    policy_args: dict | None = None
    block: int | None = None
    window: int | None = None
    cache: str | None = None
    stop_at_eot: bool = False

    def __post_init__(self):
        _positive_int("n", self.n)
        _positive_int("max_tokens", self.max_tokens)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < math.inf:
            raise ValueError(f"SamplingParams: temperature={t!r} must be a finite number >= 0 (0 = greedy)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams: top_p={p!r} must lie in (0, 1] (1 = every token)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < -1:
            raise ValueError(f"SamplingParams: top_k={self.top_k!r} must be an int >= 1, or 0 / -1 for every token")
        if self.seed is not None:
            _positive_int("seed", self.seed, minimum=0)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s
                                                                                  for s in stops)):
            raise ValueError(f"SamplingParams: stop={self.stop!r} must be a non-empty string or a list of them")
        if self.logprobs is not None:
            raise ValueError(f"SamplingParams: logprobs={self.logprobs!r} is not supported: a masked diffusion "
                             "decoder commits tokens in any order, and the probabilities it commits them at are not "
                             "the sequence's log-likelihood; leave logprobs=None")
        for name in ("block", "window"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.block is not None and self.window is not None:
            raise ValueError("SamplingParams: pass block= (semi-AR blocks) or window= (a sliding window), not both")
        from tracelock.policies import resolve_policy

        # the name, arguments and values, as the decode reads them; a learned policy is built when it decodes
        resolve_policy(self.policy, self.policy_args, gen_length=self.gen_length, load=False)

    @property
    def width(self) -> int:
        return self.window or self.block or DEFAULT_BLOCK

    @property
    def gen_length(self) -> int:
        """``max_tokens`` rounded up to a multiple of the block or window."""
        return -(-self.max_tokens // self.width) * self.width

    def settings(self, seed: int):
        """The `tracelock.DecodeSettings` of completion ``seed``."""
        from tracelock.decode.settings import DecodeSettings

        args = self.policy_args
        if args is None and self.policy == "threshold":
            args = {"tau": 0.9}
        return DecodeSettings(policy=self.policy, policy_args=args, gen_length=self.gen_length,
                              block=None if self.window else self.width, window=self.window,
                              temperature=float(self.temperature), top_p=float(self.top_p),
                              top_k=None if self.top_k in (0, -1) else int(self.top_k), seed=seed, cache=self.cache,
                              stop_at_eot=self.stop_at_eot)


_dataclass_init = SamplingParams.__init__


def _init(self, *args, **kwargs):
    names = [f.name for f in fields(SamplingParams)]
    for key in kwargs:
        if key not in names:
            raise TypeError(f"SamplingParams got an unexpected field {key!r}; its fields are: {', '.join(names)}"
                            f"{unknown_name_hint(key, names, SAMPLING_NAMES)}")
    _dataclass_init(self, *args, **kwargs)


_init.__doc__ = _dataclass_init.__doc__
SamplingParams.__init__ = _init


@dataclass
class CompletionOutput:
    """One completion: ``text`` (cut at the first end token or ``stop`` string), its ``token_ids``, the backbone
    forwards that decoded it (``steps``), and ``finish_reason``: "stop" (an end token or a stop string) or "length"
    (``max_tokens`` reached); ``stop_reason`` is the end token's id or the stop string (None for "length")."""

    index: int
    text: str
    token_ids: list
    steps: int
    finish_reason: str
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list | None = None

    def finished(self) -> bool:
        return True


@dataclass
class RequestOutput:
    """The completions of one prompt: ``prompt`` (the text, or None for token ids), ``prompt_token_ids`` and
    ``outputs`` (``n`` `CompletionOutput`s)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list = field(default_factory=list)
    finished: bool = True

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


class LLM:
    """A masked diffusion LM with its tokenizer, for text in and text out (vLLM's ``LLM``).

    Args:
        model (str): a checkpoint folder, a Hugging Face Hub id, "testbed" or "testbed-dream".
        tokenizer (str, optional): where the tokenizer is, if not beside the weights. Default: ``model``.
        dtype (str | torch.dtype): "auto" (bfloat16 on CUDA, float32 on a CPU), "float32", "bfloat16", "float16".
        device (str, optional): "cpu" or "cuda[:i]". Default: CUDA when available, else the CPU.
        seed (int): the default seed of sampling. Default: 0.
        max_num_seqs (int): prompts decoded together in one batch. Default: 16.
        quantization (str, optional): "int8", "int4" or "fp8" weights (`tracelock.load_model`'s ``quantize``).
        compile (bool): decode on the compiled engine (`tracelock.fused_generate`'s ``compile``). Default: False.

    Examples::

        llm = tracelock.LLM(model="testbed")
        out = llm.chat([{"role": "user", "content": "What is 2 + 3?"}], tracelock.SamplingParams(max_tokens=64))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model, *, tokenizer=None, dtype="auto", device=None, seed: int = 0, max_num_seqs: int = 16,
                 quantization=None, compile: bool = False):
        import torch

        from tracelock.models import load_model, load_tokenizer

        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("seed", seed, minimum=0)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        elif isinstance(dtype, str):
            names = ("float32", "bfloat16", "float16")
            if dtype not in names:
                raise ValueError(f"LLM: dtype={dtype!r} must be 'auto', {', '.join(map(repr, names))} or a torch "
                                 f"dtype{did_you_mean(dtype, names)}")
            dtype = getattr(torch, dtype)
        if isinstance(model, str):
            self.model = load_model(model, dtype=dtype, device=device, quantize=quantization)
            self.tokenizer = load_tokenizer(tokenizer or model)
        else:  # a backbone already loaded (or a transformers module `load_model` accepts)
            self.model = load_model(model, dtype=dtype, device=device) if not hasattr(model, "spec") else model
            if tokenizer is None:
                raise ValueError("LLM: a model object needs tokenizer= (a folder or a tokenizer object)")
            self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.seed, self.max_num_seqs, self.compile = seed, max_num_seqs, compile
        self._count = 0

    def get_tokenizer(self):
        return self.tokenizer

    def _encode_text(self, prompt) -> tuple:
        from tracelock.text import encode_text

        if isinstance(prompt, str):
            return prompt, encode_text(self.tokenizer, prompt)
        if isinstance(prompt, dict) and ("prompt" in prompt or "prompt_token_ids" in prompt):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._encode_text(prompt["prompt"])
        raise TypeError(f"LLM.generate: a prompt must be a string or {{'prompt_token_ids': [...]}}, got "
                        f"{type(prompt).__name__}; for token ids pass {{'prompt_token_ids': ids}}")

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None) -> list:
        """Complete each prompt as it is (no chat template; see `chat`).

        Args:
            prompts (str | list): a string, a list of strings, or ``{"prompt_token_ids": [...]}`` items.
            sampling_params (SamplingParams | list, optional): one for all prompts or one per prompt.
                Default: ``SamplingParams()``.

        Returns:
            list[RequestOutput]: one per prompt, in order.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple) or not prompts:
            raise TypeError("LLM.generate: prompts must be a string or a non-empty list of strings")
        encoded = [self._encode_text(p) for p in prompts]
        return self._run(encoded, sampling_params)

    def chat(self, messages, sampling_params: SamplingParams | list | None = None, *,
             add_generation_prompt: bool = True) -> list:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them, rendered with the
        checkpoint's chat template.

        Returns:
            list[RequestOutput]: one per conversation, in order.
        """
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, list | tuple) or not messages or not all(
                isinstance(c, list | tuple) and c and all(isinstance(m, dict) and "role" in m and "content" in m
                                                          for m in c) for c in messages):
            raise TypeError("LLM.chat: messages must be a conversation, a list of {'role': ..., 'content': ...} "
                            "dicts, or a list of such conversations")
        encoded = []
        for conversation in messages:
            text = self.tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
            encoded.append((text, self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        return self._run(encoded, sampling_params)

    def _run(self, encoded: list, sampling_params) -> list:
        from tracelock.throughput import generate_many

        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list | tuple) else [sampling_params] * len(encoded)
        if len(params) != len(encoded):
            raise ValueError(f"LLM: {len(params)} sampling_params for {len(encoded)} prompts; pass one, or one per "
                             "prompt")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"LLM: sampling_params must be a tracelock.SamplingParams, got {type(p).__name__}")
        results = [RequestOutput(request_id=str(self._count + i), prompt=text, prompt_token_ids=ids)
                   for i, (text, ids) in enumerate(encoded)]
        self._count += len(encoded)
        groups = {}
        for i, p in enumerate(params):
            groups.setdefault(id(p), (p, []))[1].append(i)
        for p, rows in groups.values():
            seed = self.seed if p.seed is None else p.seed
            for k in range(p.n):
                outputs, _ = generate_many(self.model, [encoded[i][1] for i in rows], p.settings(seed + k),
                                           batch_size=self.max_num_seqs, compile=self.compile or None)
                for i, (generated, steps) in zip(rows, outputs):
                    results[i].outputs.append(self._completion(k, generated, steps, p))
        return results

    def _completion(self, index: int, generated: list, steps: int, p: SamplingParams) -> CompletionOutput:
        end_ids = self.model.spec.end_ids
        cut = next((j for j, t in enumerate(generated[:p.max_tokens]) if t in end_ids), None)
        ids = generated[:p.max_tokens] if cut is None else generated[:cut]
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        reason, stop_reason = ("length", None) if cut is None else ("stop", generated[cut])
        if p.stop:
            stops = [p.stop] if isinstance(p.stop, str) else list(p.stop)
            found = [(text.find(s), s) for s in stops if s in text]
            if found:
                at, stop_reason = min(found)
                text, reason = text[:at], "stop"
        return CompletionOutput(index=index, text=text, token_ids=ids, steps=steps, finish_reason=reason,
                                stop_reason=stop_reason)
