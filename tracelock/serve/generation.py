"""The generation routes: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events
with ``stream: true``); what `tracelock.serve.app` describes.

Handlers only validate, tokenize and wait: decoding happens on the scheduler's thread, and its results arrive in a
per-request asyncio queue. A client that disconnects (mid-stream, or while waiting for a whole answer) has its
request cancelled, which frees its batch slot before the next step.
"""

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from tracelock.serve.protocol import APIError, ChatRequest, CompletionRequest, parse_body
from tracelock.serve.scheduler import Result, Submission
from tracelock.serve.state import ServerState, server_state

router = APIRouter()
State = Annotated[ServerState, Depends(server_state)]


def _usage(result: Result | list, policy: str) -> dict:
    """OpenAI's usage of one result or of a request's ``n`` (their tokens and steps summed)."""
    results = result if isinstance(result, list) else [result]
    done = sum(len(r.answer.token_ids) for r in results)
    first = results[0]
    return dict(prompt_tokens=first.prompt_tokens, completion_tokens=done, total_tokens=first.prompt_tokens + done,
                gen_length=first.gen_length, steps=sum(r.steps for r in results), policy=policy)


class _Endpoint:
    """What differs between the two generation endpoints: how the prompt is built and how a choice looks."""

    def __init__(self, name: str, request_model: type, object_name: str, chunk_name: str, id_prefix: str):
        self.name, self.request_model = name, request_model
        self.object_name, self.chunk_name, self.id_prefix = object_name, chunk_name, id_prefix

    def prompt_ids(self, state: ServerState, request) -> tuple[list, str]:
        """(token ids, the request field they came from)."""
        from tracelock.text import encode_text

        tok = state.tokenizer
        if self.name == "completions":
            return encode_text(tok, request.prompt), "prompt"
        if not tok.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text} for m in request.messages]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # the template's own refusal (e.g. roles it does not take)
            raise APIError(400, f"the chat template refused these messages: {err}", "messages") from None
        return tok(text, add_special_tokens=False)["input_ids"], "messages"

    def choice(self, answer, delta: str | None = None, finish_reason=None, index: int = 0) -> dict:
        """A whole answer's choice (the ``index``-th of a request's ``n``), or a stream chunk's (``delta`` set)."""
        if self.name == "completions":
            if delta is None:
                return dict(index=index, text=answer.text, finish_reason=answer.finish_reason, logprobs=None,
                            token_ids=answer.token_ids)
            return dict(index=0, text=delta, finish_reason=finish_reason, logprobs=None)
        if delta is None:
            return dict(index=index, message=dict(role="assistant", content=answer.text),
                        finish_reason=answer.finish_reason, logprobs=None, token_ids=answer.token_ids)
        return dict(index=0, delta={} if finish_reason else dict(content=delta), finish_reason=finish_reason,
                    logprobs=None)


COMPLETIONS = _Endpoint("completions", CompletionRequest, "text_completion", "text_completion", "cmpl-")
CHAT = _Endpoint("chat", ChatRequest, "chat.completion", "chat.completion.chunk", "chatcmpl-")


@router.post("/v1/completions")
async def completions(request: Request, state: State):
    return await generate(request, state, COMPLETIONS)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: State):
    return await generate(request, state, CHAT)


@dataclass
class _Plan:
    """A validated request: what its submissions decode."""

    request: object  # the parsed CompletionRequest / ChatRequest
    policy: object  # the served policy that decodes it
    prompt: list  # token ids
    max_tokens: int
    settings: list  # one decode setting per choice of the request's n


def _error_response(state: ServerState, err: APIError, endpoint: str) -> JSONResponse:
    state.metrics.inc("requests_total", endpoint=endpoint, outcome="error")
    return JSONResponse(err.body(), status_code=err.status)


def _refusal(state: ServerState, status: int, message: str, code: str, endpoint: str) -> JSONResponse:
    """429 (full) or 503 (shutting down), with the seconds to wait in Retry-After."""
    state.metrics.inc("requests_total", endpoint=endpoint, outcome="refused")
    seconds = state.scheduler.retry_after()
    err = APIError(status, f"{message}; retry in {seconds} s", type="server_error" if status == 503 else
                   "rate_limit_error", code=code)
    return JSONResponse(err.body(), status_code=status, headers={"retry-after": str(seconds)})


def _plan(state: ServerState, endpoint: _Endpoint, req) -> _Plan:
    """Check a parsed request against the served model, policies and lengths (`APIError` when it does not fit)."""
    config = state.config
    if req.model != config.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                            f"{config.model_name!r}", "model", code="model_not_found")
    policy = config.policy(req.policy)
    wanted = req.max_tokens if endpoint.name == "completions" else (req.max_completion_tokens or req.max_tokens)
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
    max_tokens, gen_length = config.gen_length(policy, wanted, param)
    prompt, field = endpoint.prompt_ids(state, req)
    if not prompt:
        raise APIError(400, f"{field} encodes to no tokens; send some text", field)
    if state.mask_id in prompt:
        raise APIError(400, f"{field} contains the mask token (id {state.mask_id}); remove it", field)
    config.check_prompt(len(prompt), gen_length, field)
    # choice i of n samples with seed + i (greedy choices are one decode's, repeated)
    seed = req.seed or 0
    settings = [config.setting(policy, gen_length, req.temperature, seed + i, req.top_p, req.cut_top_k)
                for i in range(req.n)]
    return _Plan(request=req, policy=policy, prompt=prompt, max_tokens=max_tokens, settings=settings)


