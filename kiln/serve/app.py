"""The Starlette application of `kiln serve`: /v1/chat/completions, /v1/completions, /v1/models and /health.

A handler checks the request (protocol.py, then what needs the model: its name, the context length, the template),
turns it into prompt ids and SamplingParams, submits it to the AsyncEngine and answers either whole or as
server-sent events. Every refusal is OpenAI's error body with the field at fault: 400 for a bad request, 404 for an
unknown model, 429 when the queue is full, 503 while shutting down, 500 when the engine fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kiln.data.sft import chat_prompt_ids
from kiln.engine.params import SamplingParams
from kiln.errors import KilnError
from kiln.serve import protocol as P
from kiln.serve.async_engine import (
    AsyncEngine,
    ClientGone,
    EngineFailed,
    EngineStopped,
    QueueFull,
    RequestRefused,
    Stream,
)
from kiln.serve.images import has_images, image_chat
from kiln.serve.results import Gathered, chat_logprobs, completion_logprobs
from kiln.serve.tools import StreamFilter, reply, template_messages

DISCONNECT_POLL_S = 0.1  # how often a non-streamed answer's wait looks whether its client is still there


@dataclass
class ServedModel:
    """A name requests may give as `model`: the base, or a LoRA adapter over it (`parent` names the base)."""
    name: str
    tokenizer: Any
    vocab_size: int
    context: int | None      # the most tokens (prompt + completion) the model reads; None: no fixed limit
    created: int
    parent: str | None = None
    images: Any = None       # its vision tokens and processor (kiln.data.sft_images.ImageTokens); None: no images


@dataclass
class ServerState:
    models: dict[str, ServedModel]
    engine: AsyncEngine
    max_tokens: int          # the most tokens one completion may ask for (--max-tokens)


def _error(e: P.RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _model(state: ServerState, name: str) -> ServedModel:
    served = state.models.get(name)
    if served is None:
        raise P.RequestError(f"model {name!r} is not served here; GET /v1/models lists {sorted(state.models)}",
                             "model", 404, code="model_not_found")
    return served


def _params(state: ServerState, req: P._Sampling, served: ServedModel, prompt_len: int, max_tokens: int | None,
            logprobs: bool, top_logprobs: int) -> SamplingParams:
    """The request's SamplingParams, its max_tokens within the server's cap and the model's context."""
    room = None if served.context is None else served.context - prompt_len
    if room is not None and room < 1:
        raise P.RequestError(f"the prompt is {prompt_len} tokens; the model reads {served.context} in all, which "
                             "leaves no room for a completion", "messages" if hasattr(req, "messages") else "prompt")
    if max_tokens is None:
        max_tokens = state.max_tokens if room is None else min(state.max_tokens, room)
    if max_tokens > state.max_tokens:
        raise P.RequestError(f"max_tokens={max_tokens} is more than this server allows ({state.max_tokens}, "
                             "kiln serve --max-tokens)", "max_tokens")
    if room is not None and max_tokens > room:
        raise P.RequestError(f"max_tokens={max_tokens} with a {prompt_len}-token prompt is more than the model's "
                             f"{served.context} positions; ask for at most {room}", "max_tokens")
    params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                            min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                            seed=req.seed, stop=req.stops, logprobs=logprobs, top_logprobs=top_logprobs, n=req.n,
                            ignore_eos=req.ignore_eos)
    try:
        params.validate(served.vocab_size)
    except KilnError as e:  # protocol.py checks ranges first; this is the engine's own word on the rest
        field = re.match(r"SamplingParams\.(\w+)=", str(e))
        raise P.RequestError(str(e), field.group(1) if field else None) from None
    return params


async def _submit(state: ServerState, model: str, prompts: list[list[int]], params: SamplingParams,
                  prompt_inputs: dict | None = None) -> Stream:
    try:
        return await state.engine.submit(model, prompts, params, prompt_inputs)
    except RequestRefused as e:
        raise P.RequestError(str(e)) from None
    except EngineFailed as e:
        raise _engine_error(e) from None
    except QueueFull as e:
        raise P.RequestError(str(e), None, 429, "rate_limit_error", "queue_full") from None
    except EngineStopped as e:
        raise P.RequestError(str(e), None, 503, "server_error", "shutting_down") from None


def _engine_error(e: Exception) -> P.RequestError:
    return P.RequestError(str(e), None, 500, "server_error", "engine_error")


async def _watch(request: Request, stream: Stream) -> None:
    """Cancel the request of a non-streamed answer when its client leaves (a stream learns it by failing to send)."""
    while not stream.finished:
        if await request.is_disconnected():
            stream.abandon()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _gather(request: Request, stream: Stream, prompts: int, n: int) -> list[Gathered]:
    """Every completion of a non-streamed request, by choice index (prompt index x n + completion index). A client
    that left gets a 499 (nginx's 'client closed request': nobody reads it), an engine that failed a 500."""
    got = [Gathered() for _ in range(prompts * n)]
    watch = asyncio.ensure_future(_watch(request, stream))
    try:
        async for prompt, out in stream:
            got[prompt * n + out.index].add(out)
    except ClientGone as e:
        raise P.RequestError(str(e), None, 499, "invalid_request_error", "client_closed_request") from None
    except (EngineFailed, EngineStopped) as e:
        raise _engine_error(e) from None
    finally:
        watch.cancel()
        stream.close()
    return got


