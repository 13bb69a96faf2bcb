"""The OpenAI wire format: the request models (pydantic), the OpenAI-style error answer
(`APIError`), and the checks that turn a request into a conversation and sampling settings.

No engine, no worker: everything here is plain validation.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from chatbot.config import OutputFormat, SamplingConfig
from chatbot.errors import ConfigError
from chatbot.server.pool import Conversation
from chatbot.settings import SETTINGS, layer

# -- requests ---------------------------------------------------------------------------------


def _encodable(text: str) -> str:
    """`text` if it encodes as UTF-8; JSON can carry a lone surrogate (`"\\ud800"`), which no
    tokenizer (and no JSON answer quoting it) can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"not valid Unicode: a lone surrogate {ascii(text[exc.start])[1:-1]} at character "
            f"{exc.start:,} (a \\ud800-\\udfff escape must be half of a high-low pair)"
        ) from None
    return text


# Every string a request's text comes in: it decodes, or the request is a 400 naming the field.
Text = Annotated[str, AfterValidator(_encodable)]


class ContentPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, sent back
    tool_call_id: Text | None = None  # a tool result's call
    reasoning_content: Text | None = None  # an assistant's thinking, sent back
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the answer must satisfy."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def output_format(self) -> OutputFormat | None:
        """The format the answer is held to (None: free text).

        Raises:
            APIError: `json_schema` missing for that type, or given with another.
        """
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise APIError(
                    400,
                    f"response_format: json_schema goes with type json_schema, not {self.type}",
                    param="response_format.json_schema",
                )
            return OutputFormat.json_object() if self.type == "json_object" else None
        if self.json_schema is None:
            raise APIError(
                400,
                "response_format: type json_schema needs a json_schema object (name, schema)",
                param="response_format.json_schema",
            )
        spec = self.json_schema
        return OutputFormat(json.dumps(spec.schema_), spec.name, spec.strict)


# OpenAI's limit on stop strings.
MAX_STOPS = 4
# The most answers (`n`) one request may ask for: they are generated one after another.
MAX_CHOICES = 16


class _Request(BaseModel):
    """The fields both completion requests share. Every OpenAI field is either used or, set to
    something this server cannot do (legacy functions, logit_bias, penalties), a
    400 naming it (`check_supported`); fields OpenAI does not have are accepted and ignored, as
    vLLM does."""

    model_config = ConfigDict(extra="allow")
    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None  # llama-server's
    draft: str | None = None  # ours: "ngram" or "off" (speculative decoding)
    draft_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    n: int = 1
    stop: Text | list[Text] | None = None
    user: str | None = None  # OpenAI's end-user id: nothing to do with it here

    def stop_strings(self) -> tuple[str, ...]:
        """The request's stop strings (empty ones dropped).

        Raises:
            APIError: more than OpenAI's 4.
        """
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
        return tuple(s for s in stops if s)


OPENAI_EFFORTS = {"none": "off", "minimal": "low"}
"""OpenAI's `reasoning_effort` values past low, medium and high, as `--think` says them."""


class ChatRequest(_Request):
    """The fields of OpenAI's chat completion request; `top_k`, `repetition_penalty`,
    `cache_salt`, `continue_final_message` and `add_generation_prompt` as vLLM has them."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    cache_salt: Text | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    reasoning_effort: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def think(self) -> tuple[str | None, str]:
        """What the request asks of a thinking model's template (`SamplingConfig.think`: on,
        off, low, medium, high; None: the server's default) and the field that asks it:
        `chat_template_kwargs`' `enable_thinking` or `reasoning_effort` (vLLM's, SGLang's)
        first, else OpenAI's `reasoning_effort`. Other template arguments are not read.

        Raises:
            APIError: enable_thinking that is not true or false.
        """
        kwargs = self.chat_template_kwargs or {}
        if "enable_thinking" in kwargs:
            enable = kwargs["enable_thinking"]
            if not isinstance(enable, bool):
                raise APIError(
                    400,
                    f"chat_template_kwargs.enable_thinking must be true or false, got {enable!r}",
                    param="chat_template_kwargs",
                )
            return ("on" if enable else "off"), "chat_template_kwargs.enable_thinking"
        if kwargs.get("reasoning_effort") is not None:
            return str(kwargs["reasoning_effort"]), "chat_template_kwargs.reasoning_effort"
        effort = self.reasoning_effort
        return OPENAI_EFFORTS.get(effort, effort) if effort else effort, "reasoning_effort"

    def top_logprobs_wanted(self) -> int | None:
        """How many top tokens to list with each token's logprob; None: no logprobs.

        Raises:
            APIError: top_logprobs out of 0..20, or without logprobs.
        """
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise APIError(
                400, f"top_logprobs must be between 0 and 20, got {self.top_logprobs}", param="top_logprobs"
            )
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class CompletionRequest(_Request):
    """OpenAI's (legacy) text completion request: a raw prompt, no chat template."""

    prompt: Text | list[Text]
    max_tokens: int | None = 16  # the API's default
    echo: bool = False
    logprobs: int | None = None
    suffix: Text | None = None
    best_of: int | None = None
    response_format: Any = None  # chat only: refused here rather than ignored
    tools: Any = None

    def top_logprobs_wanted(self) -> int | None:
        """How many top tokens to list with each token's logprob; None: no logprobs.

        Raises:
            APIError: logprobs out of 0..5 (OpenAI's limit).
        """
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise APIError(400, f"logprobs must be between 0 and 5, got {self.logprobs}", param="logprobs")
        return self.logprobs

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


