"""A chat whose answers come from an OpenAI-compatible server (vLLM, SGLang, llama.cpp's
llama-server, ollama, llama-cpp-python, `chatbot serve`): the `Chat` interface
(chatbot/conversation/chat.py) on a list of messages.

The whole conversation is sent with every message; the server's prefix cache plays the part
of our persistent cache. Stats come from the stream: time to first token and the gaps
between chunks as they arrive here, token counts from the server's `usage` (asked for with
`stream_options.include_usage`); when it sends none, the prompt and the conversation's
length are unknown (shown as such) and the answer's tokens are counted as its chunks.
The HTTP work is `RemoteBackend`'s (chatbot/conversation/remote_backend.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from openai.types.chat import ChatCompletionMessageParam

from chatbot.config import SamplingConfig
from chatbot.conversation.chat import (
    Chat,
    Meter,
    ModelInfo,
    ProgressCallback,
    RemoteStats,
    merge_remote_stats,
    normal_system,
)
from chatbot.conversation.remote_backend import RemoteBackend, RemoteError
from chatbot.conversation.saved import Turn, saved_dict
from chatbot.conversation.thinking import ThinkingMeter
from chatbot.engine.stats import summarize
from chatbot.limits import without_surrogates

__all__ = ["RemoteBackend", "RemoteChunk", "RemoteError", "RemoteSession", "RemoteStats", "remote_sampling"]


@dataclass
class RemoteChunk:
    """A piece of a streamed answer (the shape of `GenerationChunk` the REPL reads)."""

    text: str
    finish_reason: str | None = None
    stats: RemoteStats | None = None
    thinking: str = ""
    """Thinking the server sent apart from the answer (`reasoning_content`)."""


def remote_sampling(**overrides: Any) -> SamplingConfig:
    """Settings for a server's model: those given (not None) in `overrides`; the others are
    left to the server (`SamplingConfig.unset`), which applies its own defaults (its model's
    preset) to a request that leaves them out.

    Raises:
        ConfigError: a value is out of range.
    """
    values = {k: v for k, v in overrides.items() if v is not None}
    unset = frozenset(SamplingConfig.RANGES) - values.keys() - {"stream_interval"}
    return dataclasses.replace(SamplingConfig(), **values, unset=unset).validated()


class RemoteSession(Chat[RemoteChunk]):
    """The conversation as messages, answered by a server (the `Chat` interface).

    Args:
        backend: the server and model.
        system: the system prompt.
        sampling: the settings sent with each message.
    """

    def __init__(
        self, backend: RemoteBackend, system: str | None = None, sampling: SamplingConfig | None = None
    ) -> None:
        self.backend = backend
        self.system = normal_system(system)
        self.sampling = sampling or remote_sampling()
        self.turns: list[Turn] = []
        self.notes: list[str] = []
        self.last_total_tokens: int | None = None  # the conversation's length, from the last usage

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
    def conversation_tokens(self) -> int | None:
        """The conversation's length in tokens, as the server last counted it (None: unknown)."""
        if not self.turns and not self.system:
            return 0
        return self.last_total_tokens

    @property
    def capacity(self) -> int:
        return self.backend.max_context or 0

    def summary(self) -> dict[str, Any]:
        totals = summarize([t.stats for t in self.turns], self.conversation_tokens or 0)
        if any(getattr(t.stats, "estimated", False) for t in self.turns):
            totals["context_tokens"] = None
        if self.conversation_tokens is None:
            totals["cache_tokens"] = None
        return totals

    # -- a turn ------------------------------------------------------------------------------

    def _send(self, text: str, sampling: SamplingConfig) -> Generator[RemoteChunk, None, None]:
        return self._answer(Turn(text, "", RemoteStats()), sampling, new=True)

    def _retry(self, sampling: SamplingConfig) -> Generator[RemoteChunk, None, None]:
        return self._answer(self.turns[-1], sampling, new=False)

    def _continue(self, sampling: SamplingConfig) -> Generator[RemoteChunk, None, None]:
        """Go on with the last answer, by the method the server supports
        (`RemoteBackend.continue_method`): the answer as the final assistant message, or a
        message asking for the rest (said once in a note)."""
        method = self.backend.continue_method()
        if method == "prompt" and not self.backend.continue_noted:
            self.backend.continue_noted = True
            self.notes.append(CONTINUE_PROMPT_NOTE)
        yield from self._answer(self.turns[-1], sampling, new=False, extend=method)

    def _answer(
        self, turn: Turn, sampling: SamplingConfig, new: bool, extend: str | None = None
    ) -> Generator[RemoteChunk, None, None]:
        history = self.messages() if new else self.messages()[:-2]
        messages: list[ChatCompletionMessageParam] = [*history, {"role": "user", "content": turn.user}]
        extra: dict[str, Any] | None = None
        before = turn.answer if extend else ""
        join = None
        limit = 0
        if extend == "final-message":
            messages.append({"role": "assistant", "content": before})
            extra = {"continue_final_message": True, "add_generation_prompt": False}
        elif extend == "prompt":
            messages.append({"role": "assistant", "content": before})
            messages.append({"role": "user", "content": CONTINUE_PROMPT})
            join = ContinuationJoin(before)
            # A reply that repeats the answer so far spends tokens on it: room for that, and
            # the new part still ends at max_new_tokens (chunks, about tokens); left to the
            # server, its own limit applies.
            if "max_new_tokens" not in sampling.unset:
                limit = sampling.max_new_tokens
                sampling = dataclasses.replace(sampling, max_new_tokens=limit + turn.stats.generated_tokens)
        parts: list[str] = []
        t0 = time.perf_counter()
        arrivals: list[float] = []
        usage: Any = None
        finish: str | None = None
        done = False
        final: RemoteStats | None = None
        meter = ThinkingMeter()
        stream = self.backend.stream(messages, sampling, extra)
        try:
            for chunk in stream:
                now = time.perf_counter()
                if getattr(chunk, "usage", None) is not None:
                    usage = chunk.usage
                for choice in chunk.choices or ():
                    thought = _reasoning(choice.delta)
                    if thought:
                        arrivals.append(now)
                        meter.add("", 1, thought)
                        yield RemoteChunk("", thinking=thought)
                    piece = choice.delta.content if choice.delta is not None else None
                    if piece:
                        # (a lone surrogate from the server would break the pipe, the save
                        # and the next request)
                        piece = without_surrogates(piece)
                        arrivals.append(now)
                        piece = join.feed(piece) if join is not None else piece
                    if piece:
                        parts.append(piece)
                        meter.add(piece, 1)
                        yield RemoteChunk(piece)
                    if choice.finish_reason:
                        finish = choice.finish_reason
                if join is not None and limit and len(parts) >= limit:
                    finish = "length"
                    break
            done = True
        finally:
            stream.close()
            # Also on Ctrl-C (the stream is closed at once) and on errors: keep what came.
            if done or parts:
                final = _stats(t0, arrivals, usage, finish if done else "interrupted")
                final.thinking_tokens = _reasoning_tokens(usage, meter.tokens)
                final.thinking_time_s = meter.seconds
                self.last_total_tokens = final.cache_tokens if usage is not None else None
                turn.answer = before + "".join(parts)
                turn.stats = merge_remote_stats(turn.stats, final) if extend else final
                turn.interrupted = not done
                if new:
                    self.turns.append(turn)
        assert final is not None
        yield RemoteChunk("", final.finish_reason, final)

    # -- commands ----------------------------------------------------------------------------

    def _undo(self) -> Turn:
        self.last_total_tokens = None  # the server has not counted the shorter conversation
        return self.turns.pop()

    def _clear(self) -> None:
        self.last_total_tokens = None

    def _clear_counts(self) -> None:
        self.last_total_tokens = None

    def _encode_conversation(self, on_progress: ProgressCallback | None, encode: bool = True) -> int:
        return 0  # the server encodes it with the next message

    # -- what the REPL shows -------------------------------------------------------------------

    def describe_model(self, model: ModelInfo) -> tuple[str, dict[str, str]]:
        self.backend.list_models()  # GET models now: the list may have changed
        return "model (on the server)", self.backend.describe()

    def describe_cache(self) -> tuple[str, dict[str, str]]:
        last = self.turns[-1].stats if self.turns else None
        known = last is not None and not getattr(last, "estimated", True)
        cached = getattr(last, "cached_tokens", None)
        total = self.conversation_tokens
        return "cache (on the server)", {
            "kept by": f"the server's prefix cache ({self.backend.base_url})",
            "conversation (last usage)": UNKNOWN if total is None else f"{total:,} tokens",
            "reused at the last message": "-"
            if last is None
            else f"{cached:,} tokens"
            if known and cached is not None
            else "not reported by the server",
            "prefilled at the last message": "-"
            if last is None
            else f"{last.context_tokens:,} tokens"
            if known
            else UNKNOWN,
        }

    def meter(self) -> Meter:
        return Meter(
            "context", self.conversation_tokens, self.backend.max_context, f"@ {self.backend.base_url}"
        )

    def encoded_note(self, tokens: int, system: bool) -> str:
        return (
            " (sent with the next message)"
            if system
            else " (the server encodes the chat with the next message)"
        )

    # -- saving ------------------------------------------------------------------------------

    def to_dict(self, model: str | None = None) -> dict[str, Any]:
        data = saved_dict(self.system, self.sampling, self.messages(), self.turns, model)
        return {**data, "server": self.backend.base_url}


