"""Issue 37, the first hour with `chatbot serve` and `run --server`: the banner says how
requests run as /health does, a taken port is one line before the model loads, a body sent
without `Content-Type: application/json` is told so, and `run --server` leaves the settings
nobody gave to the server's defaults.

Real `chatbot serve` processes on a tiny random Llama (the native kernels batch its decode
steps); the client side against the recording fake OpenAI server of test_remote_clients.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import httpx
import pytest
from helpers import assert_one_line_error
from serve_helpers import free_port, health, running_server, save_tiny_model
from test_remote_clients import FakeServer

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """(base URL, the server's stderr) of `chatbot serve` on the native kernels."""
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running_server("--model", str(model_dir), "--served-model-name", "tiny", log=log) as url:
        yield url, log.read_text()


@pytest.mark.needs_kernels
def test_the_banner_says_how_requests_run_as_health_does(served):
    """Defect 3: the banner said "one generation at a time" while /health said concurrency 8
    and the worker batched their decode steps."""
    url, banner = served
    h = health(url)
    assert h["concurrency"] > 1 and h["batched_steps"] is not None  # the kernels batch here
    assert h["note"].startswith(f"up to {h['concurrency']} generations at once")
    (line,) = [line for line in banner.splitlines() if line.startswith("serving tiny on ")]
    assert f" · {h['note']} · " in line and "one generation at a time" not in line


def test_one_at_a_time_is_said_where_it_is_so():
    from types import SimpleNamespace

    from chatbot.server.worker import Worker

    assert Worker.describe(SimpleNamespace(slots=1)).startswith("one generation at a time")


def test_a_taken_port_is_one_line_before_the_model_loads(model_dir, tmp_path, capsys):
    """Defect 4: the model loaded, "serving ... on :P" was printed, then uvicorn's "[Errno 98]
    address already in use"."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "chatbot.cli.app",
                "serve",
                "--model",
                str(model_dir),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        # In this process: the port is refused before a model that does not exist is looked at.
        line = assert_one_line_error(
            capsys, "serve", "--model", str(tmp_path / "nowhere"), "--port", str(port)
        )
    assert proc.returncode == 2 and "serving" not in proc.stderr
    assert proc.stderr.strip() == line  # one line, the same
    assert f"port {port} on 127.0.0.1 is already in use" in line and "--port" in line


def test_a_free_port_is_served_on_the_socket_bound_first(model_dir, tmp_path):
    """The socket is bound before the load and handed to uvicorn: /health answers on it."""
    with running_server("--model", str(model_dir), "--host", "localhost") as url:
        assert health(url)["status"] == "ok"


@pytest.mark.parametrize(
    "content_type, shown",
    [
        ("application/x-www-form-urlencoded", "'application/x-www-form-urlencoded' (curl -d sends that"),
        ("text/plain", "not 'text/plain'"),
        (None, "this request has none"),
    ],
)
def test_a_body_not_sent_as_json_is_a_415_naming_the_content_type(served, content_type, shown):
    """Defect 5: such a body was answered "body: Input should be a valid dictionary or object
    to extract fields from"."""
    url, _ = served
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(f"{url}/chat/completions", content=json.dumps(CHAT), headers=headers, timeout=30)
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type" and shown in error["message"]
    assert "Content-Type: application/json" in error["message"]


def test_json_with_a_charset_is_answered(served):
    url, _ = served
    headers = {"Content-Type": "application/json; charset=utf-8"}
    r = httpx.post(f"{url}/chat/completions", content=json.dumps(CHAT), headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert (
        httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1}).status_code
        == 200
    )


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


def run_remote(fake, tmp_path, lines, *flags):
    return subprocess.run(
        [sys.executable, "-m", "chatbot.cli", "run", "--server", fake.url, *flags],
        input="".join(f"{line}\n" for line in lines),
        capture_output=True,
        text=True,
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")},
        timeout=120,
        check=False,
    )


SAMPLING_FIELDS = {"temperature", "top_p", "max_tokens", "seed", "top_k", "repetition_penalty"}


def test_run_server_sends_only_the_settings_given(fake, tmp_path):
    """Defect 6: `run --server` sent temperature 0.7, top_p 0.9 and max_tokens 512 over the
    server's preset, and /set showed top_k 0 and repetition_penalty 1.0, never sent."""
    proc = run_remote(fake, tmp_path, ["/set", "Hello"])
    assert proc.returncode == 0, proc.stderr
    assert not SAMPLING_FIELDS & fake.requests[-1].keys(), fake.requests[-1]
    rows = [re.split(r"\s{2,}", line) for line in proc.stderr.splitlines()]
    listed = {row[0]: row[1] for row in rows if len(row) == 3}
    for key in ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "seed"):
        assert listed[key] == "server's default", proc.stderr

    proc = run_remote(
        fake, tmp_path, ["/set top_k 5 repetition_penalty 1.0", "Hello", "/set"], "--temperature", "0.3"
    )
    assert proc.returncode == 0, proc.stderr
    sent = fake.requests[-1]
    assert {k: sent[k] for k in SAMPLING_FIELDS & sent.keys()} == {
        "temperature": 0.3,
        "top_k": 5,
        "repetition_penalty": 1.0,
    }
    assert "temperature         0.3 " in proc.stderr and "top_p               server's default" in proc.stderr


@pytest.mark.parametrize("columns", [80, 50])
def test_set_on_a_terminal_shows_the_servers_defaults(fake, tmp_path, terminals, columns):
    from screen import Terminal

    term = Terminal(
        [sys.executable, "-m", "chatbot.cli", "run", "--server", fake.url, "--max-new-tokens", "40"],
        columns=columns,
        env={"XDG_DATA_HOME": str(tmp_path / "data"), "PROMPT_TOOLKIT_NO_CPR": "1"},
    )
    terminals.append(term)
    term.wait_prompt()
    term.type("/set\r")
    term.wait_text("stream_interval")
    term.wait_prompt()
    lines = term.lines()
    listed = "\n".join(lines[max(i for i, line in enumerate(lines) if line.startswith("> /set")) :])
    # temperature, top_p, top_k, repetition_penalty, repeat_last_n, seed, think, think_budget:
    # all but max_new_tokens (40), stream_interval and format
    assert listed.count("server's default") == 8, listed
    assert "40" in listed and not any(v in listed for v in ("0.7", "0.9", "512", "1.1")), listed
