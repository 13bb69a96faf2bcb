"""`chatbot run --server` against the servers people run (issue 25): URLs in every form, a
404 or a refused key said as such, a server that sends no usage, one that ignores
`continue_final_message` (a tiny fake OpenAI server in a thread, and llama-cpp-python's real
one), a piped chat whose message fails, and the remote REPL on an 80-column terminal.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from serve_helpers import CHATBOT, free_port

STORY = "Once upon a time a dragon lived in a cave near the sea and guarded a hoard of gold coins"


class FakeServer:
    """An OpenAI-compatible server at `root` that streams `STORY` a word a chunk, sends no
    usage, ignores `continue_final_message`, answers 500 to a message with "fail" in it,
    and (with `key`) wants that bearer key. `requests` has every chat request's body."""

    def __init__(self, root: str = "/v1", key: str | None = None) -> None:
        self.root, self.key = root, key
        self.story = STORY  # what every answer says (a test may change it)
        self.reasoning: str | None = None  # thinking sent before it, as `reasoning_content` deltas
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def allowed(self) -> bool:
                if fake.key is not None and self.headers.get("Authorization") != f"Bearer {fake.key}":
                    self.reply(
                        401, {"error": {"message": "Invalid API key", "type": "invalid_request_error"}}
                    )
                    return False
                return True

            def do_GET(self) -> None:
                if self.path != f"{fake.root}/models":
                    self.reply(404, {"detail": "Not Found"})
                elif self.allowed():
                    self.reply(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != f"{fake.root}/chat/completions":
                    self.reply(404, {"detail": "Not Found"})
                    return
                if not self.allowed():
                    return
                fake.requests.append(body)
                if "fail" in body["messages"][-1]["content"]:
                    self.reply(500, {"error": {"message": "the model fell over"}})
                    return
                words = fake.story.split()
                pieces = [w if i == 0 else " " + w for i, w in enumerate(words)][: body.get("max_tokens")]
                finish = "length" if len(pieces) < len(words) else "stop"
                if not body.get("stream"):
                    message = {"role": "assistant", "content": "".join(pieces)}
                    self.reply(200, {"choices": [{"index": 0, "message": message, "finish_reason": finish}]})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                thoughts = fake.reasoning.split(" ") if fake.reasoning else []
                for piece in [t if i == 0 else " " + t for i, t in enumerate(thoughts)]:
                    choice = {"index": 0, "delta": {"reasoning_content": piece}, "finish_reason": None}
                    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake"}
                    self.wfile.write(f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode())
                for i, piece in enumerate(pieces):
                    last = i == len(pieces) - 1
                    choice = {
                        "index": 0,
                        "delta": {"content": piece},
                        "finish_reason": finish if last else None,
                    }
                    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake"}
                    self.wfile.write(f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return self.host + self.root

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "FAKE_KEY": "wrong"}


def run_piped(url, env, lines, *flags, timeout=120):
    return subprocess.run(
        [CHATBOT, "run", "--server", url, *flags],
        input="".join(f"{line}\n" for line in lines),
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=timeout,
    )


def test_server_urls_in_any_form(env):
    """With or without /v1, a trailing slash, a full endpoint: the API root; a custom root
    (/v2, /api/v1) as given."""
    forms = {
        "/v1": ["", "/", "/v1/", "/v1/chat/completions", "/v1/completions", "/v1/models"],
        "/v2": ["/v2", "/v2/chat/completions/"],
        "/api/v1": ["/api/v1"],
    }
    for root, tails in forms.items():
        server = FakeServer(root)
        try:
            for tail in tails:
                proc = run_piped(server.host + tail, env, ["hi"], "--max-new-tokens", "3")
                assert proc.returncode == 0, (tail, proc.stderr)
                assert proc.stdout.strip() == "Once upon a", (tail, proc.stdout, proc.stderr)
                assert len(server.requests) == 1, tail
                server.requests.clear()
        finally:
            server.close()


def test_piped_chat_to_nothing_exits_non_zero(env):
    proc = run_piped("http://127.0.0.1:9/v1", env, ["hi"])
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the server at http://127.0.0.1:9/v1" in lines[0], proc.stderr


def test_piped_message_that_fails_exits_1_after_the_rest(fake, env):
    proc = run_piped(fake.url, env, ["hello", "please fail", "bye"], "--max-new-tokens", "2")
    assert proc.returncode == 1, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line] == ["Once upon", "Once upon"]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: server error (500): the model fell over"], proc.stderr


