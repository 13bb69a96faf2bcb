"""The chat the REPL talks to, whatever answers it: `ChatSession` (a model in this process)
and `RemoteSession` (an OpenAI-compatible server) are both a `Chat`.

The guards every chat shares are written here once (an empty message, nothing to retry,
undo or continue, an answer that ended by itself, the system prompt's normal form) and so
is the session log's bookkeeping. What differs is a hook the session fills in (`_send`,
`_retry`, `_continue`, `_undo`, ...) or a description it gives (`describe_model`,
`describe_cache`, `meter`, `encoded_note`), so that the REPL never asks which kind it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from chatbot.config import SamplingConfig
from chatbot.conversation.log import Event, LoggedSession
from chatbot.conversation.saved import SavedConversation, Turn, parse_saved
from chatbot.engine.stats import TurnStats, merge_stats
from chatbot.errors import ChatbotError

ProgressCallback = Callable[[int, int], None]  # (tokens done, tokens in all)


class AnswerChunk(Protocol):
    """A piece of a streamed answer: new text; the last one has the finish reason and stats."""

    @property
    def text(self) -> str: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def stats(self) -> TurnStats | None: ...


class ModelInfo(Protocol):
    """What answers (a loaded model, a server's backend): its name and the rows of /model."""

    @property
    def name(self) -> str: ...

    def describe(self) -> dict[str, str]: ...


ChunkT = TypeVar("ChunkT", bound=AnswerChunk)


@dataclass(frozen=True)
class Meter:
    """The toolbar's gauge of the conversation's length.

    `used` is None when nobody knows it (a server that sends no usage); `capacity` None
    when there is no known limit. `where` follows the model's name (e.g. the server's URL).
    """

    label: str
    used: int | None
    capacity: int | None = None
    where: str = ""


@dataclass
class RemoteStats(TurnStats):
    """A turn's figures as seen from a server's client.

    `context_tokens` are the prompt tokens the server prefilled (its prompt less the
    `cached_tokens` its prefix cache reused); `estimated` says the server sent no usage: the
    prompt and cache counts are unknown, and `generated_tokens` counts the chunks. The time
    the prefill took is not known (`context_time_s` stays 0): `ttft_s` includes it.
    """

    prompt_tokens: int = 0
    cached_tokens: int | None = None
    estimated: bool = False


def merge_remote_stats(first: TurnStats, more: RemoteStats) -> RemoteStats:
    """The figures of an answer a server gave in two parts (/continue)."""
    merged = merge_stats(first, more)
    return RemoteStats(
        **{k: getattr(merged, k) for k in TurnStats.__dataclass_fields__},
        prompt_tokens=more.prompt_tokens,
        cached_tokens=more.cached_tokens,
        estimated=more.estimated or getattr(first, "estimated", False),
    )


def normal_system(text: str | None) -> str | None:
    """A system prompt as kept: None for none, empty or blank."""
    return text if text and text.strip() else None


class Chat(SavedConversation, LoggedSession, ABC, Generic[ChunkT]):
    """A conversation that streams answers: the methods the REPL (and a library user) calls.

    Subclasses set `system`, `sampling` and `turns` and fill in the hooks.
    """

    notes: list[str]
    """Things to say once (e.g. how /continue works on this server); `take_notes` empties it."""

    thinking_opened: str | None = None
    """The thinking tag the prompt of the answer being streamed left open (e.g. `<think>`: the
    template opens it, the answer starts thinking); set by the first chunk."""

    prefill_observer: Callable[[int, int], None] | None = None
    """Told (tokens encoded, tokens in all) while a turn's new tokens are encoded, before its
    first chunk (a local model; a server's prompt processing is not seen); None: nobody."""

    # -- a turn ----------------------------------------------------------------------------

    def send(self, text: str, sampling: SamplingConfig | None = None) -> Generator[ChunkT, None, None]:
        """Add a user message and stream the answer.

        Nothing changes until the first chunk is asked for; an answer cut short (Ctrl-C,
        `close()`) is kept as far as it got.

        Args:
            text: the user's message.
            sampling: settings for this turn only (default: the session's).

        Yields:
            chunks of the answer; the last one has the finish reason and stats.

        Raises:
            ChatbotError: an empty message, or the chat cannot answer now (`_check_usable`).
        """
        if not text.strip():
            raise ChatbotError("empty message")
        self._check_usable()
        return self._logged(self._send(text, sampling or self.sampling), user=text)

    def retry(self, sampling: SamplingConfig | None = None) -> Generator[ChunkT, None, None]:
        """Replace the last answer with a new one (settings for this try only: `sampling`).

        Raises:
            ChatbotError: there is no answer to retry.
        """
        if not self.turns:
            raise ChatbotError("nothing to retry")
        self._check_usable()
        return self._logged(self._retry(sampling or self.sampling), user=None)

    def can_continue(self) -> bool:
        """The last answer was cut short (Ctrl-C or max_new_tokens): /continue can go on."""
        t = self.turns[-1] if self.turns else None
        return t is not None and (t.interrupted or t.stats.finish_reason in ("length", "interrupted"))

    def continue_answer(self, sampling: SamplingConfig | None = None) -> Generator[ChunkT, None, None]:
        """Resume the last answer where it stopped; the chunks carry only the new part.

        Raises:
            ChatbotError: there is no answer, or it ended by itself.
        """
        if not self.turns:
            raise ChatbotError("nothing to continue")
        if not self.can_continue():
            raise ChatbotError("the last answer ended by itself; /retry asks for a new one")
        self._check_usable()
        return self._logged(self._continue(sampling or self.sampling), user=None)

    # -- commands ----------------------------------------------------------------------------

    def undo(self) -> Turn:
        """Drop the last exchange.

        Returns:
            the turn that was removed.

        Raises:
            ChatbotError: there is nothing to undo.
        """
        if not self.turns:
            raise ChatbotError("nothing to undo")
        turn = self._undo()
        self._log(Event.UNDO)
        return turn

    def reset(self) -> None:
        """Forget the conversation; keep the system prompt and settings."""
        self.turns = []
        self._clear()
        self._log(Event.RESET)

    def keep_cache_for(self, session_id: str, resuming: bool = False) -> None:
        """Keep the chat's KV cache on disk for the logged session `session_id` (with
        `resuming`: the next restore takes what it can from it). A chat without a cache of its
        own (a server's) keeps nothing."""

    def keep_saved_cache(self, data: dict[str, Any]) -> None:
        """After `data` was saved (/save): keep the chat's KV cache on disk for it, so that a
        /load of it takes the history from there. A chat without a cache of its own keeps
        nothing."""

    def take_saved_cache(self, data: dict[str, Any]) -> None:
        """Before `data` is restored (/load): its history comes from the cache a /save of it
        kept, where there is one. A chat without a cache of its own takes nothing."""

    def template_system(self) -> str | None:
        """The system prompt the chat template writes when `system` is None (e.g. SmolLM's
        "You are a helpful AI assistant named SmolLM..."); None when it writes none or nobody
        knows (a server)."""
        return None

    def set_system(self, text: str | None, on_progress: ProgressCallback | None = None) -> int:
        """Replace the system prompt (None or "" removes it).

        Returns:
            the number of tokens encoded now (0 where the next message carries it).

        Raises:
            ContextFullError: the conversation no longer fits (it is kept, not encoded).
            ChatbotError: the chat cannot take it now (nothing is changed).
        """
        self._check_usable()
        self.system = normal_system(text)
        self._log(Event.SYSTEM, system=self.system)
        return self._encode_conversation(on_progress)

    def set_sampling(self, sampling: SamplingConfig) -> None:
        """Use these settings from the next answer on.

        Raises:
            ChatbotError: settings this chat cannot answer with (nothing is changed).
        """
        self._check_sampling(sampling)
        self._use_sampling(sampling)
        self._log(Event.SETTINGS, settings=sampling.as_dict())

    def restore(
        self,
        data: Any,
        on_progress: ProgressCallback | None = None,
        encode: bool = True,
        warnings: list[str] | None = None,
    ) -> int:
        """Replace the conversation with saved data (`to_dict` output, or a bare
        `{"messages": [...]}`).

        Args:
            encode: encode it now where the chat encodes anything (a local model).
            warnings: told what was left out (settings out of range).

        Returns:
            the number of tokens encoded.

        Raises:
            ConfigError: the data is not a conversation (nothing is changed).
            ChatbotError: far too long for the context, by a count of its characters before
                any tokenizing (nothing is changed).
            ContextFullError: it does not fit in the context (it is kept, not encoded).
            ChatbotError: the chat cannot take it now (nothing is changed).
        """
        if encode:
            self._check_usable()
        system, sampling, turns = parse_saved(data, self.sampling, warnings)
        self._check_size(system, turns)
        self.system = system
        self.turns = turns
        self._use_sampling(sampling)
        self._clear_counts()
        self._log(Event.LOAD, state=self.to_dict(self.model_name))
        return self._encode_conversation(on_progress, encode)

    def run_record(self) -> dict[str, Any]:
        """What a session log records of how this chat runs besides its system prompt and
        sampling, for `--resume` to run it so again (`chatbot.conversation.settings.run_record`);
        nothing here, a local model's chat adds its model and cache."""
        return {}

    def take_notes(self) -> list[str]:
        """The notes gathered since the last call (each said once)."""
        notes, self.notes = self.notes, []
        return notes

    # -- hooks -------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        """Refuse a turn (or a change that encodes), before anything changes."""

    def _check_size(self, system: str | None, turns: list[Turn]) -> None:
        """Refuse a conversation to restore that cannot fit, by a cheap count, before it is
        tokenized (nothing is changed).

        Raises:
            ChatbotError: it cannot fit.
        """

    def _check_sampling(self, sampling: SamplingConfig) -> None:
        """Refuse settings this chat cannot answer with, before they are taken."""

    def _use_sampling(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling

    def _clear_counts(self) -> None:
        """Forget figures that described the conversation being replaced."""

    @abstractmethod
    def _send(self, text: str, sampling: SamplingConfig) -> Generator[ChunkT, None, None]: ...

    @abstractmethod
    def _retry(self, sampling: SamplingConfig) -> Generator[ChunkT, None, None]: ...

    @abstractmethod
    def _continue(self, sampling: SamplingConfig) -> Generator[ChunkT, None, None]: ...

    @abstractmethod
    def _undo(self) -> Turn:
        """Remove the last turn (there is one) and return it."""

    @abstractmethod
    def _clear(self) -> None:
        """What `reset` does besides emptying `turns`."""

    @abstractmethod
    def _encode_conversation(self, on_progress: ProgressCallback | None, encode: bool = True) -> int:
        """The conversation (system prompt, turns) was replaced: take it in; returns the
        tokens encoded now."""

    # -- what the REPL shows -------------------------------------------------------------------

    @abstractmethod
    def describe_model(self, model: ModelInfo) -> tuple[str, dict[str, str]]:
        """/model: a title and rows (`model` is what the REPL was given as the model)."""

    @abstractmethod
    def describe_cache(self) -> tuple[str, dict[str, str]]:
        """/cache: a title and rows."""

    @abstractmethod
    def meter(self) -> Meter:
        """The toolbar's gauge."""

    @abstractmethod
    def encoded_note(self, tokens: int, system: bool) -> str:
        """What became of a new system prompt (`system`) or a loaded chat, after `tokens`
        were encoded: the end of the note, e.g. "; re-encoded 412 tokens"."""

    @abstractmethod
    def summary(self) -> dict[str, Any]:
        """Totals over all turns, for /stats (None where a count is unknown)."""
