"""Every chat is appended to a log as it happens, so that nothing is lost.

One JSON-lines file per session in `$XDG_DATA_HOME/chatbot/sessions/`, named by the session
id (`20261129-142501-3fa2.jsonl`). The first line describes the session; each later line is
one event, written and flushed when it happens (a finished or interrupted turn, an undo, a
new system prompt, ...). Replaying the events gives the conversation back; a torn last line
(a crash in the middle of a write) is skipped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shlex
import signal
import stat
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from chatbot.errors import ChatbotError
from chatbot.limits import bounded_lines, check_nesting, without_surrogates

if TYPE_CHECKING:
    from chatbot.conversation.saved import Turn

LOG_VERSION = 1
SUFFIX = ".jsonl"
# Logs, saved chats and the input history are the user's own: nobody else may read them.
DIR_MODE = 0o700
FILE_MODE = 0o600


class Event(StrEnum):
    """The events of a session log, as written and as `replay` reads them."""

    START = "start"  # the first line: model, system prompt, settings
    RESUME = "resume"  # a later process goes on with the session
    SEND = "send"  # a message was sent (written before its answer: a crash keeps it)
    TURN = "turn"  # an answer ended (finished or cut short); `replace` for /retry, /continue
    CANCEL = "cancel"  # the message sent never became a turn (e.g. it did not fit)
    UNDO = "undo"
    RESET = "reset"
    SYSTEM = "system"
    SETTINGS = "settings"
    LOAD = "load"  # a saved chat replaced the conversation


Chunk = TypeVar("Chunk")


class LoggedSession:
    """What `ChatSession` and `RemoteSession` share: each change of the conversation is
    written to `log` (a `SessionLog`) as it happens, when one is set. A library user gets
    the same log as the REPL: ``session.log = SessionLog.create(header)``.
    """

    log: SessionLog | None = None
    model_name: str | None = None  # written with a loaded chat's state
    turns: list[Turn]

    def _log(self, event: Event, **fields: Any) -> None:
        if self.log is not None:
            self.log.write(event, **fields)

    def _logged(self, chunks: Generator[Chunk, None, None], user: str | None) -> Generator[Chunk, None, None]:
        """Stream `chunks` (an answer), logging the message first when `user` is given (a
        new turn), and the turn it produced at the end, also when cut short; a message that
        never became a turn is logged as cancelled. Without `user` the last turn is being
        redone (/retry, /continue) and its log entry is replaced."""
        count = len(self.turns)
        redone = None if user is not None else self.turns[-1]
        try:
            if user is not None:
                # A Ctrl-C held back while this is written is raised right after it: the
                # message is then cancelled below, as the session drops it.
                self._log(Event.SEND, user=user)
            yield from chunks
        finally:
            chunks.close()  # the session closes the turn first
            if redone is not None:
                self._log(Event.TURN, replace=True, **redone.as_dict())
            elif len(self.turns) > count:
                self._log(Event.TURN, replace=False, **self.turns[-1].as_dict())
            else:
                self._log(Event.CANCEL)


def data_dir() -> Path:
    """`$XDG_DATA_HOME/chatbot` (default `~/.local/share/chatbot`).

    Raises:
        ChatbotError: neither XDG_DATA_HOME nor a home directory is known.
    """
    base = os.environ.get("XDG_DATA_HOME")
    if not base or not os.path.isabs(base):
        home = os.path.expanduser("~")
        if home.startswith("~") or not os.path.isabs(home):
            raise ChatbotError("no home directory to keep chats in; set HOME or XDG_DATA_HOME")
        base = os.path.join(home, ".local", "share")
    return Path(base) / "chatbot"


def private_dir(path: Path) -> Path:
    """Create `path` (and its parents) readable by the user alone; an existing folder is
    left as it is. Returns `path`.

    Raises:
        OSError: it cannot be created.
    """
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    return path


def sessions_dir() -> Path:
    return data_dir() / "sessions"


def new_session_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


class SessionLog:
    """Appends events to one session's file; the file is created at the first event.

    A write that fails for want of space (a full disk, a quota) leaves the file as it was
    before that write: the part of the line that reached the disk is cut off again, so the
    log stays whole lines up to the last complete event. The events that could not be
    written wait in memory and go out with the next write that succeeds, once there is room
    again (they are lost if the process ends first). Any other failure stops the log.

    Args:
        path: the JSON-lines file.
        header: what the first line says (model, system prompt, settings).
        warn: told once when the file cannot be written (once per full-disk spell); the
            chat goes on.
    """

    def __init__(self, path: Path, header: dict[str, Any], warn: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.session_id = path.name.removesuffix(SUFFIX)
        self.header = header
        self.warn = warn
        self.enabled = True
        self._started = path.exists()
        # Encoded event lines not on disk yet (the disk was full when they were written).
        self._waiting: list[bytes] = []
        self._spell = False  # a full-disk spell is going on (and was warned of)

    @property
    def behind(self) -> int:
        """How many events wait in memory for room on the disk."""
        return len(self._waiting)

    @classmethod
    def create(
        cls, header: dict[str, Any], directory: Path | None = None, warn: Callable[[str], None] | None = None
    ) -> SessionLog:
        try:
            directory = directory or sessions_dir()
        except ChatbotError as exc:
            log = cls(Path(os.devnull), header, warn)
            log.enabled = False
            if warn is not None:
                warn(f"warning: {exc}; the chat is not logged")
            return log
        return cls(directory / (new_session_id() + SUFFIX), header, warn)

    def write(self, event: str, **fields: Any) -> None:
        """Append one event line and flush it to disk (with any that wait for room).

        A full disk keeps the event in memory, with one warning; any other failure disables
        the log with one warning. The chat goes on in both cases.
        """
        if not self.enabled:
            return
        if not self._started:
            self._waiting.append(
                _line(
                    {
                        "event": Event.START.value,
                        "version": LOG_VERSION,
                        "id": self.session_id,
                        "created": _now(),
                        **self.header,
                    }
                )
            )
            self._started = True
        self._waiting.append(_line({"event": str(event), "time": _now(), **fields}))
        with _sigint_blocked():
            self._flush()

    def _flush(self) -> None:
        """Append the waiting lines in one write; on failure the file is cut back to its
        size before it, so that a torn line never glues itself to the next event."""
        try:
            private_dir(self.path.parent)
            # A line torn by a crash (or a kill) is closed first: it stays a line that
            # `read_events` skips, instead of swallowing this write's first event.
            append_whole(self.path, b"".join(self._waiting), close_torn_line=True, sync=True)
        except OSError as exc:
            self._failed(exc)
            return
        if self._spell and self.warn is not None:
            self.warn(f"the session log caught up ({len(self._waiting)} events written)")
        self._waiting.clear()
        self._spell = False

    def _failed(self, exc: OSError) -> None:
        no_room = exc.errno in _NO_ROOM
        if no_room and sum(map(len, self._waiting)) <= MAX_WAITING_BYTES:
            if not self._spell and self.warn is not None:
                self.warn(
                    f"warning: no room to write the session log {self.path} ({exc.strerror or exc}); "
                    "the chat goes on, and the log catches up once there is space "
                    "(what is logged so far is kept)"
                )
            self._spell = True
            return
        self.enabled = False
        self._waiting.clear()
        if self.warn is not None:
            if no_room:
                self.warn(
                    f"warning: still no room for the session log {self.path}; it stops here "
                    "(what it holds can be resumed) and the chat goes on without it"
                )
            else:
                self.warn(
                    f"warning: cannot write the session log {self.path} "
                    f"({exc.strerror or exc}); the chat goes on without it"
                )


# A full disk and an exceeded quota pass; other write errors stop the log.
_NO_ROOM = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# Events kept in memory while the disk is full, at most (then the log stops).
MAX_WAITING_BYTES = 16 << 20


# Characters that JSON leaves raw but that `str.splitlines` (and editors) take as line breaks:
# written escaped, so that a log is one event per line to every reader.
_BREAKS = re.compile("[\u0085\u2028\u2029]")


def _line(event: dict[str, Any]) -> bytes:
    text = _BREAKS.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(event, ensure_ascii=False))
    return (text + "\n").encode("utf-8", errors="surrogatepass")


def append_whole(
    path: str | bytes | os.PathLike[str] | os.PathLike[bytes],
    data: bytes,
    close_torn_line: bool = False,
    sync: bool = False,
) -> None:
    """Append `data` to the file at `path` (created 0600), all of it or nothing: a failed write
    (a full disk) is cut back to the file's size before it, so that a torn line never glues
    itself to what is written next. `close_torn_line`: a last line left without its newline
    (a crash) is ended first.

    Raises:
        OSError: the file could not be opened or written (it is as it was where it can be cut).
    """
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    size: int | None = None
    try:
        size = os.fstat(fd).st_size
        if close_torn_line and size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    except OSError:
        if size is not None:
            with contextlib.suppress(OSError):  # (a device such as /dev/full cannot be cut)
                os.ftruncate(fd, size)
        raise
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """`os.write` until all of `data` is written (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Ctrl-C waits until the event is on disk (it takes effect right after), so a key press
    at the wrong moment cannot tear the log of a turn that is already finished. (A signal
    mask would not do: torch's threads would take the signal.)"""
    caught: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except ValueError:  # not the main thread: signals go to the main thread anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _no_constant(name: str) -> None:
    return None


def read_events(path: Path, head: int | None = None) -> Iterator[dict[str, Any]]:
    """The events of a log (of its first `head` bytes where given); lines that are not JSON
    objects (a torn write), nest too deeply or are too long are skipped. NaN and Infinity
    read as null.

    Raises:
        ChatbotError: the file is not a regular file or cannot be read.
    """
    lines = bounded_lines(path) if head is None else bounded_lines(path, head, head)
    for line in lines:
        try:
            event = json.loads(line, parse_constant=_no_constant)
            check_nesting(event, "event")
        except (ValueError, RecursionError, ChatbotError):
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            yield event


def _text(value: Any) -> str | None:
    """A string field of an event, or None (lone surrogates become U+FFFD)."""
    return without_surrogates(value) if isinstance(value, str) else None


def _turn(ev: Any) -> dict[str, Any] | None:
    """A turn record from an event or a loaded state, or None when it is not one."""
    if not isinstance(ev, dict):
        return None
    user, answer = _text(ev.get("user")), _text(ev.get("answer"))
    if user is None or answer is None:
        return None
    stats = ev.get("stats")
    return {
        "user": user,
        "answer": answer,
        "interrupted": bool(ev.get("interrupted")),
        "stats": stats if isinstance(stats, dict) else {},
    }


def replay(path: Path, head: int | None = None) -> dict[str, Any]:
    """The state a log ends in, in the format of `ChatSession.to_dict` (plus `id`, and the
    `load` and `engine` records of `chatbot.conversation.settings.run_record` where it has them);
    with `head`, the state after its first `head` bytes.

    Raises:
        ChatbotError: the file cannot be read or is not a session log.
    """
    state: dict[str, Any] = {
        "id": path.name.removesuffix(SUFFIX),
        "model": None,
        "system": None,
        "settings": {},
        "turns": [],
    }
    seen_start = False
    # A message sent whose answer was never logged (the process was killed): kept as a turn
    # with an empty, interrupted answer until its "turn" event replaces it.
    pending = False
    try:
        for ev in read_events(path, head):
            kind = ev["event"]
            if kind == Event.START:
                seen_start = True
                settings = ev.get("settings")
                state.update(
                    model=_text(ev.get("model")),
                    system=_text(ev.get("system")),
                    settings=settings if isinstance(settings, dict) else {},
                )
                state.update({k: ev[k] for k in ("load", "engine") if isinstance(ev.get(k), dict)})
            elif kind == Event.RESUME:
                pending = False  # a message left by a killed process stays a turn of its own
                # how the chat went on: the settings the next resume takes back
                if isinstance(ev.get("settings"), dict):
                    state["settings"] = ev["settings"]
                if "system" in ev and (ev["system"] is None or isinstance(ev["system"], str)):
                    state["system"] = _text(ev["system"])
                state.update({k: ev[k] for k in ("load", "engine") if isinstance(ev.get(k), dict)})
            elif kind == Event.SEND and _text(ev.get("user")) is not None:
                # (a send after a send with no turn between: the first process was killed
                # before its resume event; both messages are kept)
                state["turns"].append(
                    {"user": _text(ev["user"]), "answer": "", "interrupted": True, "stats": {}}
                )
                pending = True
            elif kind == Event.TURN and (turn := _turn(ev)) is not None:
                if (ev.get("replace") or pending) and state["turns"]:
                    state["turns"][-1] = turn
                else:
                    state["turns"].append(turn)
                pending = False
            elif kind == Event.CANCEL:
                if pending:
                    state["turns"].pop()
                pending = False
            elif kind == Event.UNDO and state["turns"]:
                state["turns"].pop()
                pending = False
            elif kind == Event.RESET:
                state["turns"] = []
                pending = False
            elif kind == Event.SYSTEM and (ev.get("system") is None or isinstance(ev.get("system"), str)):
                state["system"] = _text(ev.get("system"))
            elif kind == Event.SETTINGS and isinstance(ev.get("settings"), dict):
                state["settings"] = {**state["settings"], **ev["settings"]}
            elif kind == Event.LOAD and isinstance(ev.get("state"), dict):
                loaded = ev["state"]
                turns = loaded.get("turns")
                settings = loaded.get("settings")
                state.update(
                    system=_text(loaded.get("system")),
                    settings=settings if isinstance(settings, dict) else {},
                    turns=[t for t in map(_turn, turns if isinstance(turns, list) else []) if t],
                )
                pending = False
    except OSError as exc:
        raise ChatbotError(f"cannot read session {path}: {exc.strerror or exc}") from None
    if not seen_start:
        raise ChatbotError(f"{path} is not a chatbot session log")
    return state


@dataclass
class SessionInfo:
    """One session in `chatbot sessions` (`chatbot.terminal.sessions_view`)."""

    id: str
    path: Path
    created: str
    model: str
    turns: int | None  # None: the log is too large to count them for a listing (REPLAY_BYTES)
    first_words: str  # of the first message, whitespace collapsed (its first 60 words, then " …")


REPLAY_BYTES = 8 * 1024 * 1024
"""A log up to this size is read whole for `chatbot sessions` (its turns counted); of a larger
one only its first `HEAD_BYTES`: a listing never waits on one huge file (a 2 GB file among the
logs took 34.5 s and 235 MB)."""
HEAD_BYTES = 1024 * 1024


def list_sessions(directory: Path | None = None) -> list[SessionInfo]:
    """Logged sessions with at least one line, newest first."""
    directory = directory or sessions_dir()
    infos = []
    for p, size in _log_files(directory, "*" + SUFFIX):
        try:
            head = None if size <= REPLAY_BYTES else HEAD_BYTES
            state = replay(p, head)
        except (ChatbotError, OSError, ValueError, TypeError, RecursionError, MemoryError):
            continue  # one unreadable log must not hide the others
        first = (state["turns"][0]["user"] if state["turns"] else "").split()
        created = state["id"][:15]
        try:
            created = time.strftime("%Y-%m-%d %H:%M", time.strptime(created, "%Y%m%d-%H%M%S"))
        except ValueError:
            pass
        infos.append(
            SessionInfo(
                state["id"],
                p,
                created,
                str(state.get("model") or "?"),
                len(state["turns"]) if head is None else None,
                " ".join(first[:60]) + (" …" if len(first) > 60 else ""),
            )
        )
    return infos


def _log_files(directory: Path, pattern: str) -> list[tuple[Path, int]]:
    """The regular files in `directory` whose names match `pattern`, newest first, with their
    sizes. Anything else is passed over without being opened: a FIFO (opening it would wait
    for a writer), a folder, a dangling link or a loop of links (their `stat` fails); one bad
    entry never hides the others. An unreadable folder has none."""
    found = []
    try:
        for p in directory.glob(pattern):
            try:
                st = p.stat()  # (follows links)
            except (OSError, ValueError):
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime, p.name, p, st.st_size))
    except (OSError, ValueError):
        return []
    return [(p, size) for _, _, p, size in sorted(found, reverse=True)]


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
    matches = sorted(p for p, _ in _log_files(directory, ref + "*" + SUFFIX))
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ChatbotError(
            f"{len(matches)} sessions start with {ref!r}; give more of the id (chatbot sessions)"
        )
    raise ChatbotError(f"no session {ref!r} in {directory}; `chatbot sessions` lists them")


def resolve_resume(ref: str | None) -> Path | None:
    """The session log `--resume REF` means (None: no resume).

    Raises:
        ChatbotError: no such session; where REF cannot be (the start of) an id, the message
            says that `--resume PROMPT` took the prompt for one.
    """
    if ref is None:
        return None
    try:
        return find_session(ref)
    except ChatbotError as exc:
        if re.fullmatch(r"[0-9a-f-]+", ref.strip()):
            raise
        raise ChatbotError(
            f"{exc}. --resume takes a session id (alone: the last session); to ask the last "
            f"session: chatbot run --resume last {shlex.quote(ref)}"
        ) from None
