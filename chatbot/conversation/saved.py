"""Saved chats: the conversation as plain data, written atomically and privately, and read
back with every field checked. `ChatSession` and `RemoteSession` both save through here."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatbot.config import OPTIONAL, SamplingConfig
from chatbot.engine.stats import TurnStats, stats_from_dict, stats_to_dict
from chatbot.errors import ChatbotError, ConfigError
from chatbot.limits import MAX_SAVED_BYTES, expand, file_kind, loads_json, read_text, without_surrogates

SAVE_FORMAT = "chatbot-session"
SAVE_VERSION = 1


@dataclass
class Turn:
    """One exchange: the user's message, the answer, and what it cost."""

    user: str
    answer: str
    stats: TurnStats
    interrupted: bool = False
    first_segment: int = 0  # index of the turn's prompt segment; -1 when unknown
    evicted_before: int = 0  # the cache's evicted_total when the turn started

    def as_dict(self) -> dict[str, Any]:
        return {
            "user": self.user,
            "answer": self.answer,
            "interrupted": self.interrupted,
            "stats": stats_to_dict(self.stats),
        }


class SavedConversation:
    """What `ChatSession` and `RemoteSession` share for saving: `to_dict` and `save`."""

    system: str | None
    sampling: SamplingConfig
    turns: list[Turn]

    def messages(self) -> Sequence[Mapping[str, Any]]:
        raise NotImplementedError

    def to_dict(self, model: str | None = None) -> dict[str, Any]:
        """The conversation as plain data: messages, system prompt, settings, per-turn stats."""
        return saved_dict(self.system, self.sampling, self.messages(), self.turns, model)

    def save(self, path: str | os.PathLike[str], model: str | None = None, make_folder: bool = False) -> Path:
        """Write `to_dict` as JSON (see `write_saved`).

        Raises:
            ChatbotError: the file cannot be written, or its folder does not exist (unless
                `make_folder`).
        """
        return write_saved(path, self.to_dict(model), make_folder)


def saved_dict(
    system: str | None,
    sampling: SamplingConfig,
    messages: Sequence[Mapping[str, Any]],
    turns: list[Turn],
    model: str | None = None,
) -> dict[str, Any]:
    """A conversation as plain data: messages, system prompt, settings, per-turn stats."""
    return {
        "format": SAVE_FORMAT,
        "version": SAVE_VERSION,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model,
        "system": system,
        "settings": sampling.as_dict(),
        "messages": [dict(m) for m in messages],
        "turns": [t.as_dict() for t in turns],
    }


