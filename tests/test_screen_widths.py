"""The first screens a person reads (`chatbot --help`, `run --help`, `serve --help`,
`bench --help`, `chatbot sessions`, the stats line under an answer) at 80 and 50 columns,
in a pseudo-terminal behind a terminal emulator (screen.py): no word is broken over a line
end, and nothing is cut with "..." (the sessions table may end its first words after a
whole word with "…").

A broken word is found against the same text unbroken: the help rendered by click's own
formatter on an unbounded width, and the piped `chatbot sessions` (one line a session).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from screen import Terminal

pytest.importorskip("pyte")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "scripted_chat.py"
HELP_SCREENS = [("--help",), ("run", "--help"), ("serve", "--help"), ("bench", "--help")]
FIRST_MESSAGES = [
    "Hello there, can you explain how attention sinks keep a streaming cache bounded in memory?",
    "Write a haiku about autumn leaves falling on a quiet pond, then another about snow.",
    "hi",
]
MODELS = ["SmolLM2-135M-Instruct", "Qwen2.5-0.5B-Instruct", "tiny"]


def broken_words(lines: list[str], reference: str) -> list[str]:
    """Words of `reference` (its whitespace-separated tokens) that `lines` break over a line
    end, as "left|right". A line end between two tokens of `reference` is a break between
    words; one whose two sides join into (a part of) a single token is a broken word:
    "no-|enable-streaming]", "word|s", "Qwen2.5-0.|5B-Instruct"."""
    tokens = set(reference.split())
    broken = []
    for above, below in itertools.pairwise(lines):
        if not above.strip() or not below.strip() or above.endswith(" ") or below.startswith(" "):
            continue  # (an indented line begins a new row, or goes on beside a column)
        left, right = above.split()[-1], below.split()[0]
        if left in tokens and right in tokens:
            continue
        if any(left + right in token for token in tokens):
            broken.append(f"{left}|{right}")
    return broken


def indented_broken_words(lines: list[str], reference: str) -> list[str]:
    """`broken_words` where the line below goes on in a column (an option's help, a
    session's first words): its indent is not a space between words."""
    return broken_words([line.rstrip() for line in lines], reference) + broken_words(
        [line.strip() for line in lines], reference
    )


def cut_words(lines: list[str], reference: str, word_ends: bool = False) -> list[str]:
    """Tokens shown with a "..." or "…" that `reference` does not have. With `word_ends`, one
    that is a whole word of `reference` followed by "…" is allowed (a cell cut at a word)."""
    tokens = set(reference.split())
    cut = []
    for token in " ".join(lines).split():
        if not token.endswith(("...", "…")) or token in tokens or not token.rstrip(".…"):
            continue
        if word_ends and token.endswith("…") and token[:-1] in tokens:
            continue
        cut.append(token)
    return cut


def env_for(home: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "HOME": str(home), "XDG_DATA_HOME": ""}


def screen_of(argv: list[str], columns: int, env: dict[str, str]) -> list[str]:
    term = Terminal(
        [sys.executable, "-m", "chatbot.cli", *argv], columns=columns, lines=50, env=env, cwd=str(ROOT)
    )
    try:
        term.wait_for(lambda: not term.proc.isalive(), 120, f"chatbot {' '.join(argv)} to end")
    except AssertionError:
        if term.proc.isalive():
            raise
    term.pump(0.2)
    term.close()
    lines = term.lines()
    while lines and not lines[-1]:
        lines.pop()
    assert len(lines) > 3, lines
    assert all(len(line) <= columns for line in lines)
    return lines


def piped_output(argv: list[str], env: dict[str, str]) -> str:
    """What `chatbot ARGV` prints on a pipe."""
    run = subprocess.run([sys.executable, "-m", "chatbot.cli", *argv], env={**os.environ, **env}, cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    return run.stdout


def unbounded_help(path: tuple[str, ...]) -> str:
    """The help of `chatbot PATH` as click's own formatter writes it on an unbounded width:
    every paragraph, option help and command line on one line, nothing shortened."""
    import typer

    from chatbot.cli.app import app

    command = typer.main.get_command(app)
    ctx = typer.Context(command, info_name="chatbot", terminal_width=100_000, max_content_width=100_000)
    for name in path[:-1]:
        command = command.get_command(ctx, name)
        ctx = typer.Context(command, info_name=name, parent=ctx)
    return command.get_help(ctx)


def fake_sessions(home: Path) -> None:
    from chatbot.conversation.log import Event, SessionLog

    logs = home / ".local" / "share" / "chatbot" / "sessions"
    logs.mkdir(parents=True)
    for n, (model, first) in enumerate(zip(MODELS, FIRST_MESSAGES, strict=True)):
        log = SessionLog(
            logs / f"2026112{n}-14250{n}-3fa{n}.jsonl", {"model": model, "system": None, "settings": {}}
        )
        for user in (first, "And then?")[: n + 1]:
            log.write(Event.SEND, user=user)
            log.write(Event.TURN, replace=False, user=user, answer="An answer.", interrupted=False, stats={})


@pytest.mark.parametrize("columns", [80, 50])
def test_the_first_screens_break_no_word_and_cut_no_phrase(tmp_path, columns):
    env = env_for(tmp_path)
    for path in HELP_SCREENS:
        reference = unbounded_help(path)
        shown = screen_of(list(path), columns, env)
        assert indented_broken_words(shown, reference) == [], (path, "\n".join(shown))
        assert cut_words(shown, reference) == [], (path, "\n".join(shown))
    # run --help says where --max-new-tokens comes from when it is not given
    run_help = " ".join(" ".join(screen_of(["run", "--help"], columns, env)).split())
    assert "--max-new-tokens <int> Most tokens per answer (default: the preset's, else 512)." in run_help

    fake_sessions(tmp_path)
    piped = piped_output(["sessions"], env)
    reference = piped + "\n".join(FIRST_MESSAGES)
    shown = screen_of(["sessions"], columns, env)
    assert indented_broken_words(shown, reference) == [], "\n".join(shown)
    assert cut_words(shown, reference, word_ends=True) == [], "\n".join(shown)
    text = "\n".join(shown)
    for n, model in enumerate(MODELS):
        assert re.search(rf"^2026112{n}-14250{n}-3fa{n}\b", text, re.MULTILINE), (
            text
        )  # the id, whole, to resume
        assert model in text
    assert "~/.local/share/chatbot/sessions" in text


@pytest.mark.parametrize("columns", [80, 50])
def test_the_stats_line_breaks_between_its_phrases(tmp_path, terminals, columns):
    """The stats line under an answer, wrapped: each line ends with "·" but the last, and
    each begins a phrase ("0.12 s", "first token 0.12 s"), never its tail ("s", "tok/s")."""
    answer = tmp_path / "answer.md"
    answer.write_text("A short answer with a few words, long enough to time its tokens.\n", encoding="utf-8")
    term = Terminal([sys.executable, str(SCRIPT), str(answer)], columns=columns, lines=24, cwd=str(tmp_path))
    terminals.append(term)
    term.wait_prompt(120)
    term.type("Hello.\r")
    term.wait_prompt(120)
    lines = term.lines()
    first = max(i for i, line in enumerate(lines) if line.startswith("context "))
    stats = []
    for line in lines[first:]:
        stats.append(line)
        if not line.endswith(" ·"):
            break
    assert len(stats) > 1 or columns == 80, stats  # at 50 columns it wraps
    assert all(len(line) <= columns for line in stats)
    phrase = re.compile(
        r"(context \d|\d[\d,.]* (s|tok|tok/s|ms/tok)\b|first token \d|cache \d"
        r"|max tokens|context full|interrupted)"
    )
    for line in stats:
        assert phrase.match(line), stats
    assert stats[-1].split(" · ")[-1].startswith(("cache", "max tokens", "context full", "interrupted")), (
        stats
    )


@pytest.mark.parametrize("columns", [80, 50])
def test_models_breaks_no_word(tmp_path, columns):
    """`chatbot models`: presets with their descriptions, and the models here (a hub GGUF in
    the hub cache among them), wrapped between words; a path longer than the line is shown
    whole on a line of its own (the terminal folds it), so that it can be copied."""
    snap = tmp_path / "hub" / "models--stand--smol" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "smol-Q4_1.gguf").write_bytes(b"GGUF" + bytes(2000))
    (tmp_path / "hub" / "models--stand--smol" / "refs").mkdir()
    (tmp_path / "hub" / "models--stand--smol" / "refs" / "main").write_text("0" * 40)
    env = {**env_for(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    piped = piped_output(["models"], {**env, "COLUMNS": "100000"})
    shown = screen_of(["models"], columns, env)
    paths = [token for token in piped.split() if "/" in token and len(token) > columns - 6]
    rows = [line for line in shown if not any(line.strip() and line.strip() in p for p in paths)]
    assert indented_broken_words(rows, piped) == [], "\n".join(shown)
    assert cut_words(shown, piped) == [], "\n".join(shown)
    text = " ".join(" ".join(shown).split())
    assert "stand/smol:Q4_1 2.0 KB hub cache" in text
    assert "qwen2.5-instruct Qwen/Qwen2.5-1.5B-Instruct Qwen2.5-1.5B-Instruct (Alibaba)" in text
    assert "stream_chat (downloads on first run)" in text
