"""The OpenAI wire format: the request models (pydantic), the OpenAI-style error answer
(`APIError`), and the checks that turn a request into a conversation and sampling settings.

No engine, no worker: everything here is plain validation.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from chatbot.config import SamplingConfig
from chatbot.errors import ConfigError
from chatbot.server.pool import Conversation

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


# -- from a request ----------------------------------------------------------------------------


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
