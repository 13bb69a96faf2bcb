"""`scripts/bench-startup`: the prompt and banner found in a terminal's raw bytes (captured
from `chatbot run`), the pseudo-terminal driver on a scripted REPL that shows its prompt
before its banner, the real `chatbot run` on the default model, and the one-line errors."""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time

import pytest

from chatbot.errors import ChatbotError
from devtools import run_tool
from devtools.bench_startup import (
    CPR_ANSWER,
    StartupWatch,
    banner_seen,
    last_line,
    llama_cpp_available,
    main,
    prompt_seen,
    run_in_pty,
    strip_ansi,
)


def bench_startup(capsys, *args: str) -> tuple[int, str, str]:
    """Run `scripts/bench-startup ARGS` in this process: its exit status, stdout and stderr."""
    capsys.readouterr()
    code = run_tool("bench-startup", main, list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(capsys, *args: str, match: str) -> None:
    code, _, err = bench_startup(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("bench-startup: error: ") and match in lines[0], lines[0]


# What `chatbot run` wrote to an 80x24 pseudo-terminal (SmolLM2-135M, 2026-11-30): the
# spinner, the banner (wrapped by Rich), the start note, the cursor-position request, the
# first paint of the prompt (">", then a cursor move where the space is) and the second
# paint with the toolbar.
SPINNER = b"\x1b[?25l\x1b[32m\xe2\xa0\x8b\x1b[0m loading model\xe2\x80\xa6\r\x1b[2K\x1b[32m\xe2\xa0\x99\x1b[0m loading model\xe2\x80\xa6\r\n\x1b[?25h\r\x1b[1A\x1b[2K"  # noqa: E501
BANNER = (
    b"\x1b[2mSmolLM2-135M-Instruct \xc2\xb7 134.5M \xc2\xb7 float32 \xc2\xb7 cpu \xc2\xb7 context 8192 "
    b"\xc2\xb7 template \x1b[0m\r\n\x1b[2mtokenizer \xc2\xb7 loaded in 1.3 s \xc2\xb7 decode: native "
    b"int16 (auto)\x1b[0m\r\n"
)
NOTE = b"\x1b[?12l\x1b[?25h\x1b[2mtype a message; /help for commands and keys; Ctrl-D to exit\x1b[0m\r\n"
CPR = b"\x1b[6n"
FIRST_PAINT = b"\x1b[?2004h\x1b[?1l\x1b[?25l\x1b[0m\x1b[?7l\x1b[0m\x1b[J\x1b[0m>\x08\x1b[2C\x1b[?7h\x1b[0m"
SECOND_PAINT = (
    b"\x1b[?25l\x1b[?7l\x1b[2D\x1b[0m>\x1b[0m\r\r\n\r\r\n\r\r\n\x1b[0m \x1b[0m\r\r\n\x1b[0;7m "
    b"SmolLM2-135M-Instruct \xc2\xb7 \x1b[0;32;1;7mcache 0/8,192\x1b[0;7m \xc2\xb7 /help     \r\x1b[79C \r"
    b"\x1b[23A\x1b[2C\x1b[?7h\x1b[0m\x1b[?12l\x1b[?25h"
)
# prompt_toolkit printing above its prompt (run_in_terminal): erase the prompt, print, redraw.
ERASE = b"\x1b[?25l\x1b[?7l\x1b[2D\x1b[0m\x1b[J\x1b[?7h"


def test_strip_ansi_keeps_the_printed_text_only():
    assert strip_ansi(b"\x1b[2mdim\x1b[0m \x1b[0;32;1;7mgreen\x1b[0m") == "dim green"
    assert strip_ansi(b"\x1b]0;title\x07a\x1b]8;;http://x\x1b\\b") == "ab"  # OSC, both endings
    assert strip_ansi(b"\x1b>\x1b=\x1b(Bkeypad") == "keypad"  # ESC >: no prompt in it
    assert strip_ansi(b">\x08\x1b[2C\r\r\n\x07") == ">\r\r\n"
    assert strip_ansi("caf\u00e9 \u00b7".encode()) == "café ·"
    assert ">" not in strip_ansi(b"\x1b[?2004h\x1b[>4;1m\x1b[>c")


def test_prompt_and_banner_in_the_order_chatbot_run_prints_them_today():
    """Banner, start note, then the prompt: the banner is seen first, the prompt at its
    first paint (before the toolbar, with no "> " in the bytes)."""
    before_prompt = SPINNER + BANNER + NOTE + CPR
    text = strip_ansi(before_prompt)
    assert banner_seen(text) and not prompt_seen(text)  # the note's own "/help" is not the toolbar
    assert "> " not in strip_ansi(before_prompt + FIRST_PAINT)
    assert prompt_seen(strip_ansi(before_prompt + FIRST_PAINT))
    assert prompt_seen(strip_ansi(before_prompt + SECOND_PAINT))  # the toolbar alone
    assert not banner_seen(strip_ansi(SPINNER + NOTE + CPR + FIRST_PAINT + SECOND_PAINT))


def test_prompt_before_banner_when_the_model_loads_behind_it():
    """The prompt drawn while the model loads, the banner printed above it later: each is
    timed where it appears, and cursor-position requests are counted across reads."""
    watch = StartupWatch(t0=0.0)
    reads = [SPINNER, NOTE, CPR[:2], CPR[2:] + FIRST_PAINT, SECOND_PAINT, ERASE + BANNER + FIRST_PAINT]
    waiting = [watch.feed(data, now=float(i + 1)) for i, data in enumerate(reads)]
    assert waiting == [0, 0, 0, 1, 0, 0]
    assert watch.prompt_s == 4.0 and watch.ready_s == 6.0 and watch.both_seen
    assert watch.missing() == ""
    late = StartupWatch(t0=0.0)
    late.feed(SPINNER + NOTE, now=1.0)
    assert late.missing() == "the prompt and the model banner"
    assert late.last_line() == "type a message; /help for commands and keys; Ctrl-D to exit"


def test_banner_wrapped_anywhere_is_found():
    assert banner_seen("template tokenizer ·\r\nloaded in 1.3 s · decode")
    assert banner_seen("template tokenizer · loaded\r\nin 1.3 s")
    assert not banner_seen("loading model…")
    assert not banner_seen("model loaded in the background")


def test_last_line():
    assert last_line("a\r\n  chatbot:  error: boom \r\n\r\n") == "chatbot: error: boom"
    assert last_line("") == "no output"


# A REPL in a few lines: like `chatbot run` with a background load, it draws its prompt
# first (after asking where the cursor is) and prints the banner above it later.
FAKE_REPL = textwrap.dedent(
    """
    import os, sys, time, tty
    tty.setcbreak(0)
    out = lambda b: (os.write(1, b), None)[1]
    out(b"\\x1b[2mtype a message; /help for commands and keys; Ctrl-D to exit\\x1b[0m\\r\\n\\x1b[6n")
    answer = b""
    while not answer.endswith(b"R"):
        answer += os.read(0, 1)
    out(b"\\x1b[0m>\\x08\\x1b[2C")
    time.sleep(float(sys.argv[1]))
    out(b"\\x1b[J\\x1b[2mSmol \\xc2\\xb7 loaded in 0.2 s\\x1b[0m\\r\\n\\x1b[0m>\\x08\\x1b[2C")
    typed = b""
    while not typed.endswith(b"\\n"):
        typed += os.read(0, 1)
    sys.exit(0 if typed == b"/quit\\n" and answer == CPR_ANSWER else 3)
    """
).replace("CPR_ANSWER", repr(CPR_ANSWER))


def test_pty_driver_on_a_repl_that_prompts_before_its_banner(tmp_path):
    script = tmp_path / "repl.py"
    script.write_text(FAKE_REPL)
    start = time.perf_counter()
    run = run_in_pty([sys.executable, str(script), "0.5"], timeout_s=20)
    assert time.perf_counter() - start < 20
    assert run["order"] == "prompt first" and run["exit_status"] == 0  # it got "/quit" and the CPR answer
    assert run["cpr_answered"] == 1
    assert 0 < run["prompt_s"] and run["ready_s"] - run["prompt_s"] >= 0.45
    assert 0 <= run["exit_s"] < 5


# The same with prompt_toolkit itself: the prompt and its toolbar, and a load finishing in a
# thread that prints the banner above the prompt (patch_stdout), as `chatbot run` may.
PROMPT_TOOLKIT_REPL = textwrap.dedent(
    """
    import sys, threading, time
    from prompt_toolkit import PromptSession
    from prompt_toolkit.patch_stdout import patch_stdout

    def load():
        time.sleep(float(sys.argv[1]))
        print("\x1b[2mSmolLM2 · 134.5M · float32 · cpu · context 8192 · template tokenizer · "
              "loaded in 0.5 s · decode: native int16 (auto)\x1b[0m")

    print("type a message; /help for commands and keys; Ctrl-D to exit")
    session = PromptSession(bottom_toolbar=lambda: " SmolLM2 · cache 0/8,192 · /help")
    with patch_stdout(raw=True):
        threading.Thread(target=load, daemon=True).start()
        while session.prompt("> ") != "/quit":
            pass
    """
)


def test_pty_driver_on_prompt_toolkit_printing_the_banner_above_its_prompt(tmp_path):
    script = tmp_path / "repl.py"
    script.write_text(PROMPT_TOOLKIT_REPL)
    run = run_in_pty([sys.executable, str(script), "0.8"], timeout_s=30)
    assert run["order"] == "prompt first" and run["exit_status"] == 0
    assert run["cpr_answered"] >= 1  # prompt_toolkit asked where the cursor is
    assert run["ready_s"] - run["prompt_s"] >= 0.7


def test_pty_driver_errors_are_one_line(tmp_path):
    """A process that dies before its prompt, one that never shows it, one that fails on
    /quit: errors that say which, with its last line."""
    dies = [sys.executable, "-c", "print('loading\\nchatbot: error: no such model'); raise SystemExit(2)"]
    died = r"exited \(status 2\) before the prompt and the model banner: chatbot: error: no such model$"
    with pytest.raises(ChatbotError, match=died):
        run_in_pty(dies, timeout_s=20)
    hangs = [sys.executable, "-c", "import time; print('still loading', flush=True); time.sleep(60)"]
    start = time.perf_counter()
    silent = "no sign of the prompt and the model banner within 1 s; its last line: still loading"
    with pytest.raises(ChatbotError, match=silent):
        run_in_pty(hangs, timeout_s=1)
    assert time.perf_counter() - start < 10  # killed, not waited for
    script = tmp_path / "repl.py"
    script.write_text(FAKE_REPL.replace("sys.exit(0 if", "print('\\nbye'); sys.exit(4 if"))
    with pytest.raises(ChatbotError, match="left with status 4 after /quit: bye"):
        run_in_pty([sys.executable, str(script), "0"], timeout_s=20)


def test_bad_model_files_are_one_line_errors(capsys, tmp_path):
    assert_one_line_error(capsys, "--model", str(tmp_path / "none.gguf"),
                          match="--model: no such file")  # fmt: skip
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert_one_line_error(capsys, "--model", str(text), match="is not a GGUF file")
    assert_one_line_error(capsys, "--model", str(tmp_path), match="is not a file")


def test_chatbot_run_dying_before_its_banner_is_a_one_line_error(capsys, tmp_path):
    """A GGUF header and nothing more: `chatbot run` shows its prompt (the file's magic is
    right), fails to load it, and the bench says so with its error line."""
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    code, _, err = bench_startup(capsys, "--model", str(bad), "--rounds", "1")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err
    assert lines[:-1] == ["untimed first run: chatbot run"]  # the progress line, then the error
    assert lines[-1].startswith(
        "bench-startup: error: chatbot run exited (status 2) before the model banner: "
    )
    assert "chatbot: error: cannot read GGUF file" in lines[-1].removeprefix(
        "bench-startup: error:"
    )  # run's own


@pytest.mark.slow
def test_bench_startup_on_the_default_model(capsys, tmp_path):
    """The real `chatbot run` in a pseudo-terminal, one round after the warm-up, and
    llama.cpp's load of the same file when llama-cpp-python is installed."""
    out = tmp_path / "startup.json"
    code, stdout, _ = bench_startup(capsys, "--rounds", "1", "--threads", "1", "--json", str(out))
    assert code == 0
    data = json.loads(out.read_text())
    ours = data["ours"]
    for key in ("prompt_s", "ready_s", "exit_s"):
        assert math.isfinite(ours[key]) and ours[key] > 0, key
    (run,) = ours["runs"]
    assert run["exit_status"] == 0 and run["cpr_answered"] >= 1
    assert ours["order"] in (["banner first"], ["prompt first"])
    assert 0.1 < ours["prompt_s"] < 120 and data["first_run_s"] > 0
    assert data["settings"]["threads"] == 1 and data["settings"]["default_model"] is True
    assert data["settings"]["model"].endswith(".gguf")
    assert len(data["machine"]["loadavg_start"]) == 3 and data["machine"]["cpu_model"]
    if llama_cpp_available():
        assert data["llama_cpp"]["load_s"] > 0 and len(data["llama_cpp"]["runs"]) == 1
        ratio = data["ratios"]["prompt_vs_llama_load"]
        assert ratio == pytest.approx(ours["prompt_s"] / data["llama_cpp"]["load_s"])
        assert "llama.cpp: Llama() loaded" in stdout
    else:
        assert data["llama_cpp"] is None and data["ratios"]["prompt_vs_llama_load"] is None
    assert "chatbot run: to the prompt" in stdout and "load average" in stdout
