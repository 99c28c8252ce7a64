"""The server's read-only routes: OpenAI's ``/v1/models``, ``/health`` (503 once the decode thread has died) and
Prometheus' ``/metrics``."""

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from tracelock.serve.state import ServerState, server_state

router = APIRouter()
State = Annotated[ServerState, Depends(server_state)]


@router.get("/v1/models")
async def models(state: State):
    config = state.config
    return dict(object="list", data=[dict(id=config.model_name, object="model", created=0, owned_by="tracelock",
                                          max_model_len=config.max_positions, max_tokens=config.max_tokens,
                                          policies=[p.label for p in config.policies])])


@router.get("/health")
async def health(state: State):
    if state.scheduler.alive:
        return dict(status="ok")
    return JSONResponse(dict(status="error", error=repr(state.scheduler.error)), status_code=503)


@router.get("/metrics")
async def prometheus(state: State):
    return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")
