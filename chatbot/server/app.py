"""The OpenAI-compatible HTTP API on FastAPI: /v1/chat/completions (server-sent events or one
JSON answer), /v1/completions (a raw prompt), /v1/models, /health.

One worker thread owns the engine and the prefix-cache pool: requests queue for it and are
answered one at a time (a CPU runs one generation at a time best), while the event loop
stays free for /health and new connections. A client that goes away stops its generation at
the next token; the partial answer stays in that conversation's cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import resource
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatbot.config import SamplingConfig
from chatbot.errors import ChatbotError, ConfigError, ContextFullError
from chatbot.server.pool import Conversation, PrefixCachePool

# How often a waiting handler checks whether its client is still there.
POLL_S = 0.25


# -- requests ---------------------------------------------------------------------------------


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """The fields both completion requests share; other fields are accepted and ignored, as
    vLLM does."""

    model_config = ConfigDict(extra="allow")
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None


class ChatRequest(_Request):
    """The fields of OpenAI's chat completion request we use; `top_k`, `repetition_penalty`,
    `cache_salt`, `continue_final_message` and `add_generation_prompt` as vLLM has them."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    cache_salt: str | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True


class CompletionRequest(_Request):
    """OpenAI's (legacy) text completion request: a raw prompt, no chat template."""

    prompt: str | list[str]
    max_tokens: int | None = 16  # the API's default
    echo: bool = False

    def text(self) -> str:
        """The one prompt.

        Raises:
            APIError: several prompts, or echo.
        """
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(400, "one prompt per request", param="prompt")
            return self.prompt[0]
        return self.prompt


class APIError(Exception):
    """An OpenAI-style error answer."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# -- the worker ---------------------------------------------------------------------------------


@dataclass
class Job:
    """One generation: what to answer, and where its events go."""

    conversation: Conversation | None  # None: a raw text completion of `prompt`
    sampling: SamplingConfig
    emit: Callable[[tuple[str, Any]], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    prompt: str = ""


class Worker:
    """The one thread that runs the engine: jobs in order, events back to the event loop.

    Events: ("text", str) for each piece of the answer, then ("done", usage dict with the
    finish reason), or ("error", APIError) when nothing could be generated.
    """

    def __init__(self, pool: PrefixCachePool) -> None:
        self.pool = pool
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.busy = False
        self.served = 0
        self.thread = threading.Thread(target=self._loop, name="chatbot-engine", daemon=True)
        self.thread.start()

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancel.is_set():  # the client left while it waited
                continue
            self.busy = True
            try:
                self._run(job)
            except Exception as exc:  # noqa: BLE001 - one request must not take the worker down
                job.emit(
                    ("error", APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))
                )
            finally:
                self.busy = False
                self.served += 1

    def _complete(self, job: Job) -> None:
        """A raw prompt on a fresh cache (no template, no prefix cache)."""
        engine = self.pool.engine
        ids = list(engine.tokenizer(job.prompt)["input_ids"])
        if not ids:
            job.emit(("error", APIError(400, "the prompt is empty", param="prompt")))
            return
        ec = self.pool.engine_config
        if ec.enable_streaming:
            from chatbot.engine.sink_cache import default_recent_size

            recent = ec.recent_size or default_recent_size(engine.max_context)
            cache = engine.new_cache(ec.start_size, recent)
        else:
            cache = engine.new_cache()
        generator = torch.Generator(device=engine.device)
        if job.sampling.seed is not None:
            generator.manual_seed(job.sampling.seed)
        eos = engine.tokenizer.eos_token_id
        chunks = engine.generate(
            cache,
            ids,
            job.sampling,
            stop_ids=[] if eos is None else [int(eos)],
            prefill_chunk=ec.prefill_chunk,
            generator=generator,
        )
        stats = None
        try:
            for chunk in chunks:
                if chunk.text:
                    job.emit(("text", chunk.text))
                stats = chunk.stats or stats
                if job.cancel.is_set():
                    return
        except ContextFullError as exc:
            job.emit(
                (
                    "error",
                    APIError(
                        400,
                        f"{exc}".split(":")[0] + ": the prompt does not fit the context",
                        param="prompt",
                        code="context_length_exceeded",
                    ),
                )
            )
            return
        finally:
            chunks.close()
        assert stats is not None
        job.emit(
            (
                "done",
                {
                    "finish_reason": "stop" if stats.finish_reason == "stop" else "length",
                    "prompt_tokens": len(ids),
                    "completion_tokens": stats.generated_tokens,
                    "cached_tokens": 0,
                },
            )
        )

    def _run(self, job: Job) -> None:
        conv = job.conversation
        if conv is None:
            self._complete(job)
            return
        try:
            entry = self.pool.checkout(conv)
        except ChatbotError as exc:
            job.emit(("error", APIError(400, str(exc))))
            return
        session = entry.session
        keep = True
        try:
            if conv.partial_answer is not None:
                session.turns[-1].interrupted = True  # lets continue_answer go on from it
                chunks = session.continue_answer(job.sampling)
            else:
                chunks = session.send(conv.user, job.sampling)
            if job.sampling.seed is not None:
                session.generator.manual_seed(job.sampling.seed)
            prompt_tokens = 0
            stats = None
            first = True
            try:
                for chunk in chunks:
                    if first:
                        # Only the prompt is in the cache yet (a token enters after it is shown).
                        prompt_tokens = len(session.cache_ids) + session.evicted_total
                        first = False
                    if chunk.text:
                        job.emit(("text", chunk.text))
                    stats = chunk.stats or stats
                    if job.cancel.is_set():
                        break
            finally:
                chunks.close()  # an answer cut short is kept in the session
            if job.cancel.is_set():
                return
            assert stats is not None
            cached = max(0, prompt_tokens - stats.context_tokens)
            finish = {"stop": "stop", "length": "length", "context": "length"}.get(
                stats.finish_reason, "stop"
            )
            job.emit(
                (
                    "done",
                    {
                        "finish_reason": finish,
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": stats.generated_tokens,
                        "cached_tokens": cached,
                        "prefill_s": stats.context_time_s,
                    },
                )
            )
        except ContextFullError as exc:
            job.emit(
                (
                    "error",
                    APIError(
                        400,
                        str(exc).split(":")[0] + ": the conversation does not fit the "
                        f"model's context ({self.pool.engine.max_context:,} tokens)",
                        param="messages",
                        code="context_length_exceeded",
                    ),
                )
            )
        except ChatbotError as exc:
            job.emit(("error", APIError(400, str(exc))))
        except BaseException:
            keep = False
            raise
        finally:
            if keep:
                self.pool.checkin(entry)
            else:
                self.pool.discard(entry)


# -- the app --------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """The server's resident set now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


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


