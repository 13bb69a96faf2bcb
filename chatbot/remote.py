"""A chat whose answers come from an OpenAI-compatible server (vLLM, SGLang, llama.cpp's
llama-server, ollama, `chatbot serve`): the interface the REPL uses from `ChatSession`, on a
list of messages.

The whole conversation is sent with every message; the server's prefix cache plays the part
of our persistent cache. Stats come from the stream: time to first token and the gaps
between chunks as they arrive here, token counts from the server's `usage` (asked for with
`stream_options.include_usage`) or, when it sends none, estimated as one token per chunk.
The HTTP work is the official `openai` client's (streaming, timeouts, error types).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

from chatbot.config import SamplingConfig
from chatbot.engine.stats import TurnStats, merge_stats, summarize
from chatbot.errors import ChatbotError, ConfigError
from chatbot.persist import SavedConversation, Turn, parse_saved, saved_dict
from chatbot.session_log import Event, LoggedSession

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 300.0  # a long prompt on a busy CPU server may take minutes to prefill
RETRIES = 2  # of idempotent calls (GET /v1/models) and of connections that never opened
BACKOFF_S = 0.5

ProgressCallback = Callable[[int, int], None]


class RemoteError(ChatbotError):
    """The server could not be reached or refused a request."""


@dataclass
class RemoteStats(TurnStats):
    """A turn's figures as seen from the client.

    `context_tokens` are the prompt tokens the server prefilled (its prompt less the
    `cached_tokens` its prefix cache reused); `estimated` says the counts are ours (one
    token per chunk), the server having sent no usage.
    """

    prompt_tokens: int = 0
    cached_tokens: int | None = None
    estimated: bool = False


@dataclass
class RemoteChunk:
    """A piece of a streamed answer (the shape of `GenerationChunk` the REPL reads)."""

    text: str
    finish_reason: str | None = None
    stats: RemoteStats | None = None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's own errors (httpx, or the fork newer openai releases use): a stream
    that breaks while it is read may raise them unwrapped."""
    package = sys.modules.get(openai.Timeout.__module__.split(".")[0])
    base = getattr(package, "HTTPError", None)
    stream = getattr(package, "StreamError", None)
    return tuple(e for e in (openai.OpenAIError, OSError, base, stream) if isinstance(e, type))


