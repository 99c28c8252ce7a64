"""Request bodies of the OpenAI-compatible endpoints, their validation, and OpenAI-style JSON errors.

Bodies are validated strictly from the raw JSON (a string where a number belongs is an error, not coerced). Fields
OpenAI defines that this server cannot honour (``logprobs``, ``echo``, ``suffix``, ``n > 1`` with ``stream``, ...)
are refused with an error naming them; fields it does not know are ignored, as OpenAI's own SDK may send new ones.
``n`` completions sample with seeds ``seed, seed + 1, ...``; ``top_p`` and ``top_k`` (vLLM's extension) cut each
position's distribution as Dream's sampler does. Extensions: ``policy`` (a commitment policy the server allows),
``seed`` (sampling) and ``top_k``.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with the offending field in ``param``.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error answered as OpenAI does: HTTP ``status`` and ``{"error": {...}}`` naming the field (``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_N = 16  # choices one request may ask for


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    seed: int | None = None
    logprobs: bool | int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    policy: str | None = None  # extension: one of the server's allowed commitment policies

    def unsupported(self) -> None:
        """Refuse what the server cannot honour, naming the field."""
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n={self.n} must lie in 1..{MAX_N}", "n")
        if self.n > 1 and self.stream:
            raise APIError(400, f"n={self.n} with stream=true is not supported: stream one choice (n=1), or send "
                                "stream=false for several", "n")
        if self.top_k is not None and self.top_k not in (0, -1) and self.top_k < 1:
            raise APIError(400, f"top_k={self.top_k} must be >= 1 (0 or -1: every token)", "top_k")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported: a diffusion model commits tokens in any order, so the "
                                "probability each was committed at is not its log-likelihood given the text before "
                                "it; leave logprobs out", "logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by this server", name)
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if len(stops) > 4 or not all(stops):
                raise APIError(400, "stop must be a non-empty string or a list of at most 4 non-empty strings",
                               "stop")

    @property
    def stops(self) -> list:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def cut_top_k(self) -> int | None:
        """``top_k`` as the decoder takes it: None for every token."""
        return None if self.top_k in (None, 0, -1) else self.top_k

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage", False))


class CompletionRequest(_Request):
    prompt: str
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", "echo")
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported by this server", "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported by this server; send best_of=1", "best_of")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "send max_completion_tokens or max_tokens, not both", "max_completion_tokens")


def _param(loc: tuple) -> str | None:
    """``('messages', 0, 'content')`` -> ``messages[0].content``; pydantic's union branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[TextPart]", "int", "bool", "float", "function-after[...]"):
            continue
        elif not out:
            out = str(part)
        else:
            out += f".{part}"
    return out or None


def parse_body(model: type, raw: bytes):
    """The validated request of a raw body, or an `APIError` (400) naming the first bad field."""
    try:
        request = model.model_validate_json(raw or b"")
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON ({first['msg']})") from None
        if not first["loc"]:  # the body itself (a list, a number): "model_type" deeper down names its field
            raise APIError(400, "the request body must be a JSON object") from None
        param = _param(first["loc"])
        raise APIError(400, f"{param}: {first['msg']}", param) from None
    request.unsupported()
    return request