# -- the context, before tokenizing -----------------------------------------------------------


@dataclass(frozen=True)
class PromptBound:
    """Refuses a prompt that cannot fit the context from its UTF-8 length alone, before the
    worker tokenizes it (slow on a long prompt, and it holds up every request behind it): a
    token stands for at most `bytes_per_token` bytes of text, so a prompt of B bytes is at
    least B / bytes_per_token tokens. The exact check (the session's) follows.

    Args:
        tokenizer: the model's tokenizer (its chat template renders conversations).
        max_context: the context in tokens; None (a sink cache) checks nothing.
        bytes_per_token: the most bytes of text one token stands for; None where no bound
            from bytes holds (see `longest_token_bytes`).
    """

    tokenizer: Any
    max_context: int | None
    bytes_per_token: int | None

    @classmethod
    def of(cls, tokenizer: Any, max_context: int | None) -> PromptBound:
        return cls(tokenizer, max_context, longest_token_bytes(tokenizer))

    def min_tokens(self, text: str) -> int:
        """At least this many tokens encode `text` (0 when no bound holds)."""
        if not self.bytes_per_token:
            return 0
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.bytes_per_token)

    def check_prompt(self, prompt: str) -> None:
        """Raises APIError (400, context_length_exceeded) when a raw prompt cannot fit."""
        self._check(self.min_tokens(prompt), "the prompt", "prompt")

    def check_conversation(self, conv: Conversation) -> None:
        """Raises APIError (400, context_length_exceeded) when the conversation, as the chat
        template renders it, cannot fit."""
        if self.max_context is None or not self.bytes_per_token:
            return
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        for user, answer in conv.turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        if conv.partial_answer is None:
            messages.append({"role": "user", "content": conv.user})
        else:  # the answer goes on from its text, after the generation prompt
            messages = messages[:-1]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses it: the session says why
            return
        if conv.partial_answer is not None:
            text += conv.partial_answer
        self._check(self.min_tokens(text), "the conversation", "messages")

    def _check(self, at_least: int, what: str, param: str) -> None:
        if self.max_context is not None and at_least + 1 > self.max_context:
            raise APIError(
                400,
                f"context full: {what} does not fit the model's context ({self.max_context:,} tokens): "
                f"it is at least {at_least:,} tokens",
                param=param,
                code="context_length_exceeded",
            )


# How much one normalizer step can shorten text: NFC composes at most three characters'
# bytes into one's (Hangul jamo L+V+T, 9 bytes, into a syllable, 3 bytes).
_SHRINKS = {"Prepend": 1, "NFC": 3}
_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes of input text one token can stand for, read once from a fast
    tokenizer's vocabulary (SmolLM2: 81, a run of spaces), times what its normalizer can
    shorten text by.

    None where text can be dropped or folded before it becomes tokens, so no bound from bytes
    holds: a slow tokenizer, a model other than BPE, BPE without byte-level or byte-fallback
    tokens (unknown characters vanish), a normalizer or pre-tokenizer that strips, lowercases
    or drops whitespace.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, TypeError, ValueError):
        return None
    model = spec.get("model") or {}
    pre = _steps(spec.get("pre_tokenizer"))
    byte_level = any(step.get("type") == "ByteLevel" for step in pre)
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    if any(step.get("type") not in _KEEPS_TEXT or step.get("behavior") == "Removed" for step in pre):
        return None
    shrink = 1
    for step in _steps(spec.get("normalizer")):
        kind = step.get("type")
        if kind == "Replace" and step.get("pattern") == {"String": " "} and step.get("content") == "\u2581":
            continue  # SentencePiece's space, counted back as one byte below
        if kind not in _SHRINKS:
            return None
        shrink *= _SHRINKS[kind]
    vocab = model.get("vocab") or {}
    if byte_level:  # one character a byte (GPT-2's byte-to-unicode table)
        longest = max((len(token) for token in vocab), default=1)
    else:
        longest = max((len(token.replace("\u2581", " ").encode()) for token in vocab), default=1)
    added = max((len(str(t.get("content", "")).encode()) for t in spec.get("added_tokens") or []), default=1)
    return max(longest, added, 1) * shrink


def _steps(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps, a Sequence flattened."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        inner = spec.get("normalizers") or spec.get("pretokenizers") or []
        return [step for part in inner for step in _steps(part)]
    return [spec]


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


def _unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what} is not supported by this server", param=param)


