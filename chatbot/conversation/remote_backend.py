"""The client of an OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server, ollama,
llama-cpp-python, `chatbot serve`): `RemoteBackend` finds the API root and the model, streams
chat completions, words the server's and the connection's failures as one `RemoteError`, and
finds how the server goes on with an answer (/continue). The HTTP work is the official
`openai` client's (streaming, timeouts, error types); the conversation is `RemoteSession`'s
(chatbot/conversation/remote.py).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Generator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import openai
from openai.types.chat import ChatCompletionMessageParam

from chatbot.config import SamplingConfig
from chatbot.errors import ChatbotError, ConfigError
from chatbot.settings import layer

__all__ = ["RemoteBackend", "RemoteError", "api_roots", "request_fields"]

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 300.0  # a long prompt on a busy CPU server may take minutes to prefill
RETRIES = 2  # of idempotent calls (GET /v1/models) and of connections that never opened
BACKOFF_S = 0.5


class RemoteError(ChatbotError):
    """The server could not be reached or refused a request."""


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's own errors (httpx, or the fork newer openai releases use): a stream
    that breaks while it is read may raise them unwrapped."""
    package = sys.modules.get(openai.Timeout.__module__.split(".")[0])
    base = getattr(package, "HTTPError", None)
    stream = getattr(package, "StreamError", None)
    return tuple(e for e in (openai.OpenAIError, OSError, base, stream) if isinstance(e, type))


