"""Transient progress bars on the info console (stderr): gone from the screen once done, and
nothing at all where it is not a terminal."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

if TYPE_CHECKING:
    from chatbot.conversation.chat import Chat

LONG_PROMPT = 128
"""Tokens of a new prompt from which its encoding shows a bar (about a second on a laptop CPU)."""


@contextlib.contextmanager
def token_bar(console: Console, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A bar of tokens encoded, labelled `what`, told by the update function yielded (None on a
    pipe): for /system's re-encoding and /load's history."""
    if not console.is_terminal:
        yield None
        return
    # The total is unknown (None) until the first update: the column must show that too.
    progress = Progress(
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        console=console,
        transient=True,
    )
    task = progress.add_task(what, total=None)

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    with progress:
        yield update


@contextlib.contextmanager
def prompt_bar(console: Console, session: Chat[Any] | None) -> Iterator[None]:
    """While a turn's new tokens are encoded (before its first chunk): on a terminal, a bar of
    tokens encoded for a prompt of `LONG_PROMPT` tokens or more, gone before the answer is
    drawn. Nothing for a short prompt, on a pipe, or for a server's session (which reports
    no prefill)."""
    if not console.is_terminal or session is None:
        yield
        return
    # The figures before the bar: a narrow terminal shortens the bar, not them.
    progress = Progress(
        TextColumn("reading the message"),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        BarColumn(bar_width=24),
        console=console,
        transient=True,
    )
    tasks: list[Any] = []

    def update(done: int, total: int) -> None:
        if total < LONG_PROMPT:
            return
        if not tasks:
            progress.start()
            tasks.append(progress.add_task("", total=total))
        progress.update(tasks[0], completed=done, total=total)

    session.prefill_observer = update
    try:
        yield
    finally:
        session.prefill_observer = None
        if tasks:
            progress.stop()
