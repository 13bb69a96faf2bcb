"""Crafted session logs and saved chats (issue 57, items 3, 8, 9, 13, 16): what a log says
about files is never read; a lone surrogate in a chat, a log or a server's answer is replaced
where the text comes in; a FIFO or a bad link among the logs hides none of the others; a chat
far too long for the context is refused before it is tokenized; a signal during `/save` in a
pipe leaves no temporary file."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli
from test_remote_clients import FakeServer
from test_repl import Chat
from test_session import assert_invariant

from chatbot.conversation import log as session_log
from chatbot.conversation.log import find_session, list_sessions, replay

SECRET = "TOPSECRET-PASSWORD-hunter2"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_model, tiny_tokenizer):
    """The tiny model as a transformers folder, for the real `chatbot` command."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def write_log(directory: Path, name: str, events: list[dict], raw: list[str] = ()) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    lines = [json.dumps(e) for e in events] + list(raw)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def start(**fields) -> dict:
    return {"event": "start", "version": 1, "model": "tiny", "system": None, "settings": {}, **fields}


def turn(user: str, answer: str = "fine") -> dict:
    return {"event": "turn", "user": user, "answer": answer, "stats": {}}


# -- 3. a log names a file: it is never read ----------------------------------------------------


def piped(capsys, monkeypatch, lines: list[str], *args: str) -> tuple[int | str | None, str]:
    stdin = "".join(line + "\n" for line in lines).encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    code, out, err = cli(capsys, "run", "--device", "cpu", "--opt", "off", *args)
    return code, out + err


def watching(real_open, opened: list[str]):
    def watched(path, *args, **kwargs):
        opened.append(os.fsdecode(path))
        return real_open(path, *args, **kwargs)

    return watched


def test_resume_never_reads_a_template_file_the_log_names(capsys, monkeypatch, tmp_path, tiny_dir):
    """A log whose `load.template` names a secret file: the file's text reaches neither the
    cache nor `/cache` nor any output; the chat goes on with the model's own template."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    secret = tmp_path / "shadow"
    secret.write_text(SECRET + "\n")
    for name, template in (("aaaa", str(secret)), ("bbbb", str(tmp_path / "shadow.jinja"))):
        if name == "bbbb":
            (tmp_path / "shadow.jinja").write_text(SECRET)
        load = {"model": str(tiny_dir), "template": template}
        log = write_log(
            tmp_path / "data" / "chatbot" / "sessions",
            f"20260101-00000{len(name)}-{name}.jsonl",
            [start(load=load), turn("Hello there!")],
        )
        opened: list[str] = []
        monkeypatch.setattr(os, "open", watching(os.open, opened))
        code, shown = piped(
            capsys, monkeypatch, ["/cache", "/model", "How are you?", "/cache"], "--resume", log.stem
        )
        monkeypatch.undo()
        monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
        assert code == 0, shown
        assert SECRET not in shown and "hunter2" not in shown
        assert not any(Path(p).name.startswith("shadow") for p in opened), opened
        assert "resuming session" in shown
        assert f"the log's template {template} is a file: not read" in shown
        # the resumed log does not carry the path on either
        assert str(secret) not in log.read_text().split("\n", 2)[-1]
    capsys.readouterr()


def test_logged_settings_never_take_a_path_for_a_template(tmp_path):
    from chatbot.conversation.settings import logged_settings

    secret = tmp_path / "secret.jinja"
    secret.write_text(SECRET)
    good, bad = logged_settings({"load": {"model": "m", "template": str(secret)}})
    assert "template" not in good and bad == ["template"]
    good, _ = logged_settings({"load": {"template": "chatml"}})
    assert good["template"] == "chatml"


# -- 8. lone surrogates ---------------------------------------------------------------------------


def test_a_saved_chat_with_lone_surrogates_loads_and_goes_on(tiny_model, tiny_tokenizer, tmp_path):
    saved = tmp_path / "chat.json"
    saved.write_text(
        '{"system": "be \\udfff brief", "turns": [{"user": "hi \\ud800 there", "answer": "ok \\udc00"}]}'
    )
    c = Chat(tiny_model, tiny_tokenizer, tmp_path / "sessions")
    c.lines(f"/load {saved}", "/history", "next message", f"/save {tmp_path / 'again.json'}")
    err = c.err.getvalue()
    assert "failed" not in err and "error" not in err, err
    assert [t.user for t in c.session.turns] == ["hi \ufffd there", "next message"]
    assert c.session.turns[0].answer == "ok \ufffd" and c.session.system == "be \ufffd brief"
    assert json.loads((tmp_path / "again.json").read_text())["turns"][0]["user"] == "hi \ufffd there"
    # the log replays to the same conversation, the replacement characters in it
    state = replay(c.repl.log.path)
    assert [t["user"] for t in state["turns"]] == ["hi \ufffd there", "next message"]
    assert_invariant(c.session)


def test_a_messages_chat_with_lone_surrogates_loads(tiny_model, tiny_tokenizer, tmp_path):
    saved = tmp_path / "chat.json"
    saved.write_text(
        '{"messages": [{"role": "system", "content": "\\ud800"}, {"role": "user", "content": "a\\ud800"},'
        ' {"role": "assistant", "content": "b\\udbff"}]}'
    )
    c = Chat(tiny_model, tiny_tokenizer, None)
    c.lines(f"/load {saved}", "go on")
    assert "failed" not in c.err.getvalue(), c.err.getvalue()
    assert (c.session.turns[0].user, c.session.turns[0].answer) == ("a\ufffd", "b\ufffd")
    assert c.session.system == "\ufffd"


def test_a_server_answer_with_a_lone_surrogate_breaks_nothing(tmp_path):
    """The answer's surrogate becomes U+FFFD where it comes in: the pipe gets UTF-8, the next
    message goes out, /save writes it."""
    server = FakeServer()
    server.story = "Bad \ud800 word and more"
    try:
        saved = tmp_path / "chat.json"
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("chatbot")), "run", "--server", server.url],
            input=f"hello\nand again\n/save {saved}\n".encode(),
            capture_output=True,
            check=False,
            env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")},
            timeout=120,
        )
        out, err = proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")
        assert proc.returncode == 0, err
        assert [line for line in out.splitlines() if line] == ["Bad \ufffd word and more"] * 2, out
        assert "Error" not in err and "error" not in err, err
        assert len(server.requests) == 2
        assert server.requests[1]["messages"][1]["content"] == "Bad \ufffd word and more"
        assert json.loads(saved.read_text())["turns"][0]["answer"] == "Bad \ufffd word and more"
    finally:
        server.close()


# -- 9. a FIFO, a link loop, a dangling link among the logs ------------------------------------


def test_bad_entries_among_the_logs_hide_none_of_the_others(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    logs = tmp_path / "chatbot" / "sessions"
    good = write_log(logs, "20260101-000001-good.jsonl", [start(), turn("the good one")])
    older = write_log(logs, "20260101-000000-oldr.jsonl", [start(), turn("an older one")])
    os.utime(older, (1, 1))
    os.mkfifo(logs / "20260102-000000-fifo.jsonl")
    os.symlink(logs / "20260102-000001-loop.jsonl", logs / "20260102-000001-loop.jsonl")
    os.symlink(tmp_path / "nowhere", logs / "20260102-000002-dang.jsonl")
    os.mkdir(logs / "20260102-000003-fold.jsonl")
    assert [i.path for i in list_sessions(logs)] == [good, older]
    assert find_session("last", logs) == good
    assert find_session("20260101-000001", logs) == good
    code, out, err = cli(capsys, "sessions")
    assert code == 0, err
    assert "the good one" in out and "an older one" in out and "no logged sessions" not in out
    for ref in ("20260102-000000-fifo", "20260102-000001-loop", "20260102-000002-dang"):
        with pytest.raises(session_log.ChatbotError, match="no session"):
            find_session(ref, logs)


# -- 16. a signal during /save in a pipe ----------------------------------------------------------

# `chatbot run` in a pipe whose fsync of the save's temporary file waits (after saying so in
# READY) until the test's signal comes: the signal lands in the middle of the save, every time.
SLOW_SAVE = """
import os, sys, time
from pathlib import Path
real_fsync = os.fsync
def fsync(fd):
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
        Path(sys.argv[1]).write_text("writing")
        time.sleep(600)
    real_fsync(fd)