UNKNOWN = "unknown (the server sends no usage)"
CONTINUE_PROMPT = "Continue your last answer exactly where it stopped, without repeating anything."
CONTINUE_PROMPT_NOTE = (
    "this server does not continue a final assistant message: /continue asks the model to go on "
    "with a message, and drops a repeat of the answer so far"
)


class ContinuationJoin:
    """The text of a reply asked to go on with `before` (`CONTINUE_PROMPT`), as the rest of
    it: a reply that starts by repeating `before` loses the repeat (held back until it is
    told apart), and the first new text gets a space where two words would otherwise touch."""

    def __init__(self, before: str) -> None:
        self.before = before
        self.target = before.strip()
        self.held = ""
        self.done = False

    def feed(self, piece: str) -> str:
        if self.done:
            return piece
        self.held += piece
        lead = self.held.lstrip()
        if self.target and lead.startswith(self.target):
            text = lead[len(self.target) :]
        elif self.target.startswith(lead):
            return ""  # may still be a repeat
        else:
            text = self.held
        if not text:
            return ""
        self.done = True
        return joined(self.before, text)


def joined(before: str, text: str) -> str:
    """`text` to append to `before`: leading spaces dropped after a space, one added between
    a word or a sentence's end and a word."""
    if not before or before[-1].isspace():
        return text.lstrip() if before else text
    if text[:1].isalnum() and before[-1] not in "([{\"'-/\n":
        return " " + text
    return text


def _reasoning(delta: Any) -> str:
    """The thinking in a streamed delta: `reasoning_content` (vLLM, SGLang, DeepSeek's API,
    llama-server) or `reasoning` (ollama, OpenRouter); a lone surrogate is dropped."""
    if delta is None:
        return ""
    text = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
    return without_surrogates(text) if isinstance(text, str) else ""


def _reasoning_tokens(usage: Any, counted: int) -> int:
    """The answer's thinking tokens: the server's count where its usage has one, else the
    chunks counted here (about one token each)."""
    details = getattr(usage, "completion_tokens_details", None) if usage is not None else None
    reported = getattr(details, "reasoning_tokens", None) if details is not None else None
    return int(reported) if isinstance(reported, int) and reported > 0 else counted


def _stats(t0: float, arrivals: list[float], usage: Any, finish: str | None) -> RemoteStats:
    """Figures from the chunks' arrival times and the server's usage. No `context_time_s`: a
    server does not say how long its prefill took (the time to the first token, measured
    here, holds it and the network besides)."""
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    ttft = arrivals[0] - t0 if arrivals else time.perf_counter() - t0
    stats = RemoteStats(
        ttft_s=ttft,
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
