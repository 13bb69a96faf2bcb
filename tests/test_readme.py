"""The README is what a newcomer meets: short, the two set-up commands first, no page pointing
into a folder a clone does not have, links that lead somewhere, the slash-commands and aliases
the REPL really has, and every command of its shell blocks checked against the program.

Commands are read from the README itself (```sh, ```bash and ```console blocks), so an edited
README is checked again. A quick, safe command runs for real (`chatbot models`, `chatbot config
show ...`, a `printf ... | chatbot run` pipe on the default model, whose shown output must
match); any other (servers, terminal chats, hub models, benchmarks, the set-up scripts) has its
`--help` run, which must accept every flag the README's line uses."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
SHELL_BLOCKS = ("sh", "bash", "console")
FEEDERS = ("printf", "echo")
RUN_FOR_REAL = {("models",), ("sessions",), ("config", "show")}
"""chatbot subcommands that run here in seconds, with no model, network or terminal."""
CHAT_NEEDS = {"--model", "-m", "--preset", "--config", "--server", "--resume", "--quantize", "--device-map"}
"""Flags that make a piped `chatbot run` need something else than the default model."""
REAL_TIMEOUT_S = 180
HELP_TIMEOUT_S = 60


@dataclass(frozen=True)
class Command:
    """One command line of a README shell block."""

    text: str  # as written, continuation lines joined, without a console's `$ `
    lineno: int
    expected: tuple[str, ...] = ()  # output lines a console block shows after it


def shell_commands(markdown: str) -> list[Command]:
    """The commands of every ```sh / ```bash / ```console block, in order."""
    commands: list[Command] = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", markdown, re.MULTILINE | re.DOTALL):
        if block.group(1) not in SHELL_BLOCKS:
            continue
        first = markdown.count("\n", 0, block.start(2)) + 1
        lines = block.group(2).splitlines()
        if block.group(1) == "console":
            for i, line in enumerate(lines):
                if line.startswith("$ "):
                    shown = []
                    for out in lines[i + 1 :]:
                        if out.startswith("$ "):
                            break
                        if out.strip():
                            shown.append(out.strip())
                    commands.append(Command(line[2:].strip(), first + i, tuple(shown)))
            continue
        pending, start = "", 0
        for i, line in enumerate(lines):
            if not pending:
                start = first + i
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text = (pending + line).strip()
            pending = ""
            if text and not text.startswith("#"):
                commands.append(Command(text, start))
    return commands


def pipeline(text: str) -> list[list[str]]:
    """The words of each command of a pipeline; comments dropped. Raises ValueError for any
    shell operator but `|` (the checks below do not run through a shell)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for word in lexer:
        if word == "|":
            segments.append([])
        elif word and set(word) <= set("|&;<>()"):
            raise ValueError(f"shell operator {word!r} in a README command")
        else:
            segments[-1].append(word)
    if not all(segments):
        raise ValueError("an empty command in a pipeline")
    return segments


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env: dict[str, str] = {}
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        key, _, value = words[0].partition("=")
        env[key] = value
        words = words[1:]
    return env, words


def flags(words: list[str]) -> list[str]:
    """The options a command line uses (`--name` of `--name=value`, and short `-m`)."""
    return sorted({w.split("=", 1)[0] for w in words if re.match(r"^--?[A-Za-z]", w)})


def subcommand(args: list[str]) -> tuple[str, ...]:
    """The chatbot subcommand path of `args` (e.g. ("config", "show")), read from the CLI."""
    import typer

    from chatbot.cli.app import app

    group = typer.main.get_command(app)
    path: list[str] = []
    for word in args:
        commands = getattr(group, "commands", None)  # a group (typer's own click, not click's)
        if not commands or word not in commands:
            break
        group = commands[word]
        path.append(word)
    return tuple(path)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "COLUMNS": "200", **(extra or {})}


def _run(argv: list[str], stdin: str | None = None, timeout: float = HELP_TIMEOUT_S) -> tuple[int, str]:
    proc = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=timeout, check=False
    )
    return proc.returncode, proc.stdout + proc.stderr


def chatbot(*args: str, stdin: str | None = None, timeout: float = HELP_TIMEOUT_S) -> tuple[int, str]:
    return _run([sys.executable, "-m", "chatbot.cli", *args], stdin, timeout)


def assert_flags_accepted(command: Command, used: list[str], help_argv: list[str]) -> None:
    code, text = _run(help_argv)
    assert code == 0, f"README line {command.lineno}: `{' '.join(help_argv)}` failed:\n{text}"
    for flag in used:
        if flag in ("--help", "-h"):
            continue
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (
            f"README line {command.lineno}: {flag} is not in `{' '.join(help_argv)}`:\n{command.text}"
        )


def is_chat_pipe(segments: list[list[str]], path: tuple[str, ...], words: list[str]) -> bool:
    """`printf '...' | chatbot run [flags]` on the default model: runs here in seconds."""
    fed = len(segments) == 2 and segments[0][0] in FEEDERS
    return fed and path == ("run",) and not set(flags(words)) & CHAT_NEEDS


def check(command: Command) -> None:
    """Run `command` for real where that is quick and safe, else its `--help` (see the module's
    docstring)."""
    try:
        segments = pipeline(command.text)
    except ValueError as exc:
        pytest.fail(f"README line {command.lineno}: {exc}: {command.text}")
    *feeders, last = segments
    assert all(s[0] in FEEDERS for s in feeders), f"README line {command.lineno}: {command.text}"
    env, words = split_env(last)
    program, args = words[0], words[1:]
    if program == "scripts/test":
        assert os.access(ROOT / program, os.X_OK), program
        assert_flags_accepted(command, flags(args), [sys.executable, "-m", "pytest", "--help"])
    elif program == "scripts/run":  # set-up, then `chatbot run "$@"`
        assert os.access(ROOT / program, os.X_OK), program
        assert_flags_accepted(command, flags(args), [sys.executable, "-m", "chatbot.cli", "run", "--help"])
    elif program.startswith("scripts/"):
        assert os.access(ROOT / program, os.X_OK), program
        assert_flags_accepted(command, flags(args), [str(ROOT / program), "--help"])
    elif program == "chatbot":
        path = subcommand(args)
        assert path, f"README line {command.lineno}: no chatbot subcommand in: {command.text}"
        if not env and ((path in RUN_FOR_REAL and not feeders) or is_chat_pipe(segments, path, args)):
            stdin = None
            if feeders:
                code, stdin = _run(feeders[0])
                assert code == 0, stdin
            code, out = chatbot(*args, stdin=stdin, timeout=REAL_TIMEOUT_S)
            assert code == 0, f"README line {command.lineno}: exit {code}: {command.text}\n{out}"
            got = [line.strip() for line in out.splitlines()]
            for line in command.expected:
                assert line in got, (
                    f"README line {command.lineno} shows {line!r}; the command printed:\n{out}"
                )
        else:
            assert_flags_accepted(
                command, flags(args), [sys.executable, "-m", "chatbot.cli", *path, "--help"]
            )
    else:
        pytest.fail(f"README line {command.lineno}: unknown program {program!r}: {command.text}")


def _is_slow(command: Command) -> bool:
    """Commands that load the real default model: piped chats."""
    try:
        segments = pipeline(command.text)
    except ValueError:
        return False
    return len(segments) > 1 and segments[-1][0] == "chatbot" and segments[-1][1:2] == ["run"]


COMMANDS = shell_commands(README.read_text(encoding="utf-8"))


def test_short_with_the_set_up_commands_first():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move the detail into docs/"
    top = "\n".join(lines[:40])
    for script in ("scripts/run", "scripts/test"):
        assert re.search(rf"^{script}\b", top, re.MULTILINE), (
            f"{script} is not a command in the first 40 lines"
        )
        assert os.access(ROOT / script, os.X_OK)


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_no_path_into_the_shared_folder(page):
    """A user's clone has no ../shared: the packaged data (chatbot/data/) or a placeholder."""
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        assert "../shared" not in line, f"{page.name}:{n}: {line}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_links_lead_somewhere(page):
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        assert dest.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, f"{page.name} links to {target}: no such heading"


def test_slash_commands_and_aliases_are_the_real_ones():
    from chatbot.terminal.commands import ALIASES, COMMANDS, SETTING_ALIASES, SETTINGS

    text = README.read_text(encoding="utf-8")
    for name in COMMANDS:
        assert f"`/{name}" in text, f"/{name} is missing from the README"
    for name in re.findall(r"^\| `/(\w+)", text, re.MULTILINE):
        assert name in COMMANDS, f"the README lists /{name}, which the REPL does not have"
    for alias, name in ALIASES.items():
        assert f"`/{alias}`" in text and f"`/{name}`" in text, f"alias /{alias} is missing"
    for alias in SETTING_ALIASES:
        assert f"`{alias}`" in text, f"setting alias {alias} is missing"
    for setting in SETTINGS:
        assert f"`{setting}`" in text, f"setting {setting} is missing"


def test_the_readme_has_commands_to_check():
    texts = [c.text for c in COMMANDS]
    assert any(t.startswith("chatbot run") for t in texts)
    assert any("| chatbot run" in t for t in texts), "no piped chat to run for real"


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=[pytest.mark.slow] if _is_slow(c) else []) for c in COMMANDS],
    ids=[f"L{c.lineno}" for c in COMMANDS],
)
def test_readme_command(command):
    check(command)
