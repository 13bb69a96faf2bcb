"""Slash-commands: one table, parsed into values without touching the session."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from chatbot.config import FORMAT_KEY, SamplingConfig, format_choice
from chatbot.errors import CommandError
from chatbot.settings import layer


@dataclass(frozen=True)
class CommandSpec:
    """One slash-command.

    `arg` says what follows the name: None (nothing), "text", "path", "setting"
    (`KEY VALUE`) or "settings" (`KEY=VALUE ...`); `required` that it must be there.
    """

    name: str
    usage: str
    help: str
    arg: str | None = None
    required: bool = False


COMMANDS: dict[str, CommandSpec] = {
    c.name: c
    for c in (
        CommandSpec("help", "/help", "show the commands and keys"),
        CommandSpec("exit", "/exit", "leave the chat (also /quit, Ctrl-D)"),
        CommandSpec("reset", "/reset", "forget the conversation and empty the cache; keep the system prompt"),
        CommandSpec("undo", "/undo", "drop the last exchange (the cache is cut back, not re-encoded)"),
        CommandSpec(
            "retry",
            "/retry [KEY=VALUE ...]",
            "regenerate the last answer, optionally with other settings for this try",
            "settings",
        ),
        CommandSpec("continue", "/continue", "go on with an answer cut short by Ctrl-C or the token limit"),
        CommandSpec(
            "system",
            "/system [TEXT]",
            "show the system prompt, or replace it (re-encodes once); /system --clear removes it",
            "text",
        ),
        CommandSpec("set", "/set [KEY VALUE]", "list the sampling settings, or change one", "setting"),
        CommandSpec(
            "save", "/save [FILE]", "write the chat to a JSON file (default: in the data directory)", "path"
        ),
        CommandSpec(
            "load", "/load FILE", "replace the chat with a saved one and re-encode it", "path", required=True
        ),
        CommandSpec("history", "/history", "show the conversation so far"),
        CommandSpec("stats", "/stats", "a table of every turn so far, with totals"),
        CommandSpec("thinking", "/thinking", "show the last answer's thinking in full (it folds to a line)"),
        CommandSpec(
            "model",
            "/model",
            "what is loaded: name, parameters, dtype, device, quantization, context, decode path",
        ),
        CommandSpec("cache", "/cache", "the cache layout: pinned and recent tokens, capacity, evictions"),
    )
}
ALIASES = {
    "quit": "exit",
    "q": "exit",
    "?": "help",
    "h": "help",
    "clear": "reset",
    "regenerate": "retry",
    "redo": "retry",
    "cont": "continue",
    "c": "continue",
}
SETTING_ALIASES = {alias: s.name for s in layer("sampling") for alias in s.aliases}
SETTINGS = (*SamplingConfig.RANGES, FORMAT_KEY)
CLEAR_FLAG = "--clear"


@dataclass(frozen=True)
class Command:
    """A parsed command: its name, the raw argument, and parsed settings (for /set, /retry)."""

    name: str
    arg: str = ""
    values: dict[str, Any] = field(default_factory=dict)


def is_command(line: str) -> bool:
    """A line starting with one slash is a command; `//text` sends `/text` as a message."""
    return line.startswith("/") and not line.startswith("//")


def setting_key(raw: str) -> str:
    """The setting a user means by `raw` (aliases, dashes, case).

    Raises:
        CommandError: no such setting (naming the nearest one and listing them all).
    """
    key = raw.strip().lower().replace("-", "_")
    key = SETTING_ALIASES.get(key, key)
    if key in SETTINGS:
        return key
    near = difflib.get_close_matches(key, SETTINGS, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}? " if near else ""
    raise CommandError(f"unknown setting {raw!r}; {hint}settings: {', '.join(SETTINGS)}")


def parse_value(key: str, raw: str) -> Any:
    """A setting's value from text, checked against its range.

    Raises:
        ConfigError: the value is not allowed (the message gives the range).
    """
    if key == FORMAT_KEY:
        return format_choice(raw)
    return getattr(SamplingConfig().with_value(key, raw), key)


def parse_command(line: str) -> Command:
    """Parse `/name [arg]` into a Command.

    Raises:
        CommandError: unknown command (naming the nearest one), a missing or unexpected
            argument, or an unknown setting.
        ConfigError: a setting's value is out of range.
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
    if arg and spec.arg is None:
        raise CommandError(f"/{name} takes no argument (usage: {spec.usage})")
    if not arg and spec.required:
        raise CommandError(f"/{name} needs an argument (usage: {spec.usage})")
    values: dict[str, Any] = {}
    if arg and spec.arg == "setting":
        values = _parse_set(arg, spec)
    elif arg and spec.arg == "settings":
        values = _parse_assignments(arg.split(), spec)
    return Command(name, arg, values)