class _EventStream(StreamingResponse):
    """Server-sent events of one Stream, which is closed (its request cancelled if unfinished, its slot freed) however
    the response ends: also when the client is gone before the first send, so the events generator never starts and
    its own `finally` never runs."""

    def __init__(self, events: AsyncGenerator[bytes, None], stream: Stream):
        super().__init__(events, media_type="text/event-stream")
        self._stream, self._events = stream, events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()
            await self._events.aclose()  # an unstarted generator just closes; a started one runs its finally


def _finish(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


# ---- chat --------------------------------------------------------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.kiln
    req: P.ChatRequest = P.parse(P.ChatRequest, await request.body())
    served = _model(state, req.model)
    if req.top_logprobs and not req.logprobs:
        raise P.RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    tools_offered = bool(req.tools) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and tools_offered else None
    inputs = None  # an image-text prompt's pixel inputs (kiln.serve.images)
    if has_images(req.messages):  # decoding and resizing images is work: off the event loop
        ids, inputs = await run_in_threadpool(image_chat, served.tokenizer, req.messages, served.images, tools)
    else:
        try:
            ids = chat_prompt_ids(served.tokenizer, template_messages(req.messages), tools)
        except KilnError as e:  # the template refused the conversation (raise_exception, no template)
            raise P.RequestError(str(e), "messages") from None
    params = _params(state, req, served, len(ids), req.max_completion_tokens or req.max_tokens, req.logprobs,
                     req.top_logprobs or 0)
    stream = await _submit(state, req.model, [ids], params, inputs)
    rid, created = P.new_id("chatcmpl"), P.now()
    if req.stream:
        return _EventStream(_chat_events(stream, req, served, rid, created, len(ids), tools_offered), stream)
    got = await _gather(request, stream, 1, req.n)
    choices = []
    for i, g in enumerate(got):
        content, calls = reply(g.text, tools_offered)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        logprobs = ({"content": chat_logprobs(served.tokenizer, g.token_ids, g.logprobs, g.top, req.top_logprobs or 0)}
                    if req.logprobs else None)
        choices.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": _finish(g.finish_reason, calls)})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                         "choices": choices, "usage": P.usage(len(ids), sum(len(g.token_ids) for g in got))})


async def _chat_events(stream: Stream, req: P.ChatRequest, served: ServedModel, rid: str, created: int,
                       prompt_len: int, tools_offered: bool) -> AsyncGenerator[bytes, None]:
    def chunk(index: int, delta: dict, logprobs=None, finish=None) -> bytes:
        return P.sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                      "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    filters = [StreamFilter(tools_offered) for _ in range(req.n)]
    generated = 0
    try:
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for _, out in stream:
            generated += len(out.token_ids)
            text = filters[out.index].push(out.text)
            logprobs = ({"content": chat_logprobs(served.tokenizer, list(out.token_ids), list(out.logprobs or []),
                                                  [list(t) for t in out.top_logprobs or []], req.top_logprobs or 0)}
                        if req.logprobs else None)
            if text or logprobs:
                yield chunk(out.index, {"content": text}, logprobs)
            if out.finished:
                rest, calls = filters[out.index].finish()
                if rest:
                    yield chunk(out.index, {"content": rest})
                if calls:
                    yield chunk(out.index, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
                yield chunk(out.index, {}, finish=_finish(out.finish_reason, calls))
        if req.include_usage:
            yield P.sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                         "choices": [], "usage": P.usage(prompt_len, generated)})
        yield P.SSE_DONE
    except (EngineFailed, EngineStopped) as e:
        yield P.sse(_engine_error(e).body())
    finally:
        stream.close()


