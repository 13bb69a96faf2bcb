"""`chatbot run` with every mix of standard input and output a shell can give it, run from a
real terminal (a shell in a pseudo-terminal behind pyte): stdin a terminal, a pipe, a file,
/dev/null or closed; stdout a terminal, a pipe, a file or closed. Terminal features (echo
control, the prompt, live rendering) belong only where a stream is a terminal; every mix
answers every message and exits 0.

The answers, greedy on the real default model, are compared with those of the plainest mix
(a pipe in, a file out, no terminal anywhere).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from screen import Terminal, missing_words

pytest.importorskip("pyte")

pytestmark = pytest.mark.slow

MESSAGES = ["Hi", "Say yes."]
FLAGS = ["--greedy", "--max-new-tokens", "12"]
# The start of a stats line. Its end may wrap to the next row: with stdout through `cat`, the
# end of an answer can reach the terminal after the stats line (two processes writing), and
# push it right ("...your namecontext 14 tok · 0.05 s · ... tok/s", then the "?").
STATS = re.compile(r"context \d+ tok · ")


def _chatbot() -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable, "-m", "chatbot.cli", "run", *FLAGS])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[str]:
    """The two answers with no terminal at all: one line each on stdout."""
    home = tmp_path_factory.mktemp("reference")
    done = subprocess.run(
        [sys.executable, "-m", "chatbot.cli", "run", *FLAGS],
        check=False,
        input="\n".join(MESSAGES) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XDG_DATA_HOME": str(home)},
    )
    assert done.returncode == 0, done.stderr
    answers = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(answers) == 2, done.stdout
    assert len(STATS.findall(done.stderr)) == 2, done.stderr
    return answers


STDIN = {
    "tty": "",
    "pipe": "printf 'Hi\\nSay yes.\\n' | ",
    "file": "< in.txt",
    "devnull": "< /dev/null",
    "closed": "<&-",
}
STDOUT = {"tty": "", "pipe": "| cat", "file": "> out.txt", "closed": ">&-"}


def _command(stdin: str, stdout: str) -> str:
    cmd = _chatbot()
    redirect_in = STDIN[stdin]
    if stdin == "pipe":
        cmd = redirect_in + cmd
    elif redirect_in:
        cmd += " " + redirect_in
    if STDOUT[stdout]:
        cmd += " " + STDOUT[stdout]
    # pipefail: a pipe's status is chatbot's, not cat's or printf's. The shell then holds the
    # terminal a moment: once its last writer has closed it, reading the terminal can fail
    # before its last output is read (CI lost "[exit 0]" of a chat on a closed stdin so).
    return f'set -o pipefail; {cmd}; echo "[exit $?]"; sleep 1'


MIXES = [(i, o) for i in STDIN for o in STDOUT if not (o == "closed" and i in ("devnull", "closed"))]


@pytest.mark.parametrize("stdin,stdout", MIXES, ids=[f"{i}-to-{o}" for i, o in MIXES])
def test_every_mix_of_stdin_and_stdout_answers_and_exits_0(stdin, stdout, reference, tmp_path, terminals):
    (tmp_path / "in.txt").write_text("\n".join(MESSAGES) + "\n", encoding="utf-8")
    term = Terminal(
        ["bash", "-c", _command(stdin, stdout)],
        columns=100,
        lines=40,
        cwd=str(tmp_path),
        env={"XDG_DATA_HOME": str(tmp_path / "data")},
    )
    terminals.append(term)

    def screen() -> str:
        return "\n".join(term.lines())

    def stats_lines() -> int:
        return len(STATS.findall(screen()))

    answered = stdin not in ("devnull", "closed")
    if stdin == "tty":
        # A person types each message at the prompt (drawn on the terminal even when stdout
        # is not one), waits for its answer, then leaves with Ctrl-D.
        for n, message in enumerate(MESSAGES, 1):
            term.wait_prompt(120)
            term.type(message + "\r")
            term.wait_for(lambda n=n: stats_lines() >= n, 120, f"answer {n}")
        term.wait_prompt(60)
        term.type("\x04")
    term.wait_text("[exit ", 180)
    shown = screen()
    assert "[exit 0]" in shown, shown
    assert "error" not in shown.lower() and "Traceback" not in shown, shown
    assert stats_lines() == (2 if answered else 0), shown
    if not answered or stdout == "closed":
        return
    if stdout == "file":
        written = (tmp_path / "out.txt").read_text(encoding="utf-8")
        # a file gets the model's text, no escape sequences or prompts
        assert "\x1b" not in written and "> " not in written, repr(written)
        assert [line for line in written.splitlines() if line.strip()] == reference
    else:
        for answer in reference:
            assert not missing_words(answer, term.lines()), (answer, shown)


def test_a_pipe_typed_in_a_terminal_keeps_the_terminal_settings(reference, tmp_path, terminals):
    """The answer of a piped chat leaves the terminal as it found it (echo on): `stty -a`
    after it prints what it printed before."""
    term = Terminal(
        [
            "bash",
            "-c",
            f"stty -a > before.txt; printf 'Hi\\n' | {_chatbot()}; stty -a > after.txt; echo '[stty done]'",
        ],
        columns=100,
        lines=40,
        cwd=str(tmp_path),
        env={"XDG_DATA_HOME": str(tmp_path / "data")},
    )
    terminals.append(term)
    term.wait_text("[stty done]", 180)
    before = (tmp_path / "before.txt").read_text()
    assert " echo " in f" {before} "
    assert (tmp_path / "after.txt").read_text() == before
    assert not missing_words(reference[0], term.lines())
