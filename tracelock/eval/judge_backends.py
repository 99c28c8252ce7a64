"""Judge backends: an OpenAI-compatible HTTP endpoint (stdlib urllib) and a local transformers causal LM.

Both decode greedily (temperature 0), so a judgement is as repeatable as the backend allows. Transport problems
are the backend's to retry; what the judge *says* is checked by `tracelock.eval.judge`.
"""

from __future__ import annotations

import copy
import http.client
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["HTTPJudge", "JudgeHTTPError", "LocalJudge", "check_messages"]


class JudgeHTTPError(RuntimeError):
    """The endpoint refused the request, kept failing after the retries, or answered outside the chat API."""


def check_messages(messages) -> list[dict]:
    """`messages` as a list of {"role": str, "content": str} dicts, or a TypeError naming the bad item."""
    if not isinstance(messages, list) or not messages:
        raise TypeError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}] must be a dict with str 'role' and 'content', got {m!r}")
    return messages


class HTTPJudge:
    """A chat model behind an OpenAI-compatible ``POST {base_url}/chat/completions`` (vLLM, llama.cpp, OpenAI...).

    Args:
        base_url (str): up to and including the API version, e.g. ``http://127.0.0.1:8000/v1``.
        model (str): the served model's name, e.g. ``meta-llama/Llama-3.1-8B-Instruct`` (the paper's judge).
        api_key (str | None): sent as ``Authorization: Bearer``. Default: None (no header).
        timeout_s (float): per request. Default: 120.
        max_retries (int): extra attempts after a connection error, timeout, HTTP 429 or 5xx. Default: 4.
        backoff_s (float): first wait between attempts, doubled each time up to `max_backoff_s`; a 429/503
            ``Retry-After`` in seconds is honoured within the same cap. Default: 1.
        max_tokens (int | None): sent as ``max_tokens`` when given. Default: None (the server's default).
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, *, timeout_s: float = 120.0,
                 max_retries: int = 4, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 max_tokens: int | None = None):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https:// (e.g. http://127.0.0.1:8000/v1), "
                             f"got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be the served model's name, e.g. 'meta-llama/Llama-3.1-8B-Instruct'")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {backoff_s!r} and {max_backoff_s!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {max_tokens!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.max_tokens = max_tokens

    def _request(self, messages: list[dict]) -> urllib.request.Request:
        body = {"model": self.model, "messages": messages, "temperature": 0}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")

    def _wait(self, attempt: int, retry_after: str | None) -> float:
        wait = self.backoff_s * 2**attempt
        if retry_after is not None and retry_after.strip().isdigit():
            wait = max(wait, float(retry_after))
        return min(wait, self.max_backoff_s)

    def complete(self, messages: list[dict]) -> str:
        """The assistant's reply text to `messages` (temperature 0)."""
        request = self._request(check_messages(messages))
        last = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    payload = response.read()
                return self._content(payload)
            except urllib.error.HTTPError as e:
                detail = e.read()[:500].decode(errors="replace")
                if e.code != 429 and e.code < 500:
                    raise JudgeHTTPError(f"{self.url} answered HTTP {e.code}: {detail!r}; check base_url (it must "
                                         f"end at the API version, e.g. /v1), the model name and the API key") from e
                last, retry_after = f"HTTP {e.code}: {detail!r}", e.headers.get("Retry-After")
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                # refused or reset connections, timeouts, truncated responses: the server may come back
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt < self.max_retries:
                time.sleep(self._wait(attempt, retry_after))
        raise JudgeHTTPError(f"{self.url} failed {self.max_retries + 1} times; last error {last}. Is the server "
                             f"running and reachable?")

    def _content(self, payload: bytes) -> str:
        try:
            content = json.loads(payload)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeHTTPError(f"{self.url} did not answer with a chat completion (choices[0].message.content): "
                                 f"{payload[:300]!r}") from None
        if not isinstance(content, str):
            raise JudgeHTTPError(f"{self.url} returned a chat completion without text content: {content!r}")
        return content


class LocalJudge:
    """A transformers causal LM in this process, prompted with its own chat template, greedy decoding.

    Args:
        model_path (str | Path): a folder with the model and a tokenizer that has a chat template.
        max_new_tokens (int): reply budget; a cut-off reply is recorded as unusable, not scored. Default: 512.
        device (str): where the model runs. Default: "cpu".
        dtype (torch.dtype | None): weights' dtype. Default: None (the checkpoint's).
    """

    def __init__(self, model_path: str | Path, *, max_new_tokens: int = 512, device: str = "cpu", dtype=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"model_path {str(model_path)!r} is not a folder; give a local checkpoint folder")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        if not self.tokenizer.chat_template:
            raise ValueError(f"the tokenizer in {str(model_path)!r} has no chat template; use an instruct model whose "
                             f"tokenizer_config.json sets 'chat_template'")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
        self.device = device
        config = copy.deepcopy(self.model.generation_config)
        # greedy: drop any sampling settings the checkpoint ships with
        config.update(do_sample=False, temperature=None, top_p=None, top_k=None, max_new_tokens=max_new_tokens)
        if config.pad_token_id is None:
            pad = self.tokenizer.pad_token_id
            config.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.generation_config = config

    def complete(self, messages: list[dict]) -> str:
        """The model's greedy reply to `messages`, special tokens removed."""
        import torch

        enc = self.tokenizer.apply_chat_template(check_messages(messages), add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            out = self.model.generate(**enc, generation_config=self.generation_config)
        return self.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
