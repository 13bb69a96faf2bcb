"""`chatbot sessions`: the logged sessions as a person reads them at the terminal's width.

Piped, one line a session (easy to grep). On a terminal the lines fit its width: a table
whose last column (the first words) is cut at a word, with "…", where the row is longer; on a
terminal too narrow for the table, two or three lines a session. No word is broken over a
line end, and the session id, which `--resume` takes, is always whole.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from chatbot.conversation.kvstore import SUFFIX, kv_dir, prune, store_cap, store_usage
from chatbot.conversation.log import SessionInfo, list_sessions, sessions_dir
from chatbot.terminal.sanitize import safe_text
from chatbot.wording import counted

PIPED_WORDS = 60  # characters of the first words on a piped line
FEWEST_WORDS = 20  # the table needs this many columns left for the first words, else records
GAP = "  "


def clip_words(text: str, width: int) -> str:
    """`text` in at most `width` characters: cut after a whole word, with "…" (a first word
    longer than that is cut where it must)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    cut = text[: width - 1]
    if text[width - 1] != " " and " " in cut:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip() + "…"


def short_path(path: Path) -> str:
    """`path` with the home folder written as ~ (it is shorter, so it wraps less)."""
    home = os.path.expanduser("~")
    text = str(path)
    if home not in ("", "/", "~") and (text == home or text.startswith(home.rstrip("/") + "/")):
        return "~" + text[len(home.rstrip("/")) :]
    return text


def _turns(n: int | None) -> str:
    if n is None:
        return "? turns (a large log)"
    return counted(n, "turn")


def print_sessions(console: Console, limit: int = 20, directory: Path | None = None) -> None:
    """The newest `limit` logged sessions in `directory` (default: the data directory),
    then where they are and how to resume one."""
    directory = directory or sessions_dir()
    infos = list_sessions(directory)
    where = short_path(directory)
    if not infos:
        console.print(safe_text(f"no logged sessions in {where}"), markup=False)
        console.print(safe_text(store_line()), markup=False, style="dim", soft_wrap=not console.is_terminal)
        return
    shown = infos[:limit]
    if not console.is_terminal:
        _print_table(console, shown, None)
    elif not _print_table(console, shown, console.width):
        _print_records(console, shown, console.width)
    if len(infos) > limit:
        console.print(f"… and {len(infos) - limit} older (--limit)", markup=False, style="dim")
    footer = f"in {where}; resume one with: chatbot run --resume ID (or --resume for the last)"
    console.print(safe_text(footer), markup=False, style="dim", soft_wrap=not console.is_terminal)
    console.print(safe_text(store_line()), markup=False, style="dim", soft_wrap=not console.is_terminal)


def store_line() -> str:
    """What the chats' KV caches on disk hold, under which cap, and how to clear them (its
    folder, a path no narrow screen can keep whole, is `chatbot doctor`'s to say)."""
    files, size = store_usage()
    return (
        f"disk cache: {counted(files, 'file')}, {size / 1e6:,.1f} MB (cap {store_cap() / 2**30:g} GiB; "
        "chatbot sessions --prune empties it, the logs stay; chatbot doctor says where)"
    )


def prune_store(console: Console) -> None:
    """`chatbot sessions --prune`: every chat's KV cache file removed (the logs stay: a
    resumed chat re-encodes its history)."""
    _, size = store_usage()
    removed = prune(kv_dir(), cap=0)
    gone = sum(1 for path in removed if path.suffix == SUFFIX)
    left, _ = store_usage()
    where = short_path(kv_dir())
    line = f"removed {counted(gone, 'cache file')} ({size / 1e6:,.1f} MB) from {where}; the logs stay"
    console.print(safe_text(line), markup=False, soft_wrap=True)
    if left:
        console.print(safe_text(f"{counted(left, 'file')} could not be removed"), markup=False)


def _print_table(console: Console, shown: list[SessionInfo], width: int | None) -> bool:
    """One line a session, fitted to `width` (None: a pipe, no limit); False, having printed
    nothing, where the first words would get fewer than FEWEST_WORDS columns."""
    model_width = max(max(len(i.model) for i in shown), len("model"))
    fixed = f"{'id':<20}{GAP}{'date':<16}{GAP}{'model':<{model_width}}{GAP}turns{GAP}"
    room = PIPED_WORDS if width is None else width - len(fixed)
    if room < FEWEST_WORDS:
        return False
    console.print(fixed + "first words", style="bold", markup=False, soft_wrap=True)
    for i in shown:
        turns = "?" if i.turns is None else str(i.turns)
        line = f"{i.id:<20}{GAP}{i.created:<16}{GAP}{i.model:<{model_width}}{GAP}{turns:>5}{GAP}"
        console.print(safe_text(line + clip_words(i.first_words, room)), markup=False, soft_wrap=True)
    return True


def _print_records(console: Console, shown: list[SessionInfo], width: int) -> None:
    """A terminal too narrow for the table: the id, date and turns on a line (wrapped between
    them where even that is too long), the model and the first words indented below."""
    for i in shown:
        console.print(Text(safe_text(f"{i.id}{GAP}{i.created}{GAP}{_turns(i.turns)}"), style="bold"))
        words = clip_words(i.first_words, 2 * (width - 2) - len(i.model) - 2)
        body = Text(safe_text(i.model + (f": {words}" if words else "")))
        console.print(Padding(body, (0, 0, 0, 2)))
