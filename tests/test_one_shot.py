"""Issue 37, the first hour: `chatbot run "PROMPT"` / `-p PROMPT` answers and exits, and
`chatbot --version` says what runs, at once.

The reference for a one-shot answer is the same message sent the way that already worked:
one line (or a `\"\"\"` block) piped into `chatbot run`, greedy, on the same tiny model.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from helpers import assert_one_line_error
from serve_helpers import save_tiny_model

GREEDY = ("--greedy", "--max-new-tokens", "12")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "COLUMNS": "200"}


def chatbot(env, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`chatbot ARGS`, stdin a pipe with `stdin` in it (None: /dev/null, as from cron)."""
    return subprocess.run(
        [sys.executable, "-m", "chatbot.cli", *args],
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def logged_messages(env) -> list[str]:
    """The user messages of every logged session, oldest first."""
    folder = Path(env["XDG_DATA_HOME"]) / "chatbot" / "sessions"
    events = [
        json.loads(line) for log in sorted(folder.glob("*.jsonl")) for line in log.read_text().splitlines()
    ]
    return [e["user"] for e in events if e["event"] == "turn"]


def test_a_prompt_answers_on_stdout_as_the_same_line_piped(tiny, env):
    one = chatbot(env, "run", "--model", tiny, *GREEDY, "Hello there!")
    option = chatbot(env, "run", "--model", tiny, *GREEDY, "-p", "Hello there!")
    piped = chatbot(env, "run", "--model", tiny, *GREEDY, stdin="Hello there!\n")
    assert one.returncode == option.returncode == piped.returncode == 0, one.stderr
    assert one.stdout.strip() and one.stdout == option.stdout == piped.stdout
    # stdout holds the answer alone; stderr ends with the stats line; no REPL, no banner
    assert "tok/s" not in one.stdout and one.stderr.splitlines()[-1].startswith("context ")
    assert "type a message" not in one.stdout + one.stderr and "/help" not in one.stdout + one.stderr
    quiet = chatbot(env, "run", "--model", tiny, *GREEDY, "--no-stats", "Hello there!")
    assert quiet.returncode == 0 and quiet.stdout == one.stdout and "tok/s" not in quiet.stderr
    assert logged_messages(env) == ["Hello there!"] * 4  # logged as any chat: --resume goes on


PROGRAM = (  # `chatbot` as the console script runs it, with a finalizer and an exit handler of its own
    "import atexit, sys\n"
    "class Late:\n"
    "    write = sys.stderr.write  # kept: the teardown may have emptied `sys` first\n"
    "    def __del__(self):\n"
    "        self.write('torn down\\n')\n"
    "late = Late()\n"
    "atexit.register(lambda: sys.stderr.write('exit handler\\n'))\n"
    "from chatbot.cli.app import main\n"
    "main({})\n"
)


def test_a_one_shot_leaves_without_the_interpreters_teardown(tiny, env):
    """Answered, `chatbot run` runs the exit handlers, flushes its output and leaves, without
    the interpreter freeing every module's objects one by one (0.3 s for torch's and
    transformers'): a finalizer left for that teardown does not run. The answer, the log and
    the exit status are those of a caller's main(...), which returns to the caller as before."""

    def run(argv: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", PROGRAM.format(argv), "run", *args], stdin=subprocess.DEVNULL,
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip

    program = run("", "--model", tiny, *GREEDY, "Hello there!")
    called = run("sys.argv[1:]", "--model", tiny, *GREEDY, "Hello there!")
    assert program.returncode == called.returncode == 0, program.stderr
    assert program.stdout.strip() and program.stdout == called.stdout
    assert program.stderr.splitlines()[-1] == "exit handler" and "torn down" not in program.stderr
    assert called.stderr.splitlines()[-2:] == ["exit handler", "torn down"]
    assert logged_messages(env) == ["Hello there!"] * 2
    failed = run("", "--model", str(Path(tiny) / "nope.gguf"), "Hi")
    assert failed.returncode == 2 and failed.stderr.splitlines() == [
        f"chatbot: error: no such file or folder: {Path(tiny) / 'nope.gguf'}",
        "exit handler",
    ]


def test_piped_text_comes_first_then_a_blank_line_then_the_prompt(tiny, env):
    text = "The cat sat.\nOn the mat.\n"
    one = chatbot(
        env, "run", "--model", tiny, *GREEDY, "--system", "Be brief.", "Summarize this.", stdin=text
    )
    block = '"""\nThe cat sat.\nOn the mat.\n\nSummarize this.\n"""\n'
    piped = chatbot(env, "run", "--model", tiny, *GREEDY, "--system", "Be brief.", stdin=block)
    assert one.returncode == piped.returncode == 0, one.stderr
    assert one.stdout.strip() and one.stdout == piped.stdout
    assert logged_messages(env) == ["The cat sat.\nOn the mat.\n\nSummarize this."] * 2


@pytest.mark.parametrize("columns", [80, 50])
def test_a_prompt_in_a_terminal_answers_and_exits_with_no_prompt(tiny, env, terminals, columns):
    from screen import Terminal, missing_words

    reference = chatbot(env, "run", "--model", tiny, *GREEDY, stdin="Hello there!\n").stdout
    argv = [
        sys.executable,
        "-m",
        "chatbot.cli.app",
        "run",
        "--model",
        tiny,
        *GREEDY,
        "--plain",
        "Hello there!",
    ]
    term = Terminal(argv, columns=columns, env={"XDG_DATA_HOME": env["XDG_DATA_HOME"]})
    terminals.append(term)
    term.wait_for(lambda: not term.proc.isalive(), 180, "the end of the run")
    term.pump(0.3)
    lines = term.lines()
    shown = "\n".join(lines)
    term.proc.wait()
    assert term.proc.exitstatus == 0, shown
    assert missing_words(reference, lines) == [], shown
    assert "tok/s" in shown and "type a message" not in shown and "/help" not in shown
    assert ">" not in [line.strip() for line in lines]  # no prompt was drawn
    assert all(len(line) <= columns for line in lines)


@pytest.mark.slow
def test_a_prompt_in_a_terminal_renders_the_answer_of_the_default_model(env, terminals):
    from screen import Terminal, missing_words

    args = ("run", "--greedy", "--max-new-tokens", "24", "What is the capital of France?")
    reference = chatbot(env, *args).stdout
    term = Terminal([sys.executable, "-m", "chatbot.cli", *args], env={"XDG_DATA_HOME": env["XDG_DATA_HOME"]})
    terminals.append(term)
    term.wait_for(lambda: not term.proc.isalive(), 180, "the end of the run")
    term.pump(0.3)
    term.proc.wait()
    assert term.proc.exitstatus == 0 and "Paris" in reference
    assert missing_words(reference, term.lines()) == [], term.lines()


def test_bad_prompts_are_one_line_before_the_model_loads(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))  # an empty pipe
    assert_one_line_error(capsys, "run", "", match="empty prompt")
    assert_one_line_error(capsys, "run", "  \n", match="empty prompt")
    assert_one_line_error(capsys, "run", "a", "-p", "b", match="not both")
    assert_one_line_error(capsys, "run", "--model", str(tmp_path / "nowhere"), "hi")
    # `--resume "question"` takes the question for a session id: the error says how to ask
    line = assert_one_line_error(capsys, "run", "--resume", "what next?", match="no session")
    assert "chatbot run --resume last 'what next?'" in line


def test_a_prompt_through_a_server_answers_once_and_a_failure_exits_1(env):
    from test_remote_clients import STORY, FakeServer

    fake = FakeServer()
    try:
        ok = chatbot(env, "run", "--server", fake.url, "--max-new-tokens", "5", "Tell me a story.")
        failed = chatbot(env, "run", "--server", fake.url, "Please fail.")
    finally:
        fake.close()
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == " ".join(STORY.split()[:5]) + "\n"
    assert "tok/s" in ok.stderr.splitlines()[-1]  # the stats line, on stderr
    assert [r["messages"] for r in fake.requests] == [
        [{"role": "user", "content": "Tell me a story."}],
        [{"role": "user", "content": "Please fail."}],
    ]
    assert failed.returncode == 1 and failed.stdout == ""
    errors = [line for line in failed.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "fell over" in errors[0]


def test_version_is_quick_and_says_what_runs(tmp_path, monkeypatch):
    """No torch import, no kernel build: the level is the one `chatbot doctor` reports."""
    from chatbot import DISTRIBUTION, doctor

    monkeypatch.delenv("CHATBOT_KERNEL_FLAGS", raising=False)

    code = (
        "import sys\nfrom chatbot.cli.app import main\ncode = 0\ntry:\n    main(['--version'])\n"
        "except SystemExit as exc:\n    code = exc.code\nprint('exit', code, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    argv = [sys.executable, "-c", code]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    first, second, last = proc.stdout.splitlines()
    assert last == "exit 0 False", proc.stdout + proc.stderr
    for name in ("torch", "transformers"):
        assert f"{name} {version(name)}" in first
    assert first.startswith(f"chatbot {version(DISTRIBUTION)} (python {sys.version.split()[0]}")
    cc = doctor.compiler()
    expected = cc.simd if cc.command is not None else "none (no C compiler"
    assert second.startswith(f"kernels: {expected}")
    assert not (tmp_path / "cache").exists()  # nothing built, nothing cached