class RemoteBackend:
    """The server and the model on it.

    The URL is normalised to the API root (`api_roots`): a trailing slash and an endpoint
    (/chat/completions, /completions, /models) are dropped; a root that ends in a version
    (/v1, /v2, /api/v1) is taken as given, any other is tried with /v1 added, then as given.
    The first that answers GET models is kept.

    Args:
        base_url: the server, e.g. http://127.0.0.1:8000/v1 or http://127.0.0.1:8000.
        model: the model id (default: the first of GET /v1/models).
        api_key: sent as a bearer token (servers without keys ignore it).
        api_key_env: the environment variable the key came from (named when it is refused).
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
        api_key_env: str | None = None,
    ) -> None:
        self.roots = api_roots(base_url)
        self.api_key, self.api_key_env = api_key, api_key_env
        self.timeout = openai.Timeout(read_timeout, connect=connect_timeout)
        self.transport_errors = _transport_errors()
        self.model = model
        self.server_models: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.resolved = len(self.roots) == 1
        self._use(self.roots[0])
        self._continue_method: str | None = None
        self.continue_noted = False  # the note on how /continue works here was shown

    def _use(self, url: str) -> None:
        self.base_url = url
        self.client = openai.OpenAI(
            base_url=url,
            api_key=self.api_key or "none",
            timeout=self.timeout,
            max_retries=0,  # retries are ours: only of what is safe to repeat
        )

    @property
    def name(self) -> str:
        return self.model or "?"

    def connect(self, strict: bool = False) -> None:
        """Ask the server for its models and pick one. An unreachable server is a note, not
        an error (the chat starts and each message tries again), unless `strict`.

        Raises:
            RemoteError: the server refused the API key, has no OpenAI API at the URL, has no
                model of that name, or (with `strict`) cannot be reached.
        """
        try:
            models = self.list_models()
        except RemoteError as exc:
            refused = (openai.AuthenticationError, openai.NotFoundError, ValueError)
            if strict or isinstance(exc.__cause__, refused):
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
        """GET models (retried with a short backoff: it is idempotent). Until one has
        answered, each candidate API root is tried in turn; the first that answers is kept.

        Raises:
            RemoteError: unreachable, refused, or no OpenAI API at any candidate root.
        """
        if self.resolved:
            return self._list_models()
        missing: RemoteError | None = None
        for url in self.roots:
            self._use(url)
            try:
                models = self._list_models()
            except RemoteError as exc:
                if not isinstance(exc.__cause__, openai.NotFoundError | ValueError | TypeError):
                    self._use(self.roots[0])
                    raise
                missing = missing or exc
                continue
            self.resolved = True
            return models
        self._use(self.roots[0])
        assert missing is not None
        tried = " or ".join(self.roots)
        raise RemoteError(
            f"no OpenAI API at {tried} (GET models: 404); give the API root, e.g. http://host:port/v1"
        ) from missing.__cause__

    def _list_models(self) -> list[dict[str, Any]]:
        last: BaseException | None = None
        for attempt in range(RETRIES + 1):
            try:
                page = self.client.models.list()
                models = [m.model_dump() for m in page.data]
                if not all(isinstance(m.get("id"), str) for m in models):
                    raise ValueError("a model without an id")
                self.server_models = models
                return models
            except openai.NotFoundError as exc:
                raise RemoteError(
                    f"no OpenAI API at {self.base_url} (GET {self.base_url}/models: 404); "
                    "give the API root, e.g. http://host:port/v1"
                ) from exc
            except openai.APIStatusError as exc:
                raise self.error(exc) from exc
            except (ValueError, TypeError, AttributeError) as exc:  # a 200 that is not an API's answer
                raise RemoteError(
                    f"no OpenAI API at {self.base_url} (GET {self.base_url}/models did not list models)"
                ) from ValueError(str(exc))
            except self.transport_errors as exc:
                last = exc
                time.sleep(BACKOFF_S * (2**attempt))
        assert last is not None
        raise self.error(last) from last

    def error(self, exc: BaseException) -> RemoteError:
        """One line for what went wrong with a call."""
        if isinstance(exc, openai.AuthenticationError):
            if self.api_key is not None:
                var = f" in {self.api_key_env}" if self.api_key_env else ""
                return RemoteError(f"the server refused the API key{var} (401): {_detail(exc)}")
            return RemoteError(
                f"the server wants an API key (401): {_detail(exc)}; "
                "put it in an environment variable and pass --api-key-env VAR"
            )
        if isinstance(exc, openai.NotFoundError):
            return RemoteError(f"not found (404) at {self.base_url}: {_detail(exc)}")
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
        if self.max_context:
            rows["context limit"] = f"{self.max_context:,} tokens"
        rows["cache"] = "the server's prefix cache (each message sends the whole conversation)"
        if self._continue_method is not None:
            rows["/continue"] = CONTINUE_METHODS[self._continue_method]
        return rows

    @property
    def max_context(self) -> int | None:
        mine = next((m for m in self.server_models if m["id"] == self.model), None)
        limit = (mine or {}).get("max_model_len")
        return int(limit) if isinstance(limit, int) else None

    def _ready(self) -> str:
        if self.model is None:
            self.connect()
            if self.model is None:
                raise RemoteError(f"cannot reach the server at {self.base_url}")
        return self.model

    def continue_method(self) -> str:
        """How this server goes on with an answer: "final-message" (the answer so far is sent
        as the last, open assistant message) or "prompt" (a user message asks for the rest).
        Found once per server by `_probe_continue`."""
        if self._continue_method is None:
            self._continue_method = self._probe_continue()
        return self._continue_method

    def _probe_continue(self) -> str:
        """Three requests of one token each, compared by the prompt tokens the server counts:
        a short answer sent as the final assistant message with `continue_final_message`
        (A), the same without it (B), and the conversation without that answer (C).

        A server that honours the field renders A open (A < B: vLLM, SGLang, chatbot serve).
        One that ignores it renders A as B: a closed answer and a new generation prompt
        (llama-cpp-python's server: A = C + the answer + at least an end-of-turn or a
        prompt token), or an open one by itself (llama.cpp's llama-server, ollama: A = C +
        the answer's one token). A server that refuses B but takes A honours the field
        (`chatbot serve`). Unknown counts (no usage) or A refused: the prompt, which every
        server understands.
        """
        user: ChatCompletionMessageParam = {"role": "user", "content": "Say OK."}
        start: ChatCompletionMessageParam = {"role": "assistant", "content": "Sure"}
        flags = {"continue_final_message": True, "add_generation_prompt": False}
        try:
            try:
                a = self._prompt_tokens([user, start], flags)
            except openai.BadRequestError:
                return "prompt"  # the field (or a final assistant message) refused
            try:
                b = self._prompt_tokens([user, start], None)
            except openai.BadRequestError:
                return "final-message"  # it tells the two apart (chatbot serve: 400 without it)
            c = self._prompt_tokens([user], None)
        except openai.APIError as exc:
            raise self.error(exc) from exc
        if a is None or b is None or c is None:
            return "prompt"
        return "final-message" if a < b or a - c <= 1 else "prompt"

    def _prompt_tokens(
        self, messages: list[ChatCompletionMessageParam], extra: dict[str, Any] | None
    ) -> int | None:
        reply = self.client.chat.completions.create(
            model=self._ready(), messages=messages, max_tokens=1, temperature=0.0, extra_body=extra
        )
        usage = getattr(reply, "usage", None)
        count = getattr(usage, "prompt_tokens", None)
        return count if isinstance(count, int) and count > 0 else None

    def stream(
        self,
        messages: list[ChatCompletionMessageParam],
        sampling: SamplingConfig,
        extra: dict[str, Any] | None = None,
    ) -> Generator[Any, None, None]:
        """POST chat/completions with stream=true; yields the client's chunk objects.

        A connection that never opened is retried (nothing reached the server); an answer
        is never asked for twice. Closing the iterator closes the HTTP stream.

        Raises:
            RemoteError: as `error` words it.
        """
        model = self._ready()
        body = request_fields(sampling)
        if extra:
            body["extra_body"] = {**body.get("extra_body", {}), **extra}
        response = None
        for attempt in range(RETRIES + 1):
            try:
                response = self.client.chat.completions.create(
                    model=model,
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


CONTINUE_METHODS = {
    "final-message": "the answer so far goes as the last assistant message (continue_final_message)",
    "prompt": "a message asks the model to go on (the server does not continue a final assistant message)",
}
ENDPOINTS = ("/chat/completions", "/completions", "/models", "/embeddings")


def api_roots(url: str) -> list[str]:
    """The API roots `url` may mean, the likelier first.

    Raises:
        ConfigError: not an http(s) URL.
    """
    raw = url.strip()
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"--server {url!r}: expected an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1"
        )
    path = parts.path.rstrip("/")
    path = re.sub(r"/models/[^/]+$", "/models", path)
    for endpoint in ENDPOINTS:
        if path.endswith(endpoint):
            path = path[: -len(endpoint)]
            break
    root = urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")).rstrip("/")
    if re.search(r"/v\d+$", path):
        return [root]
    return [root + "/v1", root]


def request_fields(sampling: SamplingConfig) -> dict[str, Any]:
    """The API's fields for the settings the user gave (`SamplingConfig.given`); the server
    applies its own defaults to the others. Those that are not OpenAI's (`Setting.extra`:
    top_k, the repetition penalty) go as extra fields (vLLM, SGLang, llama-server and
    chatbot serve read them)."""
    given = sampling.given()
    body: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for row in layer("sampling"):
        if row.request is not None and row.name in given:
            (extra if row.extra else body)[row.request] = given[row.name]
    if extra:
        body["extra_body"] = extra
    if sampling.output_format is not None:
        body["response_format"] = sampling.output_format.response_format()
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