def read_saved(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON of a saved chat.

    Raises:
        ChatbotError: the file cannot be read or is not JSON.
    """
    p = expand(path)
    text = read_text(p, MAX_SAVED_BYTES, "saved chat")
    data = loads_json(text, f"{p}")
    if not isinstance(data, dict):
        raise ChatbotError(f"{p} is not a saved chat (expected a JSON object)")
    return data


def write_saved(path: str | os.PathLike[str], data: dict[str, Any], make_folder: bool = False) -> Path:
    """Write a saved chat as JSON, atomically (a crash never leaves half a file), private to
    the user (0600), refusing targets that are not regular files; returns the path written.
    The folder must exist unless `make_folder` (the default place, in the data directory): a
    mistyped folder is refused, not made.

    Raises:
        ChatbotError: the file cannot be written.
    """
    target = expand(path)
    text = json.dumps(data, ensure_ascii=False, indent=1)
    _check_save_target(target)
    if not make_folder and not target.parent.is_dir():
        raise ChatbotError(f"cannot save to {target}: the folder {target.parent} does not exist")
    tmp: str | None = None
    with _signals_after_cleanup():
        try:
            if make_folder:
                target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")  # 0600
            with os.fdopen(fd, "wb") as f:
                f.write((text + "\n").encode("utf-8", errors="surrogatepass"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            tmp = None
        except OSError as exc:
            raise ChatbotError(f"cannot save to {target}: {exc.strerror or exc}") from None
        finally:
            if tmp is not None:  # a failed write (or a signal) leaves no copy of the chat behind
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    return target


class _Signalled(BaseException):
    """SIGTERM or SIGHUP came while a save was being written (`_signals_after_cleanup`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_ENDING_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s)


@contextlib.contextmanager
def _signals_after_cleanup() -> Iterator[None]:
    """SIGTERM and SIGHUP inside the block raise `_Signalled`, so that its `finally` removes
    the temporary file; at the end the signal is given again to the handler there was before
    (by default, the process ends by it as it would have). Without this, a signal in a pipe
    (no handler: the process ends where it stands) left a copy of the chat beside the target.
    Signals already ignored stay ignored; outside the main thread nothing changes."""
    caught: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if not caught:
            caught.append(signum)
            raise _Signalled(signum)

    previous: dict[int, Any] = {}
    try:
        for s in _ENDING_SIGNALS:
            before = signal.getsignal(s)
            if before is not None and before != signal.SIG_IGN:  # (None: a handler not set from Python)
                previous[s] = signal.signal(s, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    except _Signalled:
        pass
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
    if caught:
        signal.raise_signal(caught[0])  # the handler before: ends the process, or raises
        raise ChatbotError(f"saving stopped by {signal.Signals(caught[0]).name}")


def parse_saved(
    data: Any, base: SamplingConfig, warnings: list[str] | None = None
) -> tuple[str | None, SamplingConfig, list[Turn]]:
    """System prompt, settings and turns from saved data; `base` fills missing settings and
    replaces bad ones (each named in `warnings`).

    Raises:
        ConfigError: the data is not a conversation.
    """
    if not isinstance(data, dict):
        raise ConfigError("a saved chat is a JSON object with messages")
    system = data.get("system")
    turns: list[Turn] = []
    if isinstance(data.get("turns"), list):
        for i, t in enumerate(data["turns"]):
            if (
                not isinstance(t, dict)
                or not isinstance(t.get("user"), str)
                or not isinstance(t.get("answer"), str)
            ):
                raise ConfigError(f"turn {i + 1}: expected user and answer text")
            rejected: list[str] = []
            stats = stats_from_dict(t.get("stats"), rejected)
            if rejected and warnings is not None:
                warnings.append(f"turn {i + 1}: stats {', '.join(rejected)} left out (not real figures)")
            user, answer = without_surrogates(t["user"]), without_surrogates(t["answer"])
            turns.append(Turn(user, answer, stats, bool(t.get("interrupted"))))
    elif isinstance(data.get("messages"), list):
        msgs = data["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            raise ConfigError("messages must be objects with role and content")
        if msgs and msgs[0].get("role") == "system":
            system = msgs[0]["content"]
            msgs = msgs[1:]
        if len(msgs) % 2 or any(
            m.get("role") != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(msgs)
        ):
            raise ConfigError("messages must alternate user and assistant, after an optional system message")
        turns = [
            Turn(without_surrogates(u["content"]), without_surrogates(a["content"]), TurnStats())
            for u, a in zip(msgs[::2], msgs[1::2])
        ]
    else:
        raise ConfigError("a saved chat needs a list of turns or messages")
    if system is not None and not isinstance(system, str):
        raise ConfigError("system must be text")
    # A lone surrogate ("\\ud800" in the JSON) is no text a tokenizer or a pipe takes.
    system = None if system is None else without_surrogates(system)
    sampling = base
    settings = data.get("settings")
    if isinstance(settings, dict):
        for key, value in settings.items():
            if key in SamplingConfig.RANGES:
                if value is None and key not in OPTIONAL:
                    continue
                try:
                    sampling = sampling.with_value(key, "none" if value is None else value)
                except ConfigError as exc:  # one bad value must not refuse the whole chat
                    if warnings is not None:
                        warnings.append(f"setting left as it was: {exc}")
    return (system or None), sampling, turns


def _check_save_target(target: Path) -> None:
    """Refuse to replace anything but a regular file (a FIFO, a device, a folder) and a
    loop of symbolic links, before writing a byte.

    Raises:
        ChatbotError: the target is not a file a chat can be saved to.
    """
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ChatbotError(f"cannot save to {target}: a loop of symbolic links") from None
        raise ChatbotError(f"cannot save to {target}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ChatbotError(f"cannot save to {target}: it is {file_kind(mode)}")
