"""What one server's routes share (`ServerState`), and the FastAPI dependency that hands it to them."""

from dataclasses import dataclass

from fastapi import Request

from tracelock.serve.config import ServeConfig
from tracelock.serve.scheduler import Scheduler


@dataclass
class ServerState:
    config: ServeConfig
    tokenizer: object
    scheduler: Scheduler
    metrics: object
    mask_id: int
    draining: bool = False  # SIGTERM came: the running requests finish, new ones are refused


async def server_state(request: Request) -> ServerState:
    """The routes' dependency: the state `tracelock.serve.app.create_app` attached to the app. A coroutine, so
    FastAPI runs it on the event loop: a plain function would go through its thread pool, and that hop delays the
    handler's read of the body (a client gone by then is only counted cancelled, never decoded)."""
    return request.app.state.server
