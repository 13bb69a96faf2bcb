"""A disk that fills after the chat started: one warning, the chat goes on, and nothing
already logged is lost.

The disk fills for real in two ways: a file replaced by a symbolic link to /dev/full (every
write to it fails with ENOSPC), and `os.write` made to write part of its bytes and then fail
with ENOSPC for one file, as a filesystem that runs out in the middle of a line does.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest

from chatbot.config import ChatConfig, SamplingConfig
from chatbot.conversation import log as session_log
from chatbot.conversation.log import Event, SessionLog, replay
from chatbot.conversation.session import ChatSession

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=6)
SCRIPT = Path(__file__).parent / "scripted_chat.py"

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


class FullDisk:
    """`os.write` to `path` writes half of its bytes, then fails with ENOSPC, while `full`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
        self.path = str(path)
        self.full = False
        self.failures = 0
        real_write = os.write

        def write(fd: int, data) -> int:
            if self.full and self._is_target(fd):
                self.failures += 1
                half = bytes(data)[: len(data) // 2]
                if half:
                    real_write(fd, half)  # what reached the disk before it filled
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write)

    def _is_target(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}") == self.path
        except OSError:
            return False


def logged_session(engine, directory: Path, warnings: list[str]) -> ChatSession:
    s = ChatSession(engine, ChatConfig(system="Be brief.", sampling=GREEDY))
    s.log = SessionLog.create(
        {"model": "tiny", "system": s.system, "settings": GREEDY.as_dict()}, directory, warn=warnings.append
    )
    s.model_name = "tiny"
    return s


def drain(chunks) -> str:
    return "".join(c.text for c in chunks)


def assert_whole_lines(path: Path) -> list[dict]:
    """Every line of the log is a JSON event and the file ends with a newline."""
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


