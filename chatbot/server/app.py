"""The OpenAI-compatible HTTP API on FastAPI: /v1/chat/completions (server-sent events or one
JSON answer), /v1/completions (a raw prompt), /v1/models, /health.

One worker thread owns the engine and the prefix-cache pool: requests queue for it and are
answered one at a time (a CPU runs one generation at a time best), while the event loop
stays free for /health and new connections. A client that goes away stops its generation at
the next token; the partial answer stays in that conversation's cache.

Routes and streaming are here; the request models and their checks are in `protocol`, the
worker thread in `worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatbot.engine.stats import peak_rss_bytes
from chatbot.server.pool import PrefixCachePool
from chatbot.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    conversation_of,
    sampling_of,
)
from chatbot.server.worker import Job, Worker

# How often a waiting handler checks whether its client is still there.
POLL_S = 0.25


# -- the app --------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """The server's resident set now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def create_app(
    pool: PrefixCachePool,
    model_name: str,
    api_key: str | None = None,
    streaming_cache: bool = False,
    created: int | None = None,
) -> FastAPI:
    """The ASGI app serving `pool`'s engine as `model_name`.

    Args:
        pool: the prefix-cache pool (it owns the engine).
        model_name: the id clients ask for.
        api_key: when set, /v1 needs `Authorization: Bearer <api_key>`.
        streaming_cache: conversations run on sink caches (no context limit).
    """
    created = created or int(time.time())
    max_context = pool.engine.max_context
    worker = Worker(pool)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        worker.stop()

    app = FastAPI(title="chatbot", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.pool = pool

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        else:
            where = ".".join(loc) or "body"
            message = f"{where}: {first.get('msg', 'invalid value')}"
            if first.get("type") == "literal_error" and loc and loc[-1] == "role":
                message = f"{where}: unknown role {first.get('input')!r} (use system, user or assistant)"
        return APIError(400, message, param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Any:
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), api_key.encode()
            ):
                return APIError(
                    401,
                    "invalid or missing API key (send Authorization: Bearer KEY)",
                    "authentication_error",
                    code="invalid_api_key",
                ).response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_name,
            "concurrency": 1,
            "note": "one generation at a time; other requests queue",
            "generating": worker.busy,
            "queued": worker.queued,
            "served": worker.served,
            "context": None if streaming_cache else max_context,
            "streaming_cache": streaming_cache,
            "prefix_cache": pool.describe(),
            "rss_bytes": rss_bytes(),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "chatbot",
                    "max_model_len": None if streaming_cache else max_context,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        if body.model != model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server has {model_name!r}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        conv = conversation_of(body)
        sampling = sampling_of(body, pool.sampling, None if streaming_cache else max_context)
        return await answer(
            request, Job(conv, sampling, _nowhere), body.stream, body.stream_options, chat=True
        )

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: Request) -> Any:
        if body.model != model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server has {model_name!r}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        prompt = body.text()
        sampling = sampling_of(body, pool.sampling, None if streaming_cache else max_context)
        return await answer(
            request,
            Job(None, sampling, _nowhere, prompt=prompt),
            body.stream,
            body.stream_options,
            chat=False,
        )

    async def answer(
        request: Request, job: Job, stream: bool, options: StreamOptions | None, chat: bool
    ) -> Any:
        """Queue the job; answer with server-sent events or one JSON object."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def emit(event: tuple[str, Any]) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        job.emit = emit
        worker.submit(job)
        # Until the response starts, a task of ours waits for the client to go away (a
        # streamed response then listens for that itself).
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            # Wait for the first event (the request may queue behind others): an error before
            # any text is still an HTTP status.
            first = await _next_event(events, job)
            if first is None:
                return JSONResponse({}, status_code=499)
            if first[0] == "error":
                raise first[1]
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            if stream:
                await _stop(watcher)
                include_usage = bool(options and options.include_usage)
                return StreamingResponse(
                    _sse(first, events, job, rid, include_usage, chat),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            text: list[str] = []
            event: tuple[str, Any] | None = first
            while event is not None and event[0] == "text":
                text.append(event[1])
                event = await _next_event(events, job)
        finally:
            await _stop(watcher)
        if event is None:
            return JSONResponse({}, status_code=499)
        if event[0] == "error":
            raise event[1]
        done = event[1]
        if not chat:
            return {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(text),
                        "finish_reason": done["finish_reason"],
                        "logprobs": None,
                    }
                ],
                "usage": _usage(done),
            }
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(text)},
                    "finish_reason": done["finish_reason"],
                    "logprobs": None,
                }
            ],
            "usage": _usage(done),
        }

    async def _sse(
        first: tuple[str, Any],
        events: asyncio.Queue[tuple[str, Any]],
        job: Job,
        rid: str,
        include_usage: bool,
        chat: bool,
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            choice.update({"delta": delta} if chat else {"text": delta.get("content", "")})
            return _data(
                {
                    "id": rid,
                    "object": kind,
                    "created": int(time.time()),
                    "model": model_name,
                    "choices": [choice],
                }
            )

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            event: tuple[str, Any] | None = first
            while event is not None and event[0] == "text":
                yield chunk({"content": event[1]})
                event = await _next_event(events, job)
            if event is None:
                return
            if event[0] == "error":
                yield _data(event[1].body())  # the openai client raises it as an APIError
                return
            done = event[1]
            yield chunk({}, done["finish_reason"])
            if include_usage:
                yield _data(
                    {
                        "id": rid,
                        "object": kind,
                        "created": int(time.time()),
                        "model": model_name,
                        "choices": [],
                        "usage": _usage(done),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # a no-op when the answer is complete; stops it when the client left

    return app


def _nowhere(event: tuple[str, Any]) -> None:
    """A job's events before `answer` connects them (never called)."""


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(done: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_tokens": done["prompt_tokens"],
        "completion_tokens": done["completion_tokens"],
        "total_tokens": done["prompt_tokens"] + done["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": done["cached_tokens"]},
    }


async def _next_event(events: asyncio.Queue[tuple[str, Any]], job: Job) -> tuple[str, Any] | None:
    """The job's next event; None when it was cancelled (the client has gone)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), POLL_S)
        except asyncio.TimeoutError:
            if job.cancel.is_set():
                return None


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects (the request body is already read, so
    the next message from the server is the disconnect)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            job.cancel.set()
            return


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    """Run the app with uvicorn until Ctrl-C."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