# ---- completions -------------------------------------------------------------------------------------------------
def _prompts(req: P.CompletionRequest, served: ServedModel) -> list[list[int]]:
    """The request's prompts as token ids (text is tokenized as `kiln generate` does: no special tokens added)."""
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, str) for x in p)):
        texts = [p] if isinstance(p, str) else p
        prompts = [served.tokenizer.backend.encode(t, add_special_tokens=False).ids for t in texts]
    else:
        prompts = [p] if p and all(isinstance(x, int) for x in p) else p
    if not prompts or any(len(ids) == 0 for ids in prompts):
        raise P.RequestError("prompt is empty (after tokenization)", "prompt")
    for ids in prompts:
        bad = [t for t in ids if not 0 <= t < served.vocab_size]
        if bad:
            raise P.RequestError(f"prompt: token id {bad[0]} is outside the model's vocabulary "
                                 f"[0, {served.vocab_size})", "prompt")
    return prompts


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.kiln
    req: P.CompletionRequest = P.parse(P.CompletionRequest, await request.body())
    served = _model(state, req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise P.RequestError(f"best_of={req.best_of} differs from n={req.n}; only best_of = n is served", "best_of")
    if req.echo and req.logprobs is not None:
        raise P.RequestError("echo with logprobs (the prompt's log-probs) is not served", "echo")
    prompts = _prompts(req, served)
    if len(prompts) > state.engine.max_queue:  # each prompt holds a slot: this many could never be queued
        raise P.RequestError(f"prompt: {len(prompts)} prompts in one request; this server queues at most "
                             f"{state.engine.max_queue} (kiln serve --max-queue)", "prompt")
    params = _params(state, req, served, max(len(p) for p in prompts), req.max_tokens, req.logprobs is not None,
                     req.logprobs or 0)
    stream = await _submit(state, req.model, prompts, params)
    rid, created = P.new_id("cmpl"), P.now()
    echoes = [served.tokenizer.decode(p) if req.echo else "" for p in prompts]
    if req.stream:
        return _EventStream(_completion_events(stream, req, served, rid, created, prompts, echoes), stream)
    got = await _gather(request, stream, len(prompts), req.n)
    choices = []
    for i, g in enumerate(got):
        echo = echoes[i // req.n]
        logprobs = (completion_logprobs(served.tokenizer, g.token_ids, g.logprobs, g.top, req.logprobs, len(echo))
                    if req.logprobs is not None else None)
        choices.append({"index": i, "text": echo + g.text, "logprobs": logprobs, "finish_reason": g.finish_reason})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                         "choices": choices,
                         "usage": P.usage(sum(map(len, prompts)), sum(len(g.token_ids) for g in got))})


async def _completion_events(stream: Stream, req: P.CompletionRequest, served: ServedModel, rid: str, created: int,
                             prompts: list[list[int]], echoes: list[str]) -> AsyncGenerator[bytes, None]:
    def chunk(index: int, text: str, logprobs=None, finish=None) -> bytes:
        return P.sse({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                      "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]})

    offsets = [len(echoes[i // req.n]) for i in range(len(prompts) * req.n)]
    generated = 0
    try:
        for i in range(len(offsets)):
            if echoes[i // req.n]:
                yield chunk(i, echoes[i // req.n])
        async for prompt, out in stream:
            i = prompt * req.n + out.index
            generated += len(out.token_ids)
            logprobs = (completion_logprobs(served.tokenizer, list(out.token_ids), list(out.logprobs or []),
                                            [list(t) for t in out.top_logprobs or []], req.logprobs, offsets[i])
                        if req.logprobs is not None else None)
            offsets[i] += len(out.text)
            if out.text or logprobs or out.finished:
                yield chunk(i, out.text, logprobs, out.finish_reason if out.finished else None)
        if req.include_usage:
            yield P.sse({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                         "choices": [], "usage": P.usage(sum(map(len, prompts)), generated)})
        yield P.SSE_DONE
    except (EngineFailed, EngineStopped) as e:
        yield P.sse(_engine_error(e).body())
    finally:
        stream.close()


# ---- models, health, errors --------------------------------------------------------------------------------------
async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.kiln
    data = [{"id": m.name, "object": "model", "created": m.created, "owned_by": "kiln",
             **({"parent": m.parent} if m.parent else {})} for m in state.models.values()]
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.kiln
    engine = state.engine
    ok = engine.alive
    # degraded: serving, but some engine's step raised and it was replaced (its requests then failed with a 500)
    status = "stopping" if not ok else "degraded" if any(engine.rebuilds.values()) else "ok"
    body = {"status": status, "requests": engine.held, "max_queue": engine.max_queue,
            "engine_rebuilds": dict(engine.rebuilds)}
    if engine.last_failure is not None:
        body["last_engine_failure"] = engine.last_failure
    if engine.failure is not None:
        body["error"] = f"{type(engine.failure).__name__}: {engine.failure}"
    return JSONResponse(body, status_code=200 if ok else 503)


async def _request_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, P.RequestError)  # registered for RequestError alone (starlette types handlers by Exception)
    return _error(e)


async def _http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)  # registered for HTTPException alone
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {e.detail}"
    return _error(P.RequestError(message, None, e.status_code, kind))


def build_app(state: ServerState, stop_timeout: float = 10.0) -> Starlette:
    """The application over `state`; its lifespan starts the engine thread and, at shutdown (after the server's
    grace period for running requests), cancels what is left and ends the thread within `stop_timeout` seconds."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.engine.start()
        yield
        state.engine.stop(stop_timeout)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", list_models, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={P.RequestError: _request_error, HTTPException: _http_error})
    app.state.kiln = state
    return app