class DevFull:
    """`path` replaced by a symbolic link to /dev/full (the file kept aside), then put back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kept = path.with_name(path.name + ".kept")

    def fill(self) -> None:
        self.path.rename(self.kept)
        self.path.symlink_to("/dev/full")

    def free(self) -> None:
        self.path.unlink()
        self.kept.rename(self.path)


@needs_dev_full
def test_a_full_disk_keeps_what_is_logged_and_the_log_catches_up(tiny_engine, tmp_path):
    warnings: list[str] = []
    s = logged_session(tiny_engine, tmp_path, warnings)
    drain(s.send("Hello there!"))
    disk = DevFull(s.log.path)
    disk.fill()
    drain(s.send("How are you today?"))
    s.set_sampling(GREEDY.with_value("top_k", 7))
    drain(s.send("The quick brown fox?"))
    assert len(warnings) == 1 and "no room to write the session log" in warnings[0]
    assert [t["user"] for t in replay(disk.kept)["turns"]] == ["Hello there!"]  # kept, whole
    assert_whole_lines(disk.kept)

    disk.free()  # space comes back: the waiting events go out with the next one
    s.undo()
    events = assert_whole_lines(s.log.path)
    state = replay(s.log.path)
    assert [(t["user"], t["answer"]) for t in state["turns"]] == [(t.user, t.answer) for t in s.turns]
    assert [t["user"] for t in state["turns"]] == ["Hello there!", "How are you today?"]
    assert state["settings"]["top_k"] == 7
    assert [e["event"] for e in events].count(Event.START) == 1
    assert len(warnings) == 2 and "caught up" in warnings[1]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_line_torn_by_a_full_disk_is_cut_off_again(tiny_engine, tmp_path, monkeypatch):
    warnings: list[str] = []
    s = logged_session(tiny_engine, tmp_path, warnings)
    drain(s.send("Hello there!"))
    before = s.log.path.read_bytes()
    disk = FullDisk(monkeypatch, s.log.path)
    disk.full = True
    drain(s.send("How are you today?"))
    drain(s.send("The quick brown fox?"))
    assert s.log.path.read_bytes() == before  # each write tore a line, and it was cut off
    assert disk.failures >= 3 and len(warnings) == 1
    disk.full = False
    s.undo()
    assert_whole_lines(s.log.path)
    assert [t["user"] for t in replay(s.log.path)["turns"]] == ["Hello there!", "How are you today?"]


@needs_dev_full
def test_a_disk_that_stays_full_stops_the_log_with_a_note_and_keeps_what_it_holds(
    tiny_engine, tmp_path, monkeypatch
):
    monkeypatch.setattr(session_log, "MAX_WAITING_BYTES", 2000, raising=False)
    warnings: list[str] = []
    s = logged_session(tiny_engine, tmp_path, warnings)
    drain(s.send("Hello there!"))
    disk = DevFull(s.log.path)
    disk.fill()
    for text in ("One more message, please.", "And another one.", "A third that waits.", "A fourth."):
        drain(s.send(text))
    assert len(warnings) == 2 and "no room" in warnings[0] and "stops here" in warnings[1]
    disk.free()
    drain(s.send("Space again."))  # the log stopped: it is not written to any more
    assert_whole_lines(s.log.path)
    assert [t["user"] for t in replay(s.log.path)["turns"]] == ["Hello there!"]


def test_a_line_torn_by_a_crash_does_not_swallow_the_next_event(tiny_engine, tmp_path):
    warnings: list[str] = []
    s = logged_session(tiny_engine, tmp_path, warnings)
    drain(s.send("Hello there!"))
    with open(s.log.path, "a", encoding="utf-8") as f:
        f.write('{"event": "turn", "user": "half')  # the process was killed mid-write
    resumed = SessionLog(s.log.path, {"model": "tiny"}, warn=warnings.append)
    resumed.write(Event.RESUME, model="tiny")
    resumed.write(Event.UNDO)
    kinds = [e["event"] for e in session_log.read_events(s.log.path)]
    assert kinds[-2:] == [Event.RESUME, Event.UNDO]
    assert replay(s.log.path)["turns"] == [] and warnings == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_the_input_history_falls_back_to_memory_with_one_warning(tmp_path, monkeypatch):
    from chatbot.terminal.input import KeptHistory

    path = tmp_path / "history"
    history = KeptHistory(str(path))
    history.append_string("first line")
    before = path.read_bytes()
    disk = FullDisk(monkeypatch, path)
    disk.full = True
    history.append_string("second\nline")
    history.append_string("third line")
    assert path.read_bytes() == before  # the torn entry was cut off again
    warning = history.take_warning()
    assert warning is not None and "cannot write the input history" in warning
    assert history.take_warning() is None  # said once
    assert disk.failures == 1  # then memory only: no write is tried per line
    assert history.get_strings() == ["first line", "second\nline", "third line"]
    assert list(KeptHistory(str(path)).load_history_strings()) == ["first line"]


@needs_dev_full
def test_a_terminal_chat_goes_on_when_the_disk_fills(tmp_path, terminals):
    """The REPL on a pseudo-terminal; after the first answer the input history and the
    session log become /dev/full. Each message still gets its answer, with one warning for
    each file and none of prompt_toolkit's "Unhandled exception"; when the log comes back,
    it catches up and restores every turn."""
    pytest.importorskip("pyte")
    from screen import Terminal

    answers = ["Alpha answer.", "Bravo answer.", "Charlie answer.", "Delta answer."]
    files = []
    for i, text in enumerate(answers):
        files.append(str(tmp_path / f"answer{i}.md"))
        Path(files[-1]).write_text(text, encoding="utf-8")
    data = tmp_path / "data"
    term = Terminal(
        [sys.executable, str(SCRIPT), *files],
        columns=220,
        lines=40,
        cwd=str(tmp_path),
        env={"XDG_DATA_HOME": str(data)},
    )
    terminals.append(term)
    term.wait_prompt(120)

    def send(line: str) -> None:
        term.type(line + "\r")
        term.wait_prompt(40)

    send("first message")
    history = DevFull(data / "chatbot" / "history")
    (log,) = (data / "chatbot" / "sessions").glob("*.jsonl")
    log_disk = DevFull(log)
    history.fill()
    log_disk.fill()

    send("second message")
    send("third message")
    shown = "\n".join(term.lines())
    assert "Unhandled exception" not in term.raw and "Press ENTER" not in term.raw
    assert term.raw.count("cannot write the input history") == 1
    assert term.raw.count("no room to write the session log") == 1
    for answer in answers[:3]:
        assert answer in shown

    log_disk.free()  # space again
    send("fourth message")
    assert "Delta answer." in "\n".join(term.lines())
    assert "the session log caught up" in term.raw
    state = replay(log)
    assert [t["user"] for t in state["turns"]] == [
        "first message",
        "second message",
        "third message",
        "fourth message",
    ]
    assert [t["answer"] for t in state["turns"]] == answers
    assert_whole_lines(log)
