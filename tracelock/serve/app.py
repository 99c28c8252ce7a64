"""The FastAPI application: OpenAI's ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (streamed as
server-sent events with ``stream: true``), plus ``/health`` and ``/metrics``.

The routes live in two routers: `tracelock.serve.generation` (the generation endpoints; handlers only validate,
tokenize and wait, decoding happens on the scheduler's thread) and `tracelock.serve.info` (models, health,
metrics). Both get the server's `ServerState` through a dependency (`tracelock.serve.state.server_state`) from
``app.state.server``.

A full server (``--max-batch`` decoding and ``--max-waiting`` queued) answers a new request 429 at once, and a
server shutting down (SIGTERM: it finishes the requests it has, then exits) answers 503; both carry a
``Retry-After`` header (seconds), as OpenAI's own client reads it.

Responses follow OpenAI's shapes, with three additions: ``choices[i].token_ids`` (the answer's token ids), and in
``usage``: ``gen_length`` (the generation length ``max_tokens`` was mapped to), ``steps`` (decoding steps of the
row) and ``policy`` (the policy that decoded it).
"""

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tracelock.serve import generation, info
from tracelock.serve.auth import RequireAPIKey
from tracelock.serve.protocol import APIError
from tracelock.serve.state import ServerState

__all__ = ["ServerState", "create_app"]


async def _http_error(request: Request, exc: HTTPException):
    """Unknown routes and methods, answered OpenAI-style."""
    return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                 type="invalid_request_error").body(), status_code=exc.status_code)


def create_app(state: ServerState) -> FastAPI:
    """The application of one server: its routers, reading ``state``, behind the API key when one is set."""
    app = FastAPI(title="tracelock", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    if state.config.api_key is not None:
        app.add_middleware(RequireAPIKey, api_key=state.config.api_key, metrics=state.metrics)
    app.add_exception_handler(HTTPException, _http_error)
    app.include_router(generation.router)
    app.include_router(info.router)
    return app