def _parse_set(arg: str, spec: CommandSpec) -> dict[str, Any]:
    """`KEY VALUE` pairs and `KEY=VALUE` words, in any mix (`/set seed none max=120`); all are
    parsed before any is applied, so an error anywhere changes nothing."""
    words = arg.split()
    values: dict[str, Any] = {}
    i = 0
    while i < len(words):
        if "=" in words[i]:
            values.update(_parse_assignments(words[i : i + 1], spec))
            i += 1
            continue
        key = setting_key(words[i])
        if i + 1 == len(words) or "=" in words[i + 1]:
            raise CommandError(f"/set {key} needs a value (usage: {spec.usage}; /set lists the settings)")
        values[key] = parse_value(key, words[i + 1])
        i += 2
    return values


def _parse_assignments(words: list[str], spec: CommandSpec) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for word in words:
        k, eq, v = word.partition("=")
        if not eq or not v:
            raise CommandError(f"expected KEY=VALUE, got {word!r} (usage: {spec.usage})")
        key = setting_key(k)
        values[key] = parse_value(key, v)
    return values


def complete(line: str) -> tuple[list[str], int, str | None]:
    """Completions for the text before the cursor.

    Returns:
        (candidates, start, kind): the candidates replace `line[start:]`; `kind` is
        "path" when the argument is a file name (the caller completes paths itself).
    """
    if not is_command(line):
        return [], len(line), None
    if " " not in line:
        typed = line[1:].lower()
        return [f"/{n}" for n in COMMANDS if n.startswith(typed)], 0, None
    name, _, rest = line[1:].partition(" ")
    name = ALIASES.get(name.lower(), name.lower())
    spec = COMMANDS.get(name)
    if spec is None or spec.arg is None:
        return [], len(line), None
    if spec.arg == "path":
        return [], len(line) - len(rest.lstrip()), "path"
    word_start = len(line) - len(rest.split(" ")[-1]) if not rest.endswith(" ") else len(line)
    word = line[word_start:]
    words_before = rest[: len(rest) - len(word)].split()
    if spec.arg == "text":
        return (
            ([CLEAR_FLAG] if not words_before and CLEAR_FLAG.startswith(word) and word else []),
            word_start,
            None,
        )
    if spec.arg == "settings":
        if "=" in word:
            return [], len(line), None
        return [f"{k}=" for k in SETTINGS if k.startswith(word.lower())], word_start, None
    # "setting": KEY VALUE pairs
    if len(words_before) % 2 == 0:
        return [k for k in SETTINGS if k.startswith(word.lower())], word_start, None
    if SETTING_ALIASES.get(words_before[-1], words_before[-1]) == "seed":
        return [v for v in ("none",) if v.startswith(word)], word_start, None
    if words_before[-1].lower() == FORMAT_KEY:
        return [v for v in ("text", "json") if v.startswith(word.lower())], word_start, None
    return [], len(line), None


def help_rows() -> list[tuple[str, str]]:
    """(usage, what it does) for every command."""
    return [(c.usage, c.help) for c in COMMANDS.values()]


def help_text() -> str:
    width = max(len(c.usage) for c in COMMANDS.values())
    return "\n".join(f"{usage.ljust(width)}  {what}" for usage, what in help_rows())


def settings_rows(sampling: SamplingConfig) -> list[tuple[str, str, str]]:
    """`/set` with no argument: (setting, value, allowed range) for every setting."""
    rows = []
    for key in SETTINGS:
        allowed = (
            "text, or json (a JSON object)" if key == FORMAT_KEY else SamplingConfig.RANGES[key].describe()
        )
        rows.append((key, sampling.shown(key), allowed))
    return rows


def settings_text(sampling: SamplingConfig) -> str:
    rows = settings_rows(sampling)
    width, shown = max(len(k) for k in SETTINGS), max(8, *(len(v) for _, v, _ in rows))
    return "\n".join(f"{k.ljust(width)}  {v.ljust(shown)}  {r}" for k, v, r in rows)