# OpenAI's ranges, where they are narrower than what the engine takes.
_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0)}
_RANGES["frequency_penalty"] = _RANGES["presence_penalty"]


def check_supported(body: ChatRequest | CompletionRequest) -> None:
    """Refuse what the server would otherwise have to ignore: OpenAI fields set to something
    it does not do, and values out of OpenAI's ranges.

    Raises:
        APIError: 400 naming the field.
    """
    for name, (low, high) in _RANGES.items():
        value = getattr(body, name)
        if value is not None and not low <= value <= high:
            raise APIError(400, f"{name} must be between {low:g} and {high:g}, got {value!r}", param=name)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise _unsupported(name, "a non-zero penalty (repetition_penalty is)")
    if body.logit_bias:
        raise _unsupported("logit_bias", "a logit bias")
    if not 1 <= body.n <= MAX_CHOICES:
        raise APIError(400, f"n must be between 1 and {MAX_CHOICES}, got {body.n}", param="n")
    if body.n > 1 and getattr(body, "continue_final_message", False):
        raise _unsupported("n", "more than one answer with continue_final_message")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise _unsupported("suffix", "a suffix (insertion)")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1 (one answer per request)", param="best_of")
        for name in ("response_format", "tools"):
            if getattr(body, name) is not None:
                raise _unsupported(name, f"{name} on /v1/completions (it is on /v1/chat/completions)")
        return
    if body.functions:
        raise _unsupported("functions", "the legacy function calling (tools is)")
    if body.function_call not in (None, "none"):
        raise _unsupported("function_call", "the legacy function calling (tool_choice is)")


def check_format(tokenizer: Any, fmt: OutputFormat, param: str = "response_format") -> None:
    """Compile the format's grammar once, to refuse what the engine cannot enforce before the
    request queues (the grammar engine is imported here, on the first such request).

    Args:
        param: the field the schema came from (`tools` for a forced call's).

    Raises:
        APIError: 400 naming `param`, with the engine's reason.
    """
    from chatbot.engine.grammar import GrammarError, compiled

    try:
        compiled(tokenizer, fmt)
    except GrammarError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


# What a request that sets temperature or top_p gets for the settings it leaves out: OpenAI's
# meaning (no top-k, no repetition penalty, the other of the two at 1), not the preset's.
OPENAI_SAMPLING: dict[str, Any] = {s.name: s.openai_default for s in SETTINGS if s.openai_default is not None}


def sampling_of(
    body: ChatRequest | CompletionRequest,
    base: SamplingConfig,
    max_context: int | None,
    draft_model: bool = False,
) -> SamplingConfig:
    """The request's sampling settings over the server's defaults (the model's preset and
    generation config, `server_sampling`).

    A request that sets neither temperature nor top_p gets the defaults whole; one that sets
    either gets OpenAI's sampling: what it leaves out at OpenAI's defaults, not the preset's,
    unless it sends vLLM's `top_k` / `repetition_penalty`. max_tokens and seed apply alone.
    `draft_model`: whether the server has a draft model (`serve --draft FILE`) for `draft: "model"`.

    Raises:
        APIError: a value out of range, or a field we do not support.
    """
    check_supported(body)
    sampling = base
    if body.temperature is not None or body.top_p is not None:
        sampling = dataclasses.replace(base, **OPENAI_SAMPLING)
    max_param = "max_tokens"
    max_tokens = getattr(body, "max_completion_tokens", None)
    if max_tokens is not None:
        max_param = "max_completion_tokens"
    else:
        max_tokens = body.max_tokens
    fields = {s.name: getattr(body, s.request, None) for s in layer("sampling") if s.request}
    fields["max_new_tokens"] = max_tokens
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        sampling = dataclasses.replace(sampling, output_format=response_format.output_format())
    if body.top_p == 0:  # only the most likely token is left: greedy
        fields["top_p"], fields["temperature"] = None, 0.0
    for key, value in fields.items():
        if value is None:
            continue
        param = max_param if key == "max_new_tokens" else key
        try:
            sampling = sampling.with_value(key, value)
        except ConfigError as exc:
            raise APIError(400, str(exc).replace("max_new_tokens", max_param), param=param) from None
    if sampling.draft == "model" and not draft_model and getattr(body, "draft", None) == "model":
        raise APIError(400, "draft: this server has no draft model (serve --draft FILE)", param="draft")
    think, think_param = body.think() if isinstance(body, ChatRequest) else (None, "")
    if think is not None:
        try:
            sampling = sampling.with_value("think", think)
        except ConfigError:
            raise APIError(
                400,
                f"{think_param} must be one of none, minimal, low, medium, high (or on, off), got {think!r}",
                param=think_param.partition(".")[0],
            ) from None
    if max_context is not None and sampling.max_new_tokens >= max_context:
        raise APIError(
            400,
            f"{max_param} must be less than the context ({max_context:,} tokens), "
            f"got {sampling.max_new_tokens:,}",
            param=max_param,
        )
    return sampling
