"""A library user of `ChatSession` gets the same session log as the REPL: every change of the
conversation is on disk when it happens, and replaying the log gives the conversation back."""

from __future__ import annotations

import json

import pytest

from chatbot.config import ChatConfig, SamplingConfig
from chatbot.conversation.log import Event, SessionLog, replay
from chatbot.conversation.session import ChatSession
from chatbot.errors import ContextFullError

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=6)


def logged_session(engine, tmp_path, **cfg) -> ChatSession:
    s = ChatSession(engine, ChatConfig(system="Be brief.", sampling=GREEDY, **cfg))
    s.log = SessionLog.create({"model": "tiny", "system": s.system, "settings": GREEDY.as_dict()}, tmp_path)
    s.model_name = "tiny"
    return s


def drain(chunks) -> str:
    return "".join(c.text for c in chunks)


def events(s: ChatSession) -> list[str]:
    return [json.loads(line)["event"] for line in s.log.path.read_text().splitlines()]


def test_replaying_the_log_gives_the_conversation_back(tiny_engine, tmp_path):
    s = logged_session(tiny_engine, tmp_path)
    drain(s.send("Hello there!"))
    drain(s.send("How are you today?"))
    drain(s.retry(SamplingConfig(temperature=5.0, max_new_tokens=4, seed=3)))
    s.undo()
    drain(s.send("The quick brown fox?"))
    s.set_sampling(GREEDY.with_value("top_k", 7))
    s.set_system("You are a tiny test model.")
    assert s.can_continue()  # six greedy tokens end by length
    drain(s.continue_answer())
    state = replay(s.log.path)
    assert [(t["user"], t["answer"]) for t in state["turns"]] == [(t.user, t.answer) for t in s.turns]
    assert state["system"] == s.system and state["settings"]["top_k"] == 7
    assert events(s)[:4] == [Event.START, Event.SEND, Event.TURN, Event.SEND]
    assert Event.UNDO in events(s) and Event.SYSTEM in events(s)


def test_line_separators_in_a_message_stay_inside_its_line(tiny_engine, tmp_path):
    # U+0085, U+2028 and U+2029 are line breaks to `str.splitlines` (and to editors) but not to
    # JSON, which leaves them raw: a sampled answer that held one tore the line for such readers.
    s = logged_session(tiny_engine, tmp_path)
    message = "one\u2028two\x85three\u2029four"
    drain(s.send(message))
    assert events(s) == [Event.START, Event.SEND, Event.TURN]
    raw = s.log.path.read_bytes()
    assert raw.count(b"\n") == 3 and "\u2028".encode() not in raw and b"\\u2028" in raw
    assert replay(s.log.path)["turns"][0]["user"] == message == s.turns[0].user


def test_an_answer_cut_short_is_logged_as_interrupted(tiny_engine, tmp_path):
    s = logged_session(tiny_engine, tmp_path)
    chunks = s.send("Hello there!")
    next(chunks)
    assert events(s)[-1] == Event.SEND  # on disk before the answer: a crash keeps the message
    chunks.close()  # what Ctrl-C does
    state = replay(s.log.path)
    assert len(state["turns"]) == 1 and state["turns"][0]["interrupted"]
    assert state["turns"][0]["answer"] == s.turns[0].answer


def test_a_message_that_does_not_fit_is_cancelled(tiny_engine, tmp_path):
    s = logged_session(tiny_engine, tmp_path)
    with pytest.raises(ContextFullError):
        drain(s.send("word " * 5000))
    assert events(s)[-2:] == [Event.SEND, Event.CANCEL]
    assert replay(s.log.path)["turns"] == [] == s.turns


def test_a_loaded_chat_is_logged_whole(tiny_engine, tmp_path):
    s = logged_session(tiny_engine, tmp_path)
    s.restore({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})
    state = replay(s.log.path)
    assert [(t["user"], t["answer"]) for t in state["turns"]] == [("Hi", "Hello!")]
    assert events(s)[-1] == Event.LOAD


def test_ctrl_c_while_the_message_is_written_cancels_it(tiny_engine, tmp_path, monkeypatch):
    """A Ctrl-C that arrives while the message is being written (the log holds it back and
    raises it right after) leaves log and session agreeing: no turn."""
    s = logged_session(tiny_engine, tmp_path)
    write = SessionLog.write
    pressed = []

    def write_then_interrupt(self, event, **fields):
        write(self, event, **fields)
        if event == Event.SEND and not pressed:
            pressed.append(event)
            raise KeyboardInterrupt

    monkeypatch.setattr(SessionLog, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        drain(s.send("Hello there!"))
    assert events(s)[-2:] == [Event.SEND, Event.CANCEL]
    assert replay(s.log.path)["turns"] == [] == s.turns
    drain(s.send("Again?"))  # the session goes on
    assert [t["user"] for t in replay(s.log.path)["turns"]] == ["Again?"]