class RemoteBackend:
    """The server and the model on it.

    Args:
        base_url: the API root, e.g. http://127.0.0.1:8000/v1 (a missing /v1 is added).
        model: the model id (default: the first of GET /v1/models).
        api_key: sent as a bearer token (servers without keys ignore it).
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
    ) -> None:
        url = base_url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"--server {base_url!r}: expected an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1"
            )
        if not url.endswith("/v1"):
            url += "/v1"
        self.base_url = url
        self.client = openai.OpenAI(
            base_url=url,
            api_key=api_key or "none",
            timeout=openai.Timeout(read_timeout, connect=connect_timeout),
            max_retries=0,  # retries are ours: only of what is safe to repeat
        )
        self.transport_errors = _transport_errors()
        self.model = model
        self.server_models: list[dict[str, Any]] = []
        self.notes: list[str] = []

    @property
    def name(self) -> str:
        return self.model or "?"

    def connect(self) -> None:
        """Ask the server for its models and pick one; an unreachable server is a note, not
        an error (the chat starts and each message tries again).

        Raises:
            RemoteError: the server refused the API key, or has no model of that name.
        """
        try:
            models = self.list_models()
        except RemoteError as exc:
            if isinstance(exc.__cause__, openai.AuthenticationError):
                raise
            self.notes.append(f"warning: {exc}; each message tries again")
            return
        ids = [m["id"] for m in models]
        if self.model is None:
            if not ids:
                raise RemoteError(f"{self.base_url} lists no models; name one with --model")
            self.model = ids[0]
        elif ids and self.model not in ids:
            raise RemoteError(f"the server has no model {self.model!r}; it has: {', '.join(ids)}")

    def list_models(self) -> list[dict[str, Any]]:
        """GET /v1/models (retried with a short backoff: it is idempotent).

        Raises:
            RemoteError: unreachable, refused, or not an OpenAI-compatible answer.
        """
        last: BaseException | None = None
        for attempt in range(RETRIES + 1):
            try:
                page = self.client.models.list()
                self.server_models = [m.model_dump() for m in page.data]
                return self.server_models
            except openai.APIStatusError as exc:
                raise self.error(exc) from exc
            except self.transport_errors as exc:
                last = exc
                time.sleep(BACKOFF_S * (2**attempt))
        assert last is not None
        raise self.error(last) from last

    def error(self, exc: BaseException) -> RemoteError:
        """One line for what went wrong with a call."""
        if isinstance(exc, openai.AuthenticationError):
            return RemoteError(
                f"the server refused the API key (401); pass it with --api-key-env VAR ({_detail(exc)})"
            )
        if isinstance(exc, openai.NotFoundError):
            return RemoteError(f"not found (404): {_detail(exc)} (/model lists the server's models)")
        if isinstance(exc, openai.APIStatusError):
            kind = "server error" if exc.status_code >= 500 else "the server refused the request"
            return RemoteError(f"{kind} ({exc.status_code}): {_detail(exc)}")
        if isinstance(exc, openai.APITimeoutError):
            return RemoteError(f"the server at {self.base_url} did not answer in time")
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__ or exc
            return RemoteError(
                f"cannot reach the server at {self.base_url} ({type(cause).__name__}: {cause})"
            )
        if isinstance(exc, openai.APIError):
            return RemoteError(f"the server stopped the answer: {_detail(exc)}")
        return RemoteError(f"the connection to {self.base_url} broke ({type(exc).__name__}: {exc})")

    def describe(self) -> dict[str, str]:
        """What /model shows."""
        rows = {"server": self.base_url, "model": self.name}
        models = self.server_models
        if models:
            rows["models on the server"] = ", ".join(m["id"] for m in models)
            mine = next((m for m in models if m["id"] == self.model), None)
            limit = (mine or {}).get("max_model_len")
            if limit:
                rows["context limit"] = f"{limit:,} tokens"
        rows["cache"] = "the server's prefix cache (each message sends the whole conversation)"
        return rows

    @property
    def max_context(self) -> int | None:
        mine = next((m for m in self.server_models if m["id"] == self.model), None)
        limit = (mine or {}).get("max_model_len")
        return int(limit) if isinstance(limit, int) else None

    def stream(
        self,
        messages: list[ChatCompletionMessageParam],
        sampling: SamplingConfig,
        extra: dict[str, Any] | None = None,
    ) -> Iterator[Any]:
        """POST /v1/chat/completions with stream=true; yields the client's chunk objects.

        A connection that never opened is retried (nothing reached the server); an answer
        is never asked for twice. Closing the iterator closes the HTTP stream.

        Raises:
            RemoteError: as `error` words it.
        """
        if self.model is None:
            self.connect()
            if self.model is None:
                raise RemoteError(f"cannot reach the server at {self.base_url}")
        body = request_fields(sampling)
        body.update(extra or {})
        response = None
        for attempt in range(RETRIES + 1):
            try:
                response = self.client.chat.completions.create(
                    model=self.model,
                    messages=messages,
                    stream=True,
                    stream_options={"include_usage": True},
                    **body,
                )
                break
            except openai.APIConnectionError as exc:
                if attempt == RETRIES or not _never_connected(exc):
                    raise self.error(exc) from exc
                time.sleep(BACKOFF_S * (2**attempt))
            except openai.APIError as exc:
                raise self.error(exc) from exc
        assert response is not None
        try:
            yield from response
        except self.transport_errors as exc:
            if isinstance(exc, openai.APIError) and getattr(exc, "body", None) is not None:
                raise self.error(exc) from exc  # the server's own error event
            cause = exc.__cause__ or exc
            raise RemoteError(
                f"the connection to {self.base_url} broke during the answer "
                f"({type(cause).__name__}: {' '.join(str(cause).split())})"
            ) from exc
        finally:
            response.close()


def request_fields(sampling: SamplingConfig) -> dict[str, Any]:
    """The API's fields for our settings. top_k and repetition_penalty are not OpenAI's: they
    go as extra fields (vLLM, SGLang and chatbot serve read them) only when they are on."""
    body: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_new_tokens,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    extra: dict[str, Any] = {}
    if sampling.top_k > 0:
        extra["top_k"] = sampling.top_k
    if sampling.repetition_penalty != 1.0:
        extra["repetition_penalty"] = sampling.repetition_penalty
    if extra:
        body["extra_body"] = extra
    return body


def _never_connected(exc: BaseException) -> bool:
    cause = exc.__cause__
    return cause is not None and "Connect" in type(cause).__name__ and "Timeout" not in type(cause).__name__


def _detail(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
    text = str(getattr(exc, "message", "") or exc)
    return " ".join(text.split())[:300]


def remote_sampling(**overrides: Any) -> SamplingConfig:
    """Settings for a server's model: ours, with top-k and the repetition penalty off (so
    only the API's own fields are sent) unless asked for.

    Raises:
        ConfigError: a value is out of range.
    """
    values: dict[str, Any] = {"top_k": 0, "repetition_penalty": 1.0}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return dataclasses.replace(SamplingConfig(), **values).validated()


class RemoteSession(SavedConversation, LoggedSession):
    """The conversation as messages, answered by a server; the same methods as
    `ChatSession` where the REPL uses them.

    Args:
        backend: the server and model.
        system: the system prompt.
        sampling: the settings sent with each message.
    """

    def __init__(
        self, backend: RemoteBackend, system: str | None = None, sampling: SamplingConfig | None = None
    ) -> None:
        self.backend = backend
        self.system = system if system and system.strip() else None
        self.sampling = sampling or remote_sampling()
        self.turns: list[Turn] = []
        self.last_total_tokens = 0  # the conversation's length, from the last usage

    # -- state -----------------------------------------------------------------------------

    def messages(self) -> list[ChatCompletionMessageParam]:
        msgs: list[ChatCompletionMessageParam] = []
        if self.system:
            msgs.append({"role": "system", "content": self.system})
        for t in self.turns:
            msgs.append({"role": "user", "content": t.user})
            msgs.append({"role": "assistant", "content": t.answer})
        return msgs

    @property
    def conversation_tokens(self) -> int:
        return self.last_total_tokens

    @property
    def capacity(self) -> int:
        return self.backend.max_context or 0

    def summary(self) -> dict[str, Any]:
        return summarize([t.stats for t in self.turns], self.last_total_tokens)

    # -- a turn ------------------------------------------------------------------------------

    def send(self, text: str, sampling: SamplingConfig | None = None) -> Generator[RemoteChunk, None, None]:
        """Add a user message and stream the answer (see `ChatSession.send`).

        Raises:
            ChatbotError: an empty message.
            RemoteError: the server failed; an answer cut short is kept.
        """
        if not text.strip():
            raise ChatbotError("empty message")
        return self._logged(
            self._answer(Turn(text, "", RemoteStats()), sampling or self.sampling, new=True), text
        )

    def retry(self, sampling: SamplingConfig | None = None) -> Generator[RemoteChunk, None, None]:
        if not self.turns:
            raise ChatbotError("nothing to retry")
        return self._logged(self._answer(self.turns[-1], sampling or self.sampling, new=False), None)

    def can_continue(self) -> bool:
        t = self.turns[-1] if self.turns else None
        return t is not None and (t.interrupted or t.stats.finish_reason in ("length", "interrupted"))

    def continue_answer(self, sampling: SamplingConfig | None = None) -> Generator[RemoteChunk, None, None]:
        """Go on with the last answer: it is sent as the final assistant message with vLLM's
        `continue_final_message` (llama.cpp and ollama continue a final assistant message
        by themselves)."""
        if not self.turns:
            raise ChatbotError("nothing to continue")
        if not self.can_continue():
            raise ChatbotError("the last answer ended by itself; /retry asks for a new one")
        return self._logged(
            self._answer(self.turns[-1], sampling or self.sampling, new=False, extend=True), None
        )

    def _answer(
        self, turn: Turn, sampling: SamplingConfig, new: bool, extend: bool = False
    ) -> Generator[RemoteChunk, None, None]:
        history = self.messages() if new else self.messages()[:-2]
        messages: list[ChatCompletionMessageParam] = [*history, {"role": "user", "content": turn.user}]
        extra: dict[str, Any] | None = None
        before = turn.answer if extend else ""
        if extend:
            messages.append({"role": "assistant", "content": before})
            extra = {
                "extra_body": {
                    **request_fields(sampling).get("extra_body", {}),
                    "continue_final_message": True,
                    "add_generation_prompt": False,
                }
            }
        parts: list[str] = []
        t0 = time.perf_counter()
        arrivals: list[float] = []
        usage: Any = None
        finish: str | None = None
        done = False
        final: RemoteStats | None = None
        try:
            for chunk in self.backend.stream(messages, sampling, extra):
                now = time.perf_counter()
                if getattr(chunk, "usage", None) is not None:
                    usage = chunk.usage
                for choice in chunk.choices or ():
                    piece = choice.delta.content if choice.delta is not None else None
                    if piece:
                        arrivals.append(now)
                        parts.append(piece)
                        yield RemoteChunk(piece)
                    if choice.finish_reason:
                        finish = choice.finish_reason
            done = True
        finally:
            # Also on Ctrl-C (the stream is closed at once) and on errors: keep what came.
            if done or parts:
                final = _stats(t0, arrivals, usage, finish if done else "interrupted")
                if usage is not None:
                    self.last_total_tokens = int(getattr(usage, "total_tokens", 0) or 0)
                text = "".join(parts)
                turn.answer = before + text
                turn.stats = merge_stats(turn.stats, final) if extend else final
                turn.interrupted = not done
                if new:
                    self.turns.append(turn)
        assert final is not None
        yield RemoteChunk("", final.finish_reason, final)

    def undo(self) -> Turn:
        if not self.turns:
            raise ChatbotError("nothing to undo")
        turn = self.turns.pop()
        self._log(Event.UNDO)
        return turn

    def reset(self) -> None:
        self.turns = []
        self.last_total_tokens = 0
        self._log(Event.RESET)

    def set_system(self, text: str | None, on_progress: ProgressCallback | None = None) -> int:
        """Replace the system prompt; nothing is encoded here (the server does it with the
        next message). Returns 0."""
        self.system = text if text and text.strip() else None
        self._log(Event.SYSTEM, system=self.system)
        return 0

    def set_sampling(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling
        self._log(Event.SETTINGS, settings=sampling.as_dict())

    # -- saving and loading ------------------------------------------------------------------

    def to_dict(self, model: str | None = None) -> dict[str, Any]:
        data = saved_dict(self.system, self.sampling, self.messages(), self.turns, model)
        return {**data, "server": self.backend.base_url}

    def restore(
        self,
        data: Any,
        on_progress: ProgressCallback | None = None,
        encode: bool = True,
        warnings: list[str] | None = None,
    ) -> int:
        """Replace the conversation with saved data; nothing to encode here. Returns 0.

        Raises:
            ConfigError: the data is not a conversation (nothing is changed).
        """
        system, sampling, turns = parse_saved(data, self.sampling, warnings)
        self.system, self.turns, self.sampling = system, turns, sampling
        self.last_total_tokens = 0
        self._log(Event.LOAD, state=self.to_dict(self.model_name))
        return 0


def _stats(t0: float, arrivals: list[float], usage: Any, finish: str | None) -> RemoteStats:
    """Figures from the chunks' arrival times and the server's usage."""
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    ttft = arrivals[0] - t0 if arrivals else time.perf_counter() - t0
    stats = RemoteStats(
        ttft_s=ttft,
        context_time_s=ttft,
        token_latencies_s=gaps,
        decode_time_s=sum(gaps),
        finish_reason=finish or "stop",
    )
    if usage is not None:
        prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        stats.prompt_tokens = prompt
        stats.cached_tokens = int(cached) if cached is not None else None
        stats.context_tokens = prompt - (stats.cached_tokens or 0)
        stats.generated_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
        stats.cache_tokens = int(getattr(usage, "total_tokens", 0) or 0)
    else:
        stats.generated_tokens = len(arrivals)
        stats.estimated = True
    return stats
