"""The OpenAI-compatible HTTP API on FastAPI: /v1/chat/completions (server-sent events or one
JSON answer), /v1/completions (a raw prompt), /v1/models, /health.

The worker (`worker`) owns the engine and the prefix-cache pool: requests queue for it and
are answered one at a time, or with the native kernels several at once in batched decode
steps, while the event loop stays free for /health and new connections. A client that goes
away stops its generation at the next token; the partial answer stays in that
conversation's cache.

Routes and streaming are here; the request models and their checks are in `protocol`, the
worker thread in `worker`.

A request is checked before it costs the worker anything: its body is read against a size cap
(413), its text must decode (400), and a prompt that cannot fit the context by its length
alone is refused without being tokenized (400); none of these touch the prefix-cache pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatbot.config import SamplingConfig
from chatbot.engine.stats import rss_bytes
from chatbot.models.templates import thinking_switch
from chatbot.server.body_limit import BodyLimit, default_max_body  # also re-exported
from chatbot.server.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from chatbot.server.pool import PrefixCachePool
from chatbot.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    PromptBound,
    StreamOptions,
    check_format,
    conversation_of,
    sampling_of,
)
from chatbot.server.slots import Slots
from chatbot.server.tools import CallStream, ToolError, Tools, chat_message, tool_prompt
from chatbot.server.worker import Job, Worker
from chatbot.settings import layer

# How often a waiting handler checks whether its client is still there.
POLL_S = 0.25
# How long a shutdown waits for the answers under way to end (they end within POLL_S of it)
# and then for the engine's threads to finish their step.
SHUTDOWN_WAIT_S = 5

# -- the app --------------------------------------------------------------------------------------


def create_app(
    pool: PrefixCachePool,
    model_name: str,
    api_key: str | None = None,
    streaming_cache: bool = False,
    created: int | None = None,
    max_body: int | None = None,
    defaults_from: str | None = None,
    slot_folder: Path | None = None,
) -> FastAPI:
    """The ASGI app serving `pool`'s engine as `model_name`: the routes of `OpenAIApi.routes`,
    the error handlers of `EXCEPTION_HANDLERS`, the body cap and the key check.

    Args:
        pool: the prefix-cache pool (it owns the engine).
        model_name: the id clients ask for.
        api_key: when set, /v1 needs `Authorization: Bearer <api_key>`.
        streaming_cache: conversations run on sink caches (no context limit).
        max_body: cap on a request body in bytes (default: `default_max_body`).
        defaults_from: where the pool's sampling defaults come from, for /health.
        slot_folder: `--slot-save-path`, where /slots saves and restores (`Slots`).
    """
    created = created or int(time.time())
    max_body = max_body or default_max_body(pool.engine.max_context)
    api = OpenAIApi(pool, model_name, api_key, streaming_cache, created, max_body, defaults_from, slot_folder)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        api.closing.set()
        await asyncio.to_thread(api.worker.stop, wait_s=SHUTDOWN_WAIT_S)

    app = FastAPI(title="chatbot", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = api.worker
    app.state.closing = api.closing
    app.state.pool = pool
    app.state.max_body = max_body
    # Added before the key check, so inside it: a request without the key is refused unread.
    app.add_middleware(BodyLimit, max_bytes=max_body)
    for exc_type, handler in EXCEPTION_HANDLERS.items():
        app.exception_handler(exc_type)(handler)
    app.middleware("http")(api.check_key)
    for path, (method, endpoint) in api.routes().items():
        checks = [Depends(require_json)] if method == "POST" else None
        app.api_route(path, methods=[method], dependencies=checks)(endpoint)
    return app


def require_json(request: Request) -> None:
    """A POST body must come as JSON (`application/json`, or a `+json` type), as vLLM asks.

    The types a web page may send to another site without asking first (a form, text/plain,
    none at all) are the ones refused: read as JSON, they would let any page a browser opens
    run generations on a server on localhost (FastAPI's strict_content_type, for the same
    reason).

    Raises:
        APIError: 415, naming the type sent and how to send JSON.
    """
    sent = request.headers.get("content-type", "")
    media = sent.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    what = f"not {sent!r}" if sent else "and this request has none"
    curl = "curl -d sends that: add" if media == "application/x-www-form-urlencoded" else "curl:"
    raise APIError(
        415,
        f"the body must be JSON sent with Content-Type: application/json, {what} "
        f"({curl} -H 'Content-Type: application/json'; in Python, json=... rather than data=...)",
        code="unsupported_media_type",
    )


async def api_error_response(_: Request, exc: APIError) -> JSONResponse:
    """Our own errors, as OpenAI words them."""
    return exc.response()


async def validation_error_response(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that fails the request models: a 400 naming the field (malformed JSON: its error)."""
    errors = exc.errors()
    # The deepest error: in a union (content: a string or a list of parts) the branch that
    # got furthest, not the first branch's "should be a valid string".
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    # The field's path, without pydantic's names for the branches of a union ("str",
    # "function-after[_encodable(), str]", "list[ContentPart]").
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_branch(p)]
    if first.get("type") == "json_invalid":
        message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        return APIError(400, message).response()  # its loc is a character offset, no field
    else:
        where = ".".join(loc) or "body"
        message = f"{where}: {str(first.get('msg', 'invalid value')).removeprefix('Value error, ')}"
        if first.get("type") == "literal_error" and loc and loc[-1] == "role":
            message = f"{where}: unknown role {first.get('input')!r} (use system, user, assistant or tool)"
    return APIError(400, message, param=".".join(loc) or None).response()


