"""``tracelock serve --api-key``: every ``/v1/*`` request must send ``Authorization: Bearer KEY`` (what the openai
client sends as its ``api_key``), else a 401 with OpenAI's error body. ``/health`` and ``/metrics`` stay open, for
load balancers and Prometheus, as in vLLM. A refused request counts in ``tracelock_requests_total`` as an ``error``
(a 4xx), under its endpoint's label, so requests in = ok + error + refused + cancelled holds with a key too.

A plain ASGI wrapper rather than a Starlette ``BaseHTTPMiddleware``: that one re-wraps ``receive``, and the handlers
watch ``receive`` for a client that went away (which frees its batch slot).
"""

import hmac

from fastapi.responses import JSONResponse

from tracelock.serve.protocol import APIError


def bearer_token(headers: list) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` header among ASGI ``headers`` [(name, value) bytes]."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


# the endpoint label of the generation routes' counters (serve/generation.py); any other /v1 path counts as "other"
ENDPOINT_LABELS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class RequireAPIKey:
    """ASGI middleware: ``/v1/*`` requests without the server's key get a 401 and never reach the app."""

    def __init__(self, app, *, api_key: str, metrics=None):
        self.app, self._key, self._metrics = app, api_key.encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            token = bearer_token(scope.get("headers", []))
            if token is None or not hmac.compare_digest(token, self._key):
                why = "no API key was sent" if token is None else "the API key sent is not this server's"
                err = APIError(401, f"{why}: send the key the server was started with (--api-key) as "
                                    "'Authorization: Bearer KEY', the openai client's api_key=KEY",
                               type="invalid_request_error", code="invalid_api_key")
                response = JSONResponse(err.body(), status_code=401, headers={"www-authenticate": "Bearer"})
                if self._metrics is not None:
                    endpoint = ENDPOINT_LABELS.get(scope["path"].rstrip("/"), "other")
                    self._metrics.inc("requests_total", endpoint=endpoint, outcome="error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
