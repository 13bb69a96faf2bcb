"""Every chat is appended to a log as it happens, so that nothing is lost.

One JSON-lines file per session in `$XDG_DATA_HOME/chatbot/sessions/`, named by the session
id (`20261129-142501-3fa2.jsonl`). The first line describes the session; each later line is
one event, written and flushed when it happens (a finished or interrupted turn, an undo, a
new system prompt, ...). Replaying the events gives the conversation back; a torn last line
(a crash in the middle of a write) is skipped.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatbot.errors import ChatbotError

LOG_VERSION = 1
SUFFIX = ".jsonl"


def data_dir() -> Path:
    """`$XDG_DATA_HOME/chatbot` (default `~/.local/share/chatbot`)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "chatbot"


def sessions_dir() -> Path:
    return data_dir() / "sessions"


def new_session_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


class SessionLog:
    """Appends events to one session's file; the file is created at the first event.

    Args:
        path: the JSON-lines file.
        header: what the first line says (model, system prompt, settings).
        warn: told once when the file cannot be written; logging then stops and the chat
            goes on.
    """

    def __init__(self, path: Path, header: dict[str, Any], warn: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.session_id = path.name.removesuffix(SUFFIX)
        self.header = header
        self.warn = warn
        self.enabled = True
        self._started = path.exists()

    @classmethod
    def create(cls, header: dict[str, Any], directory: Path | None = None,
               warn: Callable[[str], None] | None = None) -> SessionLog:
        directory = directory or sessions_dir()
        return cls(directory / (new_session_id() + SUFFIX), header, warn)

    def write(self, event: str, **fields: Any) -> None:
        """Append one event line and flush it to disk; failures disable the log with one warning."""
        if not self.enabled:
            return
        lines = []
        if not self._started:
            lines.append({"event": "start", "version": LOG_VERSION, "id": self.session_id,
                          "created": _now(), **self.header})
        lines.append({"event": event, "time": _now(), **fields})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                for line in lines:
                    f.write(json.dumps(line, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._started = True
        except OSError as exc:
            self.enabled = False
            if self.warn is not None:
                self.warn(f"warning: cannot write the session log {self.path} "
                          f"({exc.strerror or exc}); the chat goes on without it")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """The events of a log; lines that are not JSON objects (a torn write) are skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and isinstance(event.get("event"), str):
                yield event


def replay(path: Path) -> dict[str, Any]:
    """The state a log ends in, in the format of `ChatSession.to_dict` (plus `id`).

    Raises:
        ChatbotError: the file cannot be read or is not a session log.
    """
    state: dict[str, Any] = {"id": path.name.removesuffix(SUFFIX), "model": None, "system": None,
                             "settings": {}, "turns": []}
    seen_start = False
    try:
        for ev in read_events(path):
            kind = ev["event"]
            if kind == "start":
                seen_start = True
                state.update(model=ev.get("model"), system=ev.get("system"), settings=ev.get("settings") or {})
            elif kind == "turn" and isinstance(ev.get("user"), str) and isinstance(ev.get("answer"), str):
                turn = {k: ev.get(k) for k in ("user", "answer", "interrupted", "stats")}
                if ev.get("replace") and state["turns"]:
                    state["turns"][-1] = turn
                else:
                    state["turns"].append(turn)
            elif kind == "undo" and state["turns"]:
                state["turns"].pop()
            elif kind == "reset":
                state["turns"] = []
            elif kind == "system":
                state["system"] = ev.get("system")
            elif kind == "settings" and isinstance(ev.get("settings"), dict):
                state["settings"] = ev["settings"]
            elif kind == "load" and isinstance(ev.get("state"), dict):
                loaded = ev["state"]
                state.update(system=loaded.get("system"), settings=loaded.get("settings") or {},
                             turns=list(loaded.get("turns") or []))
    except OSError as exc:
        raise ChatbotError(f"cannot read session {path}: {exc.strerror or exc}") from None
    if not seen_start:
        raise ChatbotError(f"{path} is not a chatbot session log")
    return state


@dataclass
class SessionInfo:
    """One line of `chatbot sessions`."""

    id: str
    path: Path
    created: str
    model: str
    turns: int
    first_words: str


def list_sessions(directory: Path | None = None) -> list[SessionInfo]:
    """Logged sessions with at least one line, newest first."""
    directory = directory or sessions_dir()
    try:
        paths = sorted(directory.glob("*" + SUFFIX), key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
    except OSError:
        return []
    infos = []
    for p in paths:
        try:
            state = replay(p)
        except ChatbotError:
            continue
        first = state["turns"][0]["user"] if state["turns"] else ""
        created = state["id"][:15]
        try:
            created = time.strftime("%Y-%m-%d %H:%M", time.strptime(created, "%Y%m%d-%H%M%S"))
        except ValueError:
            pass
        infos.append(SessionInfo(state["id"], p, created, str(state.get("model") or "?"), len(state["turns"]),
                                 " ".join(first.split())[:60]))
    return infos


def find_session(ref: str, directory: Path | None = None) -> Path:
    """The log a user means: `last`, a whole id, or the start of one.

    Raises:
        ChatbotError: no session matches, or several do.
    """
    directory = directory or sessions_dir()
    ref = (ref or "last").strip()
    if ref == "last":
        sessions = list_sessions(directory)
        if not sessions:
            raise ChatbotError(f"no logged sessions in {directory}; start one with: chatbot run")
        return sessions[0].path
    exact = directory / (ref.removesuffix(SUFFIX) + SUFFIX)
    if exact.is_file():
        return exact
    try:
        matches = sorted(directory.glob(ref + "*" + SUFFIX))
    except (OSError, ValueError):
        matches = []
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ChatbotError(f"{len(matches)} sessions start with {ref!r}; give more of the id (chatbot sessions)")
    raise ChatbotError(f"no session {ref!r} in {directory}; `chatbot sessions` lists them")


def print_sessions(console: Any, limit: int = 20, directory: Path | None = None) -> None:
    """`chatbot sessions`: the newest logged sessions, one line each (easy to grep)."""
    directory = directory or sessions_dir()
    infos = list_sessions(directory)
    if not infos:
        console.print(f"no logged sessions in {directory}", markup=False)
        return
    shown = infos[:limit]
    width = max(len(i.model) for i in shown)
    console.print(f"{'id':<20}  {'date':<16}  {'model':<{width}}  turns  first words", style="bold",
                  markup=False, soft_wrap=True)
    for i in shown:
        console.print(f"{i.id:<20}  {i.created:<16}  {i.model:<{width}}  {i.turns:>5}  {i.first_words}",
                      markup=False, soft_wrap=True)
    if len(infos) > limit:
        console.print(f"… and {len(infos) - limit} older (--limit)", markup=False, style="dim")
    console.print(f"in {directory}; resume one with: chatbot run --resume ID (or --resume for the last)",
                  markup=False, style="dim", soft_wrap=True)
