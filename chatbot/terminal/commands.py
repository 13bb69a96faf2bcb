"""Slash-commands: one table, parsed into values without touching the session."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from chatbot.errors import CommandError


@dataclass(frozen=True)
class CommandSpec:
    name: str
    usage: str
    help: str
    takes_arg: bool = False


COMMANDS: dict[str, CommandSpec] = {
    c.name: c
    for c in (
        CommandSpec("help", "/help", "show the commands"),
        CommandSpec("exit", "/exit", "leave the chat (also /quit, Ctrl-D)"),
        CommandSpec("reset", "/reset", "forget the conversation and empty the cache; keep the system prompt"),
        CommandSpec("stats", "/stats", "a table of every turn so far, with totals"),
        CommandSpec("cache", "/cache", "the cache layout: pinned and recent tokens, capacity, evictions"),
    )
}
ALIASES = {"quit": "exit", "q": "exit", "?": "help"}


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""


def is_command(line: str) -> bool:
    """A line starting with one slash is a command; `//text` sends `/text` as a message."""
    return line.startswith("/") and not line.startswith("//")


def parse_command(line: str) -> Command:
    """Parse `/name [arg]`.

    Raises:
        CommandError: unknown command (naming the nearest one) or an argument where none is
            taken.
    """
    body = line.strip()[1:]
    name, _, arg = body.partition(" ")
    name = name.lower()
    name = ALIASES.get(name, name)
    if name not in COMMANDS:
        near = difflib.get_close_matches(name, [*COMMANDS, *ALIASES], n=1, cutoff=0.5)
        hint = f"; did you mean /{ALIASES.get(near[0], near[0])}?" if near else "; /help lists them"
        raise CommandError(f"unknown command /{name}" + hint)
    spec = COMMANDS[name]
    arg = arg.strip()
    if arg and not spec.takes_arg:
        raise CommandError(f"/{name} takes no argument (usage: {spec.usage})")
    return Command(name, arg)


def help_text() -> str:
    width = max(len(c.usage) for c in COMMANDS.values())
    return "\n".join(f"{c.usage.ljust(width)}  {c.help}" for c in COMMANDS.values())