async def http_error_response(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's errors (an unknown path or method) in OpenAI's shape and words."""
    message = str(exc.detail)
    if exc.status_code in (404, 405):  # OpenAI's words for a path it does not serve
        message = f"Invalid URL ({request.method} {request.url.path})"
    return APIError(exc.status_code, message).response()


EXCEPTION_HANDLERS: dict[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]] = {
    APIError: api_error_response,
    RequestValidationError: validation_error_response,
    StarletteHTTPException: http_error_response,
}
"""The app's error handlers, by the exception they answer."""


class OpenAIApi:
    """The routes' handlers and what they share: the pool, its worker thread, the model card
    and the limits a request is checked against.

    Args: as `create_app`'s (`created` and `max_body` resolved).
    """

    def __init__(
        self,
        pool: PrefixCachePool,
        model_name: str,
        api_key: str | None,
        streaming_cache: bool,
        created: int,
        max_body: int,
        defaults_from: str | None,
        slot_folder: Path | None = None,
    ) -> None:
        self.pool, self.model_name, self.api_key = pool, model_name, api_key
        self.streaming_cache, self.max_body, self.defaults_from = streaming_cache, max_body, defaults_from
        self.max_context = pool.engine.max_context
        self.bound = PromptBound.of(pool.engine.tokenizer, None if streaming_cache else self.max_context)
        self.worker = Worker(pool)
        self.slots = Slots(pool, self.worker, slot_folder)
        # Set as the server begins to shut down (a signal): answers under way end with an error
        # event, queued ones with a 503, so no response is left for uvicorn to cancel.
        self.closing = threading.Event()
        self.batcher = None if self.worker.batched is None else self.worker.batched.batcher
        self.model_card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "chatbot",
            "max_model_len": None if streaming_cache else self.max_context,
            # how a request steers the model's thinking (this server's own field): the template's
            # switch (enable_thinking, reasoning_effort or none) and the default budget
            "thinking": {
                "switch": thinking_switch(getattr(pool.engine.tokenizer, "chat_template", None)),
                "think_budget": pool.sampling.think_budget,
            },
        }

    def routes(self) -> dict[str, tuple[str, Callable[..., Awaitable[Any]]]]:
        """The API: path -> (HTTP method, handler)."""
        return {
            "/health": ("GET", self.health),
            "/v1/models": ("GET", self.models),
            "/v1/models/{model_id:path}": ("GET", self.model),
            "/v1/chat/completions": ("POST", self.chat),
            "/v1/completions": ("POST", self.complete),
            "/slots": ("GET", self.slots.listing),
            "/slots/{slot_id}": ("POST", self.slots.action),
        }

    async def check_key(self, request: Request, call_next: Any) -> Any:
        """HTTP middleware: with an API key set, a /v1 request without it is a 401."""
        api_key = self.api_key
        if api_key and request.url.path.startswith(("/v1", "/slots")):
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), api_key.encode()
            ):
                return APIError(
                    401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key"
                ).response()
        return await call_next(request)

    async def health(self) -> dict[str, Any]:
        worker, batcher = self.worker, self.batcher
        return {
            "status": "ok",
            "model": self.model_name,
            "concurrency": worker.slots,
            "note": worker.describe(),
            "generating": worker.busy,
            "batched_steps": None if batcher is None else {"steps": batcher.steps, "rows": batcher.rows},
            "queued": worker.queued,
            "served": worker.served,
            "context": None if self.streaming_cache else self.max_context,
            "streaming_cache": self.streaming_cache,
            "prefix_cache": self.pool.describe(),
            "max_body_bytes": self.max_body,
            "rss_bytes": rss_bytes(),
            # What a request that leaves them out gets (the model's preset and generation
            # config, then the serve flags); see `sampling_of`.
            "sampling_defaults": {**_defaults(self.pool), "from": self.defaults_from},
        }

    def check_model(self, name: str, param: str | None = "model") -> None:
        """Raises: APIError: 404, `name` is not the model served."""
        if name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server has {self.model_name!r}",
                param=param,
                code="model_not_found",
            )

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card]}

    async def model(self, model_id: str) -> dict[str, Any]:
        self.check_model(model_id, None)
        return self.model_card

    def sampling_of(self, body: ChatRequest | CompletionRequest) -> SamplingConfig:
        limit, drafts = None if self.streaming_cache else self.max_context, self.pool.engine.draft_model
        return sampling_of(body, self.pool.sampling, limit, draft_model=drafts is not None)

    async def chat(self, body: ChatRequest, request: Request) -> Any:
        self.check_model(body.model)
        if (
            body.tools
            or body.tool_choice not in (None, "none")
            or any(m.role == "tool" or m.tool_calls for m in body.messages)
        ):
            return await self.chat_with_tools(body, request)
        conv = conversation_of(body)
        sampling = self.sampling_of(body)
        job = Job(
            conv, sampling, _nowhere, stops=body.stop_strings(), logprobs=body.top_logprobs_wanted(), n=body.n
        )
        self.bound.check_conversation(conv)
        if sampling.output_format is not None:  # a schema the engine cannot take never queues
            await asyncio.to_thread(check_format, self.pool.engine.tokenizer, sampling.output_format)
        return await self.answer(request, job, body.stream, body.stream_options, chat=True)

    async def chat_with_tools(self, body: ChatRequest, request: Request) -> Any:
        """A conversation with tools (or tool results): the whole message list rendered by the
        template on a fresh cache (not the prefix cache), the calls read from the answer."""
        tokenizer = self.pool.engine.tokenizer
        try:
            tools = Tools.of(body.tools, body.tool_choice)
            prompt = tool_prompt(tokenizer, list(body.messages), tools)
        except ToolError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        sampling = self.sampling_of(body)
        if tools is not None and tools.forced:
            if sampling.output_format is not None:
                raise APIError(
                    400, "tool_choice: a forced call takes no response_format", param="tool_choice"
                )
            prompt, call_format = tools.forced_call(prompt)
            sampling = dataclasses.replace(sampling, output_format=call_format)
        if sampling.output_format is not None:
            param = "tools" if tools is not None and tools.forced else "response_format"
            await asyncio.to_thread(check_format, tokenizer, sampling.output_format, param)
        job = Job(None, sampling, _nowhere, prompt=prompt, stops=body.stop_strings(), n=body.n)
        job.templated, job.tools = True, tools
        job.logprobs = body.top_logprobs_wanted()
        self.bound.check_prompt(prompt)
        return await self.answer(request, job, body.stream, body.stream_options, chat=True)

    async def complete(self, body: CompletionRequest, request: Request) -> Any:
        self.check_model(body.model)
        prompt = body.text()
        sampling = self.sampling_of(body)
        job = Job(
            None,
            sampling,
            _nowhere,
            prompt=prompt,
            stops=body.stop_strings(),
            logprobs=body.top_logprobs_wanted(),
            n=body.n,
        )
        self.bound.check_prompt(prompt)
        return await self.answer(request, job, body.stream, body.stream_options, chat=False)

    async def answer(
        self, request: Request, job: Job, stream: bool, options: StreamOptions | None, chat: bool
    ) -> Any:
        """Queue the job; answer with server-sent events or one JSON object."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def emit(event: tuple[str, Any]) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        job.emit = emit
        self.worker.submit(job)
        # Until the response starts, a task of ours waits for the client to go away (a
        # streamed response then listens for that itself).
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            # Wait for the first event (the request may queue behind others): an error before
            # any text is still an HTTP status.
            first = await _next_event(events, job, self.closing)
            if first is None:
                return JSONResponse({}, status_code=499)
            if first[0] == "error":
                raise first[1]
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            if stream:
                await _stop(watcher)
                include_usage = bool(options and options.include_usage)
                return StreamingResponse(
                    self._sse(first, events, job, rid, include_usage, chat),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            texts, entries, finishes, event, thoughts = await _collect(first, events, job, self.closing)
        finally:
            await _stop(watcher)
        if event is None:
            return JSONResponse({}, status_code=499)
        if event[0] == "error":
            raise event[1]
        done = event[1]
        choices = []
        for i in range(job.n):
            choice: dict[str, Any] = {"index": i, "finish_reason": finishes.get(i, done["finish_reason"])}
            if chat:
                text, thought = "".join(texts[i]), "".join(thoughts[i])
                choice["message"], called = chat_message(text, thought, job.tools, job.calls.get(i))
                if called:
                    choice["finish_reason"] = "tool_calls"
                choice["logprobs"] = None if job.logprobs is None else chat_logprobs(entries[i])
            else:
                choice["text"] = "".join(texts[i])
                choice["logprobs"] = None if job.logprobs is None else completion_logprobs(entries[i])
            choices.append(choice)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(done),
        }

    async def _sse(
        self,
        first: tuple[str, Any],
        events: asyncio.Queue[tuple[str, Any]],
        job: Job,
        rid: str,
        include_usage: bool,
        chat: bool,
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        offsets = [0] * job.n  # of each chunk's text in its answer (a completion's text_offset)

        def chunk(
            delta: dict[str, Any], finish: str | None = None, entries: Any = None, index: int = 0
        ) -> str:
            logprobs = None
            if job.logprobs is not None and entries is not None:
                logprobs = chat_logprobs(entries) if chat else completion_logprobs(entries, offsets[index])
            offsets[index] += len(delta.get("content", ""))
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
            choice.update({"delta": delta} if chat else {"text": delta.get("content", "")})
            return _data(
                {
                    "id": rid,
                    "object": kind,
                    "created": int(time.time()),
                    "model": self.model_name,
                    "choices": [choice],
                }
            )

        try:
            if chat:
                for i in range(job.n):
                    yield chunk({"role": "assistant", "content": ""}, index=i)
            event: tuple[str, Any] | None = first
            calls = [CallStream() for _ in range(job.n)] if job.tools is not None else None
            while event is not None and event[0] in ("text", "finish"):
                if event[0] == "finish":
                    index, finish = event[1]
                    if calls is not None:  # the text held back: shown now, or read as calls
                        rest, made = calls[index].finish(job.calls.get(index))
                        if rest:
                            yield chunk({"content": rest}, index=index)
                        if made:
                            yield chunk({"tool_calls": [c.api(k) for k, c in enumerate(made)]}, index=index)
                            finish = "tool_calls"
                    yield chunk({}, finish, index=index)
                else:
                    piece, tokens, index, thought = event[1]
                    if thought:
                        yield chunk({"reasoning_content": thought}, index=index)
                    if calls is not None:
                        piece = calls[index].feed(piece)
                    if piece or tokens or not thought:
                        yield chunk({"content": piece}, entries=tokens, index=index)
                event = await _next_event(events, job, self.closing)
            if event is None:
                return
            if event[0] == "error":
                yield _data(event[1].body())  # the openai client raises it as an APIError
                return
            done = event[1]
            if include_usage:
                yield _data(
                    {
                        "id": rid,
                        "object": kind,
                        "created": int(time.time()),
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage(done),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # a no-op when the answer is complete; stops it when the client left


def _defaults(pool: PrefixCachePool) -> dict[str, Any]:
    return {
        row.request: getattr(pool.sampling, row.name)
        for row in layer("sampling")
        if row.request is not None and row.name != "seed"
    }


def _union_branch(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none"))


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


async def _collect(
    first: tuple[str, Any], events: asyncio.Queue[tuple[str, Any]], job: Job, closing: threading.Event
) -> tuple[
    list[list[str]], list[list[TokenLogprob]], dict[int, str], tuple[str, Any] | None, list[list[str]]
]:
    """A job's answers gathered from its events: each answer's pieces of text and logprobs,
    the finish reasons by answer, and the event that ended them ("done", "error", or None
    when the client went away), and each answer's thinking (sent apart)."""
    texts: list[list[str]] = [[] for _ in range(job.n)]
    thoughts: list[list[str]] = [[] for _ in range(job.n)]
    entries: list[list[TokenLogprob]] = [[] for _ in range(job.n)]
    finishes: dict[int, str] = {}
    event: tuple[str, Any] | None = first
    while event is not None and event[0] in ("text", "finish"):
        if event[0] == "finish":
            finishes[event[1][0]] = event[1][1]
        else:
            piece, tokens, index, thought = event[1]
            texts[index].append(piece)
            thoughts[index].append(thought)
            entries[index] += tokens
        event = await _next_event(events, job, closing)
    return texts, entries, finishes, event, thoughts


async def _next_event(
    events: asyncio.Queue[tuple[str, Any]], job: Job, closing: threading.Event
) -> tuple[str, Any] | None:
    """The job's next event; None when it was cancelled (the client has gone); an error
    event (503) once the server is shutting down, the job then cancelled."""
    while True:
        if closing.is_set():
            job.cancel.set()
            return ("error", APIError(503, "the server is shutting down", "server_error"))
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


def serve(app: FastAPI, sockets: list[socket.socket], log_level: str = "warning") -> None:
    """Run the app with uvicorn on listening `sockets` (bound before the model loaded) until
    Ctrl-C or SIGTERM, which shut it down the same way: the answers under way end at once
    with an error event (`OpenAIApi.closing`), the engine's threads stop, then the process
    ends by the signal (130 after Ctrl-C)."""
    import uvicorn

    closing: threading.Event = app.state.closing

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            closing.set()  # in the event loop's thread (signal handlers run in the main one)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_WAIT_S)
    Server(config).run(sockets=sockets)
