"""The terminal around an answer: the consoles, key echo off while it streams, and Ctrl-C
that cannot tear what is being drawn."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import IO, Any

from rich.console import Console

try:
    import termios
except ImportError:  # Windows
    termios = None  # type: ignore[assignment]


def line_console(stderr: bool = False) -> Console:
    """A console for lines (notes, errors, `chatbot doctor`): on a terminal Rich wraps them
    between words at the terminal's width (the terminal itself would cut a word in two);
    into a pipe or file a line stays one line."""
    try:
        tty = (sys.stderr if stderr else sys.stdout).isatty()
    except (ValueError, AttributeError):  # a closed or missing stream
        tty = False
    environ = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return Console(stderr=stderr, highlight=False, soft_wrap=not tty, _environ=environ if tty else None)


def make_consoles(interactive: bool) -> tuple[Console, Console]:
    """The consoles for answers (stdout) and for notes and stats: stdout on a terminal, else
    stderr. On a terminal Rich wraps every line by words at the width; into a pipe or file a
    line stays one line (the terminal, if any, wraps it)."""
    # COLUMNS and LINES, where exported, are stale after a resize: on a terminal, its size.
    environ = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out_tty, err_tty = sys.stdout.isatty(), sys.stderr.isatty()
    out = Console(highlight=False, soft_wrap=not out_tty, _environ=environ if out_tty else None)
    if interactive and out_tty:
        return out, out
    return out, Console(
        stderr=True, highlight=False, soft_wrap=not err_tty, _environ=environ if err_tty else None
    )


def _terminal_fd(stream: IO[str] | None) -> int | None:
    """The descriptor of `stream` where it is a terminal; None for a pipe or a file
    (`printf 'Hi' | chatbot run` typed in a terminal), a closed stream, or no termios."""
    if termios is None or stream is None:
        return None
    try:
        fd = stream.fileno()
        return fd if os.isatty(fd) else None
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def no_echo(stream: IO[str] | None) -> Iterator[None]:
    """While inside, keys typed on the terminal are not echoed (they stay in the input for
    the next prompt): an echoed ^C or typed-ahead text would land in the live answer and
    shift it. Ctrl-C still interrupts. Nothing happens when `stream` is not a terminal."""
    fd = _terminal_fd(stream)
    try:
        saved = None if fd is None else termios.tcgetattr(fd)
    except (termios.error, OSError):  # termios.error is no OSError: the terminal went away
        saved = None
    if fd is None or saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ECHOCTL)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        with contextlib.suppress(termios.error, OSError):
            termios.tcsetattr(fd, termios.TCSANOW, saved)


class Terminated(SystemExit):
    """SIGTERM, SIGHUP or SIGQUIT ended the chat (`ended_by_signals`); the exit status is
    128 + N."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


RESTORE = "\x1b[0m\x1b[?2004l\x1b[?25h"
"""Colours reset, bracketed paste off, the cursor shown: what a chat may leave set."""


@contextlib.contextmanager
def ended_by_signals(stdin: IO[str] | None, out: IO[str] | None) -> Iterator[None]:
    """While inside, SIGTERM, SIGHUP and SIGQUIT (Ctrl-\\ during an answer) raise `Terminated`
    in the main thread instead of ending the process where it stands: every `finally` runs (the
    live answer stops and shows the cursor, prompt_toolkit leaves raw mode, the session log
    closes the turn). On the way out, however it ends, the terminal gets back the settings it
    had on the way in and `RESTORE`.

    Ctrl-\\ is a person's way to quit now, not a request for a core dump of a process holding
    a model: the first ends the chat as SIGTERM does; a second one, while that clean-up runs,
    quits at once as it always did."""
    fd = _terminal_fd(stdin)
    try:
        saved = None if fd is None else termios.tcgetattr(fd)
    except (termios.error, OSError):
        saved = None

    quit_signal = getattr(signal, "SIGQUIT", None)

    def handler(signum: int, _frame: Any) -> None:
        if signum == quit_signal:
            signal.signal(signum, signal.SIG_DFL)  # the next Ctrl-\ quits at once
        raise Terminated(signum)

    names = ("SIGTERM", "SIGHUP", "SIGQUIT")
    signals = [s for s in (getattr(signal, name, None) for name in names) if s]
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
        if fd is not None and saved is not None:
            with contextlib.suppress(termios.error, OSError):
                termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        if out is not None and _terminal_fd(out) is not None:
            with contextlib.suppress(OSError, ValueError):
                out.write(RESTORE)
                out.flush()


class Interrupts:
    """The first Ctrl-C raises KeyboardInterrupt and later ones are ignored, so that a second
    press cannot tear the clean-up of the first. Inside `deferred()` (drawing the screen) the
    interrupt waits until the block ends, so no half-written escape sequence is left."""

    def __init__(self) -> None:
        self.fired = False
        self.pending = False
        self.depth = 0

    def handler(self, signum: int, frame: Any) -> None:
        if self.fired:
            return
        self.fired = True
        if self.depth:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.pending and not self.depth:
                self.pending = False
                raise KeyboardInterrupt


@contextlib.contextmanager
def interrupt_once() -> Iterator[Interrupts]:
    """While inside, Ctrl-C is handled by an `Interrupts` (see there), and by it alone.

    Inside a prompt's event loop (prompt_toolkit's `run_in_terminal`: a resumed chat encoded
    when the model's load ends at the prompt), asyncio's signal wake-up descriptor is set
    aside meanwhile: through it, the Ctrl-C handled here would reach the prompt afterwards as
    a second one, and wipe what was typed there.
    """
    interrupts = Interrupts()
    try:
        previous = signal.signal(signal.SIGINT, interrupts.handler)
    except ValueError:  # not the main thread
        yield interrupts
        return
    wakeup = signal.set_wakeup_fd(-1)
    try:
        yield interrupts
    finally:
        if wakeup != -1:
            signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGINT, previous)