def conversation_of(body: ChatRequest) -> Conversation:
    """System prompt, finished turns and the last message, from the request's messages.

    Raises:
        APIError: the messages do not alternate user and assistant after optional system
            messages, or the last one cannot be answered.
    """
    msgs = list(body.messages)
    system_parts = []
    while msgs and msgs[0].role in ("system", "developer"):
        system_parts.append(msgs.pop(0).text())
    system = "\n\n".join(p for p in system_parts if p) or None
    for i, m in enumerate(msgs):
        want = "user" if i % 2 == 0 else "assistant"
        if m.role != want:
            raise APIError(
                400,
                f"messages[{i + len(system_parts)}]: expected a {want} message, got {m.role} "
                "(after the system messages, user and assistant messages alternate)",
                param="messages",
            )
    if not msgs:
        raise APIError(400, "messages: no user message to answer", param="messages")
    pairs = [(msgs[i].text(), msgs[i + 1].text()) for i in range(0, len(msgs) - 1, 2)]
    last = msgs[-1]
    if last.role == "assistant":
        if not body.continue_final_message:
            raise APIError(
                400,
                "the last message is the assistant's; set continue_final_message to go on with it",
                param="messages",
            )
        return Conversation(system, pairs, pairs[-1][0], partial_answer=pairs[-1][1], salt=body.cache_salt)
    if body.continue_final_message:
        raise APIError(400, "continue_final_message needs an assistant message last", param="messages")
    if not last.text().strip():
        raise APIError(400, "the last user message is empty", param="messages")
    return Conversation(system, pairs, last.text(), salt=body.cache_salt)


def sampling_of(
    body: ChatRequest | CompletionRequest, base: SamplingConfig, max_context: int | None
) -> SamplingConfig:
    """The request's sampling settings over the server's defaults.

    Raises:
        APIError: a value out of range, or a field we do not support.
    """
    if body.n != 1:
        raise APIError(400, "n must be 1 (one answer per request)", param="n")
    if body.stop:
        raise APIError(
            400, "stop strings are not supported; the answer ends at the model's end of turn", param="stop"
        )
    sampling = base
    max_tokens = getattr(body, "max_completion_tokens", None)
    max_tokens = max_tokens if max_tokens is not None else body.max_tokens
    fields = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "repetition_penalty": body.repetition_penalty,
        "max_new_tokens": max_tokens,
        "seed": body.seed,
    }
    for key, value in fields.items():
        if value is None:
            continue
        param = "max_tokens" if key == "max_new_tokens" else key
        try:
            sampling = sampling.with_value(key, value)
        except ConfigError as exc:
            raise APIError(400, str(exc).replace("max_new_tokens", "max_tokens"), param=param) from None
    if max_context is not None and sampling.max_new_tokens >= max_context:
        raise APIError(
            400,
            f"max_tokens must be less than the context ({max_context:,} tokens), "
            f"got {sampling.max_new_tokens:,}",
            param="max_tokens",
        )
    return sampling


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    """Run the app with uvicorn until Ctrl-C."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2)