def test_no_api_at_the_url_is_a_404_not_unreachable(fake, env):
    proc = run_piped(fake.host + "/nothing/here", env, ["hi", "/model"])
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "no OpenAI API at" in line and "/nothing/here" in line and "(GET models: 404)" in line, line
    assert "cannot reach" not in line and "/model" not in line and len(line.splitlines()) == 1


def test_refused_key_says_so(env):
    server = FakeServer(key="right")
    try:
        wrong = run_piped(server.url, env, ["hi"], "--api-key-env", "FAKE_KEY")
        assert wrong.returncode == 2
        assert "the server refused the API key in FAKE_KEY (401): Invalid API key" in wrong.stderr
        assert "pass it with" not in wrong.stderr
        none = run_piped(server.url, env, ["hi"])
        assert none.returncode == 2 and "wants an API key (401)" in none.stderr
        assert "--api-key-env VAR" in none.stderr
        right = run_piped(server.url, {**env, "FAKE_KEY": "right"}, ["hi"], "--api-key-env", "FAKE_KEY")
        assert right.returncode == 0 and right.stdout.startswith("Once upon"), right.stderr
    finally:
        server.close()


def test_no_usage_is_unknown_not_zero(fake, env):
    proc = run_piped(fake.url, env, ["hello", "/stats", "/cache"], "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert re.search(r"^prompt \? tok · first token [\d.]+ s · 5 tok \(estimated\)", err, re.MULTILINE), err
    row = next(line for line in err.splitlines() if line.startswith("│   1 "))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[1] == "?" and cells[8] == "?", row  # fed and cache
    assert "?: not reported by the server" in err
    assert "conversation (last usage)" in err and "unknown (the server sends no usage)" in err
    assert " 0 tok" not in err


def test_no_usage_toolbar_says_unknown(fake):
    import io

    from rich.console import Console

    from chatbot.conversation.remote import RemoteBackend, RemoteSession, remote_sampling
    from chatbot.terminal.repl import Repl

    backend = RemoteBackend(fake.url)
    backend.connect()
    session = RemoteSession(backend, None, remote_sampling(max_new_tokens=3))
    console = Console(file=io.StringIO(), width=200)
    repl = Repl(session, backend, console, plain=True, info=console)
    assert "context 0 tok" in "".join(text for _, text in repl.toolbar(200))  # nothing said yet
    repl.handle("hello")
    bar = "".join(text for _, text in repl.toolbar(200))
    assert "context ? tok" in bar and f"fake @ {fake.url}" in bar, bar


def test_continue_on_a_server_that_ignores_continue_final_message(fake, env):
    """The fake starts a new reply (it repeats the story from the start): /continue asks with
    a message, says so once, and keeps only what comes after the answer so far."""
    proc = run_piped(
        fake.url, env, ["Tell me a story.", "/continue", "/continue", "/history"], "--max-new-tokens", "4"
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[:3] == ["Once upon a time", " a dragon lived in", " a cave near the"], proc.stdout
    note = "this server does not continue a final assistant message"
    assert proc.stderr.count(note) == 1, proc.stderr
    asked = fake.requests[-1]["messages"]
    assert asked[-1]["role"] == "user" and asked[-1]["content"].startswith("Continue your last answer")
    assert asked[-2] == {"role": "assistant", "content": "Once upon a time a dragon lived in"}
    assert "continue_final_message" not in fake.requests[-1]
    assert "Once upon a time a dragon lived in a cave near the" in proc.stderr  # /history: one answer


def test_continue_method_is_told_by_the_prompt_counts():
    """vLLM and chatbot serve honour the field (A < B); llama-cpp-python ignores it and closes
    the answer (A = B = C + 7); llama-server and ollama leave it open by themselves (A = B =
    C + 1); no usage: the prompt."""
    import httpx
    import openai

    from chatbot.conversation.remote import RemoteBackend

    refused = openai.BadRequestError(
        "400", response=httpx.Response(400, request=httpx.Request("POST", "http://x")), body=None
    )
    for counts, method in [
        ((30, 37, 30), "final-message"),
        ((38, 38, 31), "prompt"),
        ((32, 32, 31), "final-message"),
        ((None, 38, 31), "prompt"),
        ((30, refused, 30), "final-message"),  # chatbot serve: a final assistant message needs the field
        ((refused, 38, 31), "prompt"),
    ]:
        backend = RemoteBackend("http://127.0.0.1:9/v1", model="m")
        answers = iter(counts)

        def prompt_tokens(messages, extra, answers=answers):
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            return answer

        backend._prompt_tokens = prompt_tokens
        assert backend.continue_method() == method, counts


def test_continuation_join():
    from chatbot.conversation.remote import ContinuationJoin

    def join(before, pieces):
        j = ContinuationJoin(before)
        return "".join(j.feed(p) for p in pieces)

    assert join("a body that", ["a", " body", " that", " runs"]) == " runs"  # the repeat goes
    assert join("a body that", ["One", " day"]) == " One day"  # a new reply: a space between words
    assert join("It ended.", ["Then"]) == " Then"
    assert join("a body that ", [" runs"]) == "runs"
    assert join("a drag", ["on,"]) == " on,"  # cut inside a word: cannot be known, a space
    assert join("a list:", [",", " b"]) == ", b"


def _llama_cpp_server_missing() -> str | None:
    for module in (
        "llama_cpp",
        "llama_cpp.server",
        "uvicorn",
        "fastapi",
        "sse_starlette",
        "starlette_context",
    ):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed (pip install 'llama-cpp-python[server]')"
        except ModuleNotFoundError:
            return f"{module} is not installed (pip install 'llama-cpp-python[server]')"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_llama_cpp_server_missing() is not None, reason=str(_llama_cpp_server_missing()))
def test_continue_against_llama_cpp_python(env):
    """llama-cpp-python's server ignores `continue_final_message` (it would answer afresh:
    "...one thatThe story of a dragon..."): /continue goes on with the story instead."""
    import httpx

    from chatbot.models.loader import DEFAULT_GGUF, DEFAULT_PACKAGE

    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    gguf = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)
    port = free_port()
    args = ["--model", gguf, "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"  # no /v1: the client finds it
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "llama_cpp.server did not start"
            time.sleep(0.3)
        chat = run_piped(
            url,
            env,
            ["Tell me a story about a dragon.", "/continue", "/history"],
            "--temperature",
            "0",
            "--max-new-tokens",
            "8",
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert chat.returncode == 0, chat.stderr
    first, more = chat.stdout.splitlines()[:2]
    opening = " ".join(first.split()[:3])
    assert more.strip() and opening not in more, (first, more)  # not the reply started again
    assert not re.match(r"\s*(Once|The|Sure|Hello|Here|In)\b", more), more  # nor a new reply
    assert "does not continue a final assistant message" in chat.stderr
    whole = " ".join(chat.stderr.split())
    assert " ".join((first + more).split()) in whole  # /history: one answer, the parts joined


def test_remote_repl_at_80_columns_breaks_no_word(fake, tmp_path):
    """The banner, the stats line and /history wrap by words on an 80-column terminal."""
    from screen import Terminal, missing_words

    term = Terminal(
        [CHATBOT, "run", "--server", fake.url, "--max-new-tokens", "40"],
        columns=80,
        env={"XDG_DATA_HOME": str(tmp_path / "data"), "PROMPT_TOOLKIT_NO_CPR": "1"},
    )
    try:
        term.wait_prompt()
        term.type("Tell me a story.\r")
        term.wait_text("ms/tok")
        term.wait_prompt()
        term.type("/history\r")
        term.wait_text("[1] bot")
        term.wait_prompt()
        lines = term.lines()
    finally:
        term.close()
    shown = "\n".join(lines)
    banner = f"fake on {fake.url} · the server's prefix cache keeps the conversation"
    for expected in (banner, STORY, "prompt ? tok · first token", "tok (estimated)", "server"):
        assert missing_words(expected, lines) == [], (expected, shown)
    assert shown.count("dragon") >= 2  # the answer, and again in /history


def test_the_repl_never_asks_which_kind_of_session_it_has():
    source = Path(importlib.util.find_spec("chatbot.terminal.repl").origin).read_text()
    for needle in ("backend", "remote", "Remote", "ChatSession", "type: ignore", 'cast("'):
        assert needle not in source, needle
    assert not re.search(r"isinstance\(\s*(self\.)?session", source)
    assert not re.search(r"getattr\(\s*(self\.)?session", source)