def _emitter(loop, queue):
    """What the decode thread calls with a request's events: a thread-safe put into its queue."""
    def emit(event):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (the server is shutting down): nobody is waiting
            pass
    return emit


def _submit(state: ServerState, plan: _Plan, distinct: list, queues: list) -> list | None:
    """One submission per distinct setting, each emitting into its queue; None (nothing left queued) when the
    scheduler is full."""
    loop = asyncio.get_running_loop()
    req = plan.request
    subs = [Submission(prompt=plan.prompt, setting=setting, policy=plan.policy, max_tokens=plan.max_tokens,
                       stops=req.stops, stream=req.stream, emit=_emitter(loop, queue))
            for setting, queue in zip(distinct, queues)]
    for k, sub in enumerate(subs):
        if not state.scheduler.submit(sub):
            for taken in subs[:k]:
                state.scheduler.cancel(taken)
            return None
    return subs


async def generate(request: Request, state: ServerState, endpoint: _Endpoint):
    """One generation request: validate, submit, then stream or wait for the whole answer."""
    if state.draining:
        return _refusal(state, 503, "the server is shutting down", "shutting_down", endpoint.name)
    try:
        plan = _plan(state, endpoint, parse_body(endpoint.request_model, await request.body()))
    except APIError as err:
        return _error_response(state, err, endpoint.name)
    except ClientDisconnect:  # gone before its whole body came: nothing was submitted, nothing to free
        return _gone(state, endpoint.name)
    distinct = list(dict.fromkeys(plan.settings))
    queues = [asyncio.Queue() for _ in distinct]
    subs = _submit(state, plan, distinct, queues)
    if subs is None:
        return _refusal(state, 429, f"the server is full ({state.config.max_batch} requests decoding, "
                                    f"{state.scheduler.max_waiting} waiting)", "server_full", endpoint.name)
    head = dict(id=endpoint.id_prefix + subs[0].id, created=int(time.time()), model=state.config.model_name)
    if plan.request.stream:
        return StreamingResponse(_stream(state, endpoint, subs[0], queues[0], head, plan.policy.label),
                                 media_type="text/event-stream")
    which = [distinct.index(s) for s in plan.settings]
    return await _whole(request, state, endpoint, subs, queues, which, head, plan.policy.label)


def _gone(state: ServerState, endpoint: str) -> JSONResponse:
    """Counts a request whose client went away as cancelled; its answer (nginx's 499) reaches no one."""
    state.metrics.inc("requests_total", endpoint=endpoint, outcome="cancelled")
    return JSONResponse({}, status_code=499)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _final_event(queue: asyncio.Queue, watcher: asyncio.Future) -> tuple:
    """A queue's first ("done", result) or ("error", APIError) event, or ("gone", None) once ``watcher`` (the
    client went away) finishes first."""
    while True:
        getter = asyncio.ensure_future(queue.get())
        done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if getter not in done:
            getter.cancel()
            return "gone", None
        kind, value = getter.result()
        if kind in ("error", "done"):
            return kind, value


async def _whole(request, state, endpoint, subs, queues, which, head, policy):
    """The answers of ``subs`` (one per distinct setting; choice i is ``which[i]``'s) as one response."""
    watcher = asyncio.ensure_future(_disconnected(request))
    results = []
    try:
        for queue in queues:
            kind, value = await _final_event(queue, watcher)
            if kind != "done":  # the client went away (free the slots), or a decode failed
                for sub in subs:
                    state.scheduler.cancel(sub)
                if kind == "error":
                    return _error_response(state, value, endpoint.name)
                return _gone(state, endpoint.name)
            results.append(value)
        state.metrics.inc("requests_total", endpoint=endpoint.name, outcome="ok")
        chosen = [results[k] for k in which]
        return JSONResponse(dict(head, object=endpoint.object_name,
                                 choices=[endpoint.choice(r.answer, index=i) for i, r in enumerate(chosen)],
                                 usage=_usage(chosen, policy)))
    finally:
        watcher.cancel()


async def _stream(state, endpoint, sub, queue, head, policy):
    """The server-sent events of one streamed request (a chat stream opens with the role), ``[DONE]`` last."""
    def event(choice: dict, **extra) -> str:
        return f"data: {json.dumps(dict(head, object=endpoint.chunk_name, choices=[choice], **extra))}\n\n"

    finished = False
    try:
        if endpoint.name == "chat":  # OpenAI opens a chat stream with the role
            yield event(dict(index=0, delta=dict(role="assistant", content=""), finish_reason=None, logprobs=None))
        while True:
            kind, value = await queue.get()
            if kind == "delta":
                yield event(endpoint.choice(None, value))
                continue
            finished = True
            if kind == "done":
                state.metrics.inc("requests_total", endpoint=endpoint.name, outcome="ok")
                yield event(endpoint.choice(None, "", value.answer.finish_reason), usage=_usage(value, policy))
                yield "data: [DONE]\n\n"
            else:
                state.metrics.inc("requests_total", endpoint=endpoint.name, outcome="error")
                yield f"data: {json.dumps(value.body())}\n\n"
            return
    finally:
        if not finished:  # the client went away mid-stream (the response task is cancelled): free the slot
            state.scheduler.cancel(sub)
            state.metrics.inc("requests_total", endpoint=endpoint.name, outcome="cancelled")
