"""`chatbot run --server` against a real `chatbot serve` process (a tiny random Llama) on
127.0.0.1: piped, in a pseudo-terminal, resumed, and on the error paths; and against
llama-cpp-python's OpenAI-compatible server where that is installed.

The reference for answers is the server itself, asked directly with the official `openai`
client (greedy, so the same messages give the same answer).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import time
from pathlib import Path

import openai
import pytest
from serve_helpers import CHATBOT, PIDS, free_port, health, running_server, save_tiny_model

KEY_ENV = {"TEST_REMOTE_KEY": "k3y"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running_server(
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--api-key-env",
        "TEST_REMOTE_KEY",
        env=KEY_ENV,
        log=log,
    ) as url:
        yield url


@pytest.fixture
def env(tmp_path):
    return {**os.environ, **KEY_ENV, "XDG_DATA_HOME": str(tmp_path / "data")}


def run_piped(server, env, lines, *flags, timeout=180):
    args = [CHATBOT, "run", "--server", server, "--api-key-env", "TEST_REMOTE_KEY", *flags]
    return subprocess.run(
        args,
        input="".join(f"{line}\n" for line in lines),
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=timeout,
    )


def direct_answer(server, messages, max_tokens):
    c = openai.OpenAI(base_url=server, api_key="k3y", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


STATS = re.compile(
    r"prompt (\d+) tok \((\d+) cached\) · first token [\d.]+ s · (\d+) tok · .*ms/tok · server"
)


def test_piped_chat_with_commands(server, env, tmp_path):
    saved = tmp_path / "chat.json"
    proc = run_piped(
        server,
        env,
        [
            "Hello there!",
            "How are you today?",
            "/retry",
            "/continue",
            "/cache",
            "/model",
            "/undo",
            "/stats",
            f"/save {saved}",
            "/history",
        ],
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
    )
    assert proc.returncode == 0, proc.stderr
    first = direct_answer(server, [{"role": "user", "content": "Hello there!"}], 6)
    second = direct_answer(
        server,
        [
            {"role": "user", "content": "Hello there!"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "How are you today?"},
        ],
        6,
    )
    out = proc.stdout.splitlines()
    assert out[0] == first and out[1] == second and out[2] == second  # greedy: /retry gives it again
    stats = [tuple(map(int, m.groups())) for m in STATS.finditer(proc.stderr)]
    assert len(stats) == 4, proc.stderr
    (p1, c1, n1), (p2, c2, n2), (p3, c3, _), (p4, c4, n4) = stats
    assert c1 == 0 and n1 == n2 == n4 == 6
    assert c2 == p1 + n1 - 1  # the server's prefix cache held turn 1
    assert p3 == p2 and c3 >= c2  # /retry: the same prompt, cut back on the server
    assert c4 > 0 and p4 > p2  # /continue sent the partial answer as the last message
    assert "max tokens" in proc.stderr
    assert "models on the server" in proc.stderr and "tiny" in proc.stderr
    assert "cache (on the server)" in proc.stderr and "reused at the last message" in proc.stderr
    assert "removed: How are you today?" in proc.stderr
    data = json.loads(saved.read_text())
    assert [m["content"] for m in data["messages"]] == ["Hello there!", first]
    # /continue's output: the answer went on from where /retry stopped
    assert out[3] and len(out) >= 4


def test_resume_and_load_a_remote_chat(server, env, tmp_path):
    saved = tmp_path / "chat.json"
    first = run_piped(
        server, env, ["Hello there!", f"/save {saved}"], "--temperature", "0", "--max-new-tokens", "5"
    )
    assert first.returncode == 0, first.stderr
    again = run_piped(
        server, env, ["/history", "And the fox?"], "--resume", "--max-new-tokens", "5", "--temperature", "0"
    )
    assert again.returncode == 0, again.stderr
    assert "resuming session" in again.stderr and "Hello there!" in again.stderr
    p, c, _ = map(int, STATS.search(again.stderr).groups())
    assert c > 0 and p > c  # the history went with the message; the server still had its cache
    loaded = run_piped(server, env, [f"/load {saved}", "/history"], "--temperature", "0")
    assert "loaded 1 turn (" in loaded.stderr and "Hello there!" in loaded.stderr


def test_ctrl_c_in_a_terminal_closes_the_stream(server, env):
    """In a pseudo-terminal: Ctrl-C stops a long answer at once (the server stops too) and
    keeps it; /continue goes on; /model lists the server's models; Ctrl-D leaves."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        CHATBOT,
        [
            "run",
            "--server",
            server,
            "--api-key-env",
            "TEST_REMOTE_KEY",
            "--max-new-tokens",
            "3500",
            "--temperature",
            "1",
            "--seed",
            "3",
        ],
        env={**env, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"},
        encoding="utf-8",
        timeout=60,
        dimensions=(30, 100),
    )
    try:
        child.expect("Ctrl-D to exit")
        child.expect(">")
        child.sendline("Write a very long story.")
        deadline = time.monotonic() + 30
        while not health(server)["generating"] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        sent = time.perf_counter()
        child.sendintr()
        child.expect("interrupted: the partial answer is kept", timeout=20)
        assert time.perf_counter() - sent < 5
        deadline = time.monotonic() + 10
        while health(server)["generating"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not health(server)["generating"]  # the closed stream stopped the server's generation
        child.expect(">")
        child.sendline("/history")
        child.expect(r"\[interrupted\]")
        child.expect(">")
        child.sendline("/set max_new_tokens 4")
        child.expect("max_new_tokens = 4")
        child.expect(">")
        child.sendline("/continue")
        child.expect(r"prompt [\d,]+ tok \([\d,]+ cached\)")
        child.expect(">")
        child.sendline("/model")
        child.expect("models on the server")
        child.expect(">")
        time.sleep(0.3)
        child.send("\x04")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_remote_session_interrupt_retry_continue(server):
    """The backend object the REPL uses: an answer closed mid-stream is kept and marked;
    /continue extends it; /retry replaces it; /undo drops it."""
    from chatbot.conversation.remote import RemoteBackend, RemoteSession, remote_sampling

    backend = RemoteBackend(server, api_key="k3y")
    backend.connect()
    assert backend.model == "tiny"
    session = RemoteSession(backend, "Be brief.", remote_sampling(temperature=0.0, max_new_tokens=40))
    chunks = session.send("Hello there!")
    got = "".join(next(chunks).text for _ in range(3))
    chunks.close()
    turn = session.turns[-1]
    assert turn.interrupted and turn.answer == got and turn.stats.finish_reason == "interrupted"
    more = list(session.continue_answer())
    assert session.turns[-1].answer == got + "".join(c.text for c in more)
    assert not session.turns[-1].interrupted and more[-1].stats.cached_tokens > 0
    whole = direct_answer(server, session.messages()[:2], 40)
    assert session.turns[-1].answer.startswith(whole[: len(got)])
    retried = list(session.retry(remote_sampling(temperature=0.0, max_new_tokens=5)))
    assert session.turns[-1].answer == "".join(c.text for c in retried) and len(session.turns) == 1
    assert retried[-1].stats.generated_tokens == 5 and not retried[-1].stats.estimated
    assert session.undo().user == "Hello there!" and session.turns == []


def test_server_dying_mid_answer(tmp_path):
    """The server process killed while it streams: one error line's worth of RemoteError, the
    partial answer kept (marked interrupted), and the chat goes on (the next message gets
    'cannot reach')."""
    import signal

    from chatbot.conversation.remote import RemoteBackend, RemoteError, RemoteSession, remote_sampling
    from chatbot.errors import ChatbotError

    folder = save_tiny_model(tmp_path / "tiny")
    with running_server("--model", str(folder), "--served-model-name", "tiny") as url:
        backend = RemoteBackend(url)
        backend.connect()
        session = RemoteSession(backend, None, remote_sampling(temperature=1.0, seed=1, max_new_tokens=3500))
        chunks = session.send("Write a very long story.")
        got = "".join(next(chunks).text for _ in range(5))
        os.kill(PIDS[url], signal.SIGKILL)
        with pytest.raises(RemoteError) as caught:
            for chunk in chunks:
                got += chunk.text
        assert "\n" not in str(caught.value) and "broke during the answer" in str(caught.value)
        turn = session.turns[-1]
        assert turn.interrupted and turn.answer == got and len(got) > 0
        with pytest.raises(ChatbotError, match="cannot reach"):
            list(session.send("Are you there?"))
        assert len(session.turns) == 1  # the failed message left no turn


def test_unreachable_server_and_bad_names(env, capsys, server):
    port = free_port()  # nothing listens there
    proc = run_piped(f"http://127.0.0.1:{port}/v1", env, ["hi", "/history"], "--model", "tiny")
    # On a pipe nothing could be answered: one error line, and no chat
    assert proc.returncode == 2, proc.stderr
    assert "cannot reach the server" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr
    wrong_model = run_piped(server, env, ["hi"], "--model", "nope")
    assert wrong_model.returncode == 2 and "has no model 'nope'" in wrong_model.stderr
    assert len(wrong_model.stderr.strip().splitlines()) == 1
    bad_key = run_piped(server, {**env, "TEST_REMOTE_KEY": "wrong"}, ["hi"])
    assert bad_key.returncode == 2 and "refused the API key in TEST_REMOTE_KEY (401)" in bad_key.stderr
    assert len(bad_key.stderr.strip().splitlines()) == 1


def test_a_one_shot_on_an_unreachable_server_exits_2_as_docs_chat_md_says(env):
    """`chatbot run "hi" --server URL` where nothing listens: a bad flag before any answer,
    exit 2 with one line (as on a pipe); docs/chat.md's exit statuses say so (they said 1)."""
    port = free_port()  # nothing listens there
    proc = subprocess.run(
        [CHATBOT, "run", "hi", "--server", f"http://127.0.0.1:{port}"],
        capture_output=True, text=True, check=False, env=env, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "cannot reach the server" in proc.stderr
    chat_md = " ".join((Path(__file__).resolve().parents[1] / "docs" / "chat.md").read_text().split())
    statuses = chat_md.split("The exit status says whether it answered:", 1)[1]
    statuses = statuses.split(" The turn is logged", 1)[0]
    assert "1 when the model or the server failed while answering" in statuses
    assert "a `--server` that cannot be reached" in statuses.split("; 2 for", 1)[1], statuses


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--enable-streaming"], "--enable-streaming does not apply with --server"),
        (["--opt", "int8"], "--opt does not apply with --server"),
        (["--temperature", "-1"], "temperature must be"),
    ],
)
def test_refused_flags(capsys, flags, match):
    from helpers import assert_one_line_error

    assert_one_line_error(capsys, "run", "--server", "http://127.0.0.1:9/v1", *flags, match=match)