os.fsync = fsync
from chatbot.cli.app import main
main(sys.argv[2:])
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="finds the temporary file by /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_save_in_a_pipe_leaves_no_temporary_file(tmp_path, tiny_dir, signum):
    folder = tmp_path / "saved"
    folder.mkdir()
    target = folder / "chat.json"
    target.write_text('{"turns": []}\n')
    ready = tmp_path / "ready"
    args = ["run", "--model", str(tiny_dir), "--device", "cpu", "--opt", "off", "--threads", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_SAVE, str(ready), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"},
    )
    try:
        proc.stdin.write(f"Hello there!\n/save {target}\n".encode())
        proc.stdin.close()
        deadline = time.monotonic() + 300  # the model loads and answers first
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.communicate(timeout=60)
        assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]  # in the middle of it
        proc.send_signal(signum)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signum, proc.stderr.read().decode()
    assert sorted(p.name for p in folder.iterdir()) == ["chat.json"]
    assert target.read_text() == '{"turns": []}\n'  # the old file is whole


# -- 13. a chat far too long for the context -------------------------------------------------------


def test_a_chat_far_too_long_is_refused_before_it_is_tokenized(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    """A 1 MB chat (the cap is 64 MiB) against a 512-token context: refused in one line by its
    characters, with no more than a few characters tokenized; the chat goes on as it was.
    (A 20 MB one took 50 s and 3.6 GB to be found too long.)"""
    turns = [{"user": f"question {i} " + "word " * 200, "answer": "answer " * 200} for i in range(400)]
    saved = tmp_path / "big.json"
    saved.write_text(json.dumps({"turns": turns}))
    assert saved.stat().st_size > 900_000
    c = Chat(tiny_model, tiny_tokenizer, None)
    c.lines("Hello there!")
    before = [(t.user, t.answer) for t in c.session.turns]
    tokenized: list[int] = []
    tokenizer_type = type(c.session.text.tokenizer)
    encode = tokenizer_type.__call__

    def counting(self, text, *args, **kwargs):
        tokenized.append(sum(map(len, text)) if isinstance(text, list) else len(text))
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_type, "__call__", counting)
    c.lines(f"/load {saved}", "/history")
    monkeypatch.undo()
    errors = [line for line in c.err.getvalue().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not loaded" in errors[0] and "over the context of 512" in errors[0], errors
    assert sum(tokenized) < 10_000, sum(tokenized)  # (all of it: 900,000 characters)
    assert [(t.user, t.answer) for t in c.session.turns] == before
    c.lines("and on")
    assert len(c.session.turns) == 2