def test_api_key_env_without_server(capsys):
    from helpers import assert_one_line_error

    assert_one_line_error(capsys, "run", "--api-key-env", "X", match="goes with --server")


def _llama_cpp_server_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    for extra in (
        "llama_cpp.server",
        "uvicorn",
        "fastapi",
        "sse_starlette",
        "starlette_context",
        "pydantic_settings",
    ):
        try:
            if importlib.util.find_spec(extra) is None:
                return f"llama-cpp-python's server needs {extra} (pip install 'llama-cpp-python[server]')"
        except ModuleNotFoundError:
            return f"llama-cpp-python's server needs {extra}"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_llama_cpp_server_missing() is not None, reason=str(_llama_cpp_server_missing()))
def test_against_llama_cpp_server(tmp_path, env):
    """`chatbot run --server` against llama-cpp-python's OpenAI-compatible server on the
    default GGUF."""
    import sys

    import httpx

    from chatbot.models.loader import DEFAULT_GGUF, DEFAULT_PACKAGE

    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    gguf = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "llama_cpp.server did not start"
            time.sleep(0.5)
        result = run_piped(
            url,
            env,
            ["Say hello.", "What is 2 + 2?", "/model"],
            "--temperature",
            "0",
            "--max-new-tokens",
            "16",
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stdout.splitlines() if line.strip()]) >= 2
    assert result.stderr.count("server") >= 2 and "first token" in result.stderr


def test_stats_from_the_stream():
    """Figures from chunk arrival times; counts from usage, or estimated without it."""
    from types import SimpleNamespace

    from chatbot.conversation.remote import _stats
    from chatbot.terminal.render import format_remote_stats_line

    arrivals = [10.5, 10.6, 10.8, 10.9]
    usage = SimpleNamespace(
        prompt_tokens=120,
        completion_tokens=4,
        total_tokens=124,
        prompt_tokens_details=SimpleNamespace(cached_tokens=100),
    )
    s = _stats(10.0, arrivals, usage, "length")
    assert s.ttft_s == pytest.approx(0.5) and s.token_latencies_s == pytest.approx([0.1, 0.2, 0.1])
    assert (s.prompt_tokens, s.cached_tokens, s.context_tokens, s.generated_tokens) == (120, 100, 20, 4)
    assert s.ms_per_token_p50 == pytest.approx(100) and s.ms_per_token_p90 == pytest.approx(200)
    line = format_remote_stats_line(s)
    assert line.startswith(
        "prompt 120 tok (100 cached) · first token 0.50 s · 4 tok · 7.5 tok/s · p50 100 / p90 200"
    )
    assert line.endswith("server · max tokens")
    guess = _stats(10.0, arrivals, None, "stop")
    assert guess.estimated and guess.generated_tokens == 4 and guess.cached_tokens is None
    assert format_remote_stats_line(guess).startswith("prompt ? tok · first token 0.50 s · 4 tok (estimated)")


def test_stats_of_a_continued_turn_time_its_first_token_once(server, env):
    """Defect 11 of issue 37: /stats of a turn that /continue extended said "fed s 0.57"
    against "TTFT 0.39": the "fed" time of a server's answer was each part's time to its
    first token, added up, while TTFT was the first part's. A server does not report its
    prefill time: /stats shows "?" for it (and says why), and TTFT is the time to the
    answer's first token, as on the stats line of the answer's first part."""
    proc = run_piped(
        server, env, ["Hello there!", "/continue", "/stats"], "--temperature", "0", "--max-new-tokens", "6"
    )
    assert proc.returncode == 0, proc.stderr
    first_token = re.findall(r"first token ([\d.]+) s", proc.stderr)
    assert len(first_token) == 2, proc.stderr  # the answer, and its continuation
    table = proc.stderr[proc.stderr.rindex("turns") :]
    row = next(line for line in table.splitlines() if re.match(r"\W*1\W", line))
    cells = [c.strip() for c in re.split(r"[│|]", row) if c.strip()]
    assert cells[:4] == ["1", cells[1], "?", first_token[0]], row
    assert int(cells[1]) > 0 and int(cells[4]) == 12  # fed: both parts' prompts; new: both parts
    assert "?: not reported by the server" in " ".join(table.split())
