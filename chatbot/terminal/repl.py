"""The chat loop: a prompt_toolkit prompt on a terminal, one message per line on a pipe.

Ctrl-C while an answer is being computed (prefill or decode) stops it: the engine raises
KeyboardInterrupt between two operations, the session keeps what reached the cache, and
the prompt comes back. Every turn and every command that changes the conversation is
appended to the session log before the next prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import os
import stat
import sys
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prompt_toolkit import PromptSession
from prompt_toolkit.application import get_app, run_in_terminal
from prompt_toolkit.formatted_text import StyleAndTextTuples
from prompt_toolkit.history import History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.output import create_output
from rich.console import Console

from chatbot import progress
from chatbot.conversation.log import (
    FILE_MODE,
    SUFFIX,
    Event,
    SessionLog,
    data_dir,
    private_dir,
    replay,
)
from chatbot.errors import ChatbotError
from chatbot.terminal.advice import in_user_words
from chatbot.terminal.bars import prompt_bar, token_bar
from chatbot.terminal.commands import (
    Command,
    is_command,
    parse_command,
)
from chatbot.terminal.input import BlockReader, KeptHistory, SlashCompleter, clean_message, read_lines
from chatbot.terminal.live_answer import MarkdownAnswer, PlainAnswer
from chatbot.terminal.render import format_stats_line, history_renderable, toolbar_line
from chatbot.terminal.repl_commands import ReplCommands
from chatbot.terminal.sanitize import safe_line, safe_text
from chatbot.terminal.thinking_view import ThinkingRoute
from chatbot.terminal.tty import Terminated, ended_by_signals, interrupt_once, make_consoles, no_echo
from chatbot.terminal.wrap_input import FoldLongLines, WordWrap
from chatbot.wording import counted

if TYPE_CHECKING:  # torch and transformers come with these: the prompt must not wait for them
    from chatbot.conversation.chat import Chat, ModelInfo

MAX_MESSAGE_CHARS = 200_000
__all__ = [
    "BlockReader", "ChatStart", "Repl", "clean_message", "data_dir", "make_consoles", "read_lines", "run",
]  # fmt: skip
WITHOUT_MODEL = {"help", "exit"}
"""Commands that run while the model is still loading; the others (and messages) wait for it."""


@dataclass
class ChatStart:
    """What a model load yields for the chat: the session, the model, the notes to show."""

    session: Chat[Any]
    loaded: ModelInfo
    notes: list[str] = field(default_factory=list)


class Repl(ReplCommands):
    """Reads messages and commands, streams answers, prints stats.

    Whatever answers (a local model, a server) is behind the `Chat` interface: the REPL
    asks the session to describe itself and never which kind it is.

    Args:
        session: the conversation.
        loaded: the model (or the server's), for the log, /save and /model.
        console: where answers go (stdout).
        plain: print raw text instead of live Markdown.
        show_stats: print the stats line after each answer.
        info: where notes and stats go (stderr when stdout is a pipe).
        log: the session log (None: no log).
    """

    def __init__(
        self,
        session: Chat[Any],
        loaded: ModelInfo,
        console: Console,
        plain: bool = False,
        show_stats: bool = True,
        info: Console | None = None,
        log: SessionLog | None = None,
    ) -> None:
        self.session = session
        self.loaded = loaded
        self.console = console
        self.info = info or console
        self.plain = plain
        self.show_stats = show_stats
        self.log = log
        self.failed = 0  # messages (and /retry, /continue) that got no whole answer but by Ctrl-C
        self.running = True
        # A model loading in the background (`loading`): the prompt is up meanwhile.
        self.pending: Future[ChatStart] | None = None
        self.loading_name = ""
        self.on_ready: Callable[[], None] | None = None
        self.load_error: BaseException | None = None
        self._draft = ""  # a message typed but not sent (Ctrl-C while loading or before its answer)
        self._prompting = False  # run_terminal's loop: a message not sent comes back at the prompt
        self.one_shot = False  # `chatbot run "PROMPT"`: no prompt follows, so no command to offer
        # --show-thinking: "show" (kept on screen; in a pipe, to stderr); --hide-thinking: "hide"
        self.thinking_view = "fold"  # dimmed while it streams, one line once the answer starts
        self.last_thinking, self.thoughts = "", {}  # the answer just streamed's; each turn's
        self.blocks = BlockReader()
        self.handlers: dict[str, Callable[[Command], None]] = {
            "help": self._help,
            "exit": self._exit,
            "reset": self._reset,
            "undo": self._undo,
            "retry": self._retry,
            "continue": self._continue,
            "system": self._system,
            "set": self._set,
            "save": self._save,
            "load": self._load,
            "history": self._history,
            "stats": self._stats,
            "thinking": self._thinking,
            "model": self._model,
            "cache": self._cache,
        }

    @classmethod
    def loading(
        cls,
        pending: Future[ChatStart],
        name: str,
        console: Console,
        plain: bool = False,
        show_stats: bool = True,
        info: Console | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> Repl:
        """A REPL whose model is still loading (in another thread, into `pending`): the prompt
        comes up at once, and a message or command that needs the model waits for it. When
        the load ends while the prompt is up, its notes are printed above the prompt; then
        `on_ready` runs (starting the session log). A failed load ends the REPL, with the
        exception in `load_error` for the caller to report."""
        # No session before the load ends: every use of it goes through `ready` first.
        repl = cls(cast(Any, None), cast(Any, None), console, plain=plain, show_stats=show_stats, info=info)
        repl.pending, repl.loading_name, repl.on_ready = pending, name, on_ready
        return repl

    def _adopt(self) -> bool:
        """Take the chat a background load produced, once it is over: True when the model is
        ready. Runs in the main thread only (from the loop, or inside the prompt's)."""
        pending = self.pending
        if pending is None:
            return self.load_error is None
        if not pending.done():
            return False
        self.pending = None
        error = pending.exception()
        if error is not None:
            self.load_error, self.running = error, False
            return False
        start = pending.result()
        self.session, self.loaded = start.session, start.loaded
        for note in start.notes:
            self.note(note)
        try:
            if self.on_ready is not None:
                self.on_ready()
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable log to resume: the caller reports it
            self.load_error, self.running = exc, False
            return False
        return True

    def ready(self, draft: str = "") -> bool:
        """Wait for a model still loading (saying so); False if the load failed, or if Ctrl-C
        stopped the wait (then `draft`, the message that waited, comes back at the prompt)."""
        pending = self.pending
        if pending is not None and not pending.done():
            try:
                words = f"loading {self.loading_name}… (Ctrl-C: back to the prompt)"
                with self.info.status(words) as status:

                    def show(what: str | None) -> None:  # the longest that fits beside the spinner
                        back, room = "(Ctrl-C: back to the prompt)", self.info.width - 3
                        name = self.loading_name
                        fits = [f"loading {name}: {what}… {back}", f"loading: {what}… {back}", f"{what}…"]
                        status.update(next((t for t in fits if len(t) <= room), fits[-1]) if what else words)

                    with progress.listen(show):
                        wait([pending])  # Ctrl-C interrupts it (the main thread's waits are)
            except KeyboardInterrupt:
                self._draft = draft
                self.note("(the model is still loading; nothing was sent)")
                return False
        return self._adopt()

    def _watch_load(self) -> None:
        """`pre_run` of each prompt (in its event loop): when the background load ends while
        this prompt is up, print its notes above the prompt, or leave on a failed load."""
        pending = self.pending
        if pending is None:
            return
        app = get_app()
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()  # holds the running prompt, for run_in_terminal

        async def adopt_async() -> None:
            await run_in_terminal(self._adopt)
            if not self.running and app.is_running:
                app.exit(result="")

        def adopt() -> None:
            if app.is_running and self.pending is pending:
                app.create_background_task(adopt_async())

        # The toolbar names the load's current wait (`chatbot.progress`): redraw it as that changes.
        listening = contextlib.ExitStack()
        listening.enter_context(progress.listen(lambda _: app.invalidate()))

        def ended(_: Future[ChatStart]) -> None:  # in the loading thread
            listening.close()
            with contextlib.suppress(RuntimeError):  # that prompt's loop is closed: the next one adopts
                loop.call_soon_threadsafe(adopt, context=context)

        pending.add_done_callback(ended)

    # -- the session log ---------------------------------------------------------------

    def start_log(
        self,
        resume: Path | None = None,
        directory: Path | None = None,
        overrides: dict[str, Any] | None = None,
        system: str | None = None,
    ) -> None:
        """Log this chat; with `resume`, first restore the logged session and append to it.

        Args:
            resume: a session log to continue (from `find_session`).
            directory: where new logs go (default: the data directory).
            overrides: sampling settings given on the command line; they win over the log's.
            system: a system prompt given on the command line; it wins over the log's.
        """
        if resume is not None:
            state = replay(resume)
            if system:
                state["system"] = system
            if overrides:
                state["settings"] = {**(state.get("settings") or {}), **overrides}
            self.note(f"resuming session {state['id']} ({counted(len(state['turns']), 'turn')})")
            if state.get("model") and state["model"] != self.loaded.name:
                self.note(f"that session was with {state['model']}; continuing with {self.loaded.name}")
            self.session.keep_cache_for(resume.name.removesuffix(SUFFIX), resuming=True)
            self._restore(state)
            self.log = SessionLog(resume, self._log_header(), warn=self.note)
            self.log.write(
                Event.RESUME,
                model=self.loaded.name,
                system=self.session.system,
                settings=self.session.sampling.as_dict(),
                **self.session.run_record(),
            )
            if self.session.turns:
                last = self.session.turns[-2:]
                first = len(self.session.turns) - len(last) + 1
                self.info.print(history_renderable(last, None, markdown=not self.plain, first=first))
        else:
            self.log = SessionLog.create(self._log_header(), directory, warn=self.note)
            if self.log.enabled:
                self.session.keep_cache_for(self.log.session_id)
        # From here on the session writes each change of the conversation to the log.
        self.session.log = self.log
        self.session.model_name = self.loaded.name

    def _log_header(self) -> dict[str, Any]:
        return {
            "model": self.loaded.name,
            "system": self.session.system,
            "settings": self.session.sampling.as_dict(),
            **self.session.run_record(),
        }

    # -- output ------------------------------------------------------------------------

    def note(self, text: str) -> None:
        self.info.print(safe_text(text), style="dim", highlight=False, markup=False)

    def error(self, text: str) -> None:
        self.info.print(safe_line(f"error: {text}"), style="red", highlight=False, markup=False)

    def _progress(self, what: str) -> contextlib.AbstractContextManager[Callable[[int, int], None] | None]:
        """A progress bar for long encodes on a terminal; nothing on a pipe (`token_bar`)."""
        return token_bar(self.info, what)

    # -- one line of input -------------------------------------------------------------

    def handle(self, line: str) -> None:
        """Run a command or send a message; errors become one-line messages."""
        line = clean_message(line)
        if not line.strip():
            return
        try:
            self._handle(line)
        finally:
            for note in self.session.take_notes() if self.session is not None else ():
                self.note(note)

    def _handle(self, line: str) -> None:
        if is_command(line) and "\n" not in line.strip():
            try:
                command = parse_command(line)
                if command.name not in WITHOUT_MODEL and not self.ready():
                    return
                self.handlers[command.name](command)
            except ChatbotError as exc:
                self.error(in_user_words(exc))
            except (ValueError, TypeError, OverflowError, RecursionError, LookupError, OSError) as exc:
                # A command failed in a way we did not foresee: say so and keep the chat.
                self.error(f"{line.split()[0]} failed: {type(exc).__name__}: {exc}")
            return
        typed = line
        if line.startswith("//"):
            line = line[1:]
        line = line.strip("\n").rstrip()
        if len(line) > MAX_MESSAGE_CHARS:
            self.error(f"message too long ({len(line):,} characters; the limit is {MAX_MESSAGE_CHARS:,})")
            self.failed += 1
            return
        if not self.ready(draft=typed):
            return
        self.chat(line, typed)

    def chat(self, text: str, typed: str | None = None) -> None:
        """Send `text` and show its answer. A Ctrl-C before any of the message reached the
        model leaves no turn: the message (`typed`, as typed) comes back at the prompt."""
        before = len(self.session.turns)
        try:
            chunks = self.session.send(text)
        except ChatbotError as exc:
            self.error(in_user_words(exc))
            self.failed += 1
            return
        # The session logs the message before its answer (and cancels it if it left no turn).
        if self._stream(chunks, keep_note=False) == "interrupted":
            if len(self.session.turns) > before:
                self._interrupted_note()
            elif self._prompting:
                self._draft = typed if typed is not None else text
                self.note("[interrupted before the answer began: the message is back at the prompt]")
            else:
                self.note("[interrupted before the answer began: the message was not sent]")

    def _stream(
        self, chunks: Generator[Any, None, None], keep_note: bool = True, continued: bool = False
    ) -> str | None:
        """Show an answer as it arrives (the session logs the turn it produced). Returns what
        stopped it ("interrupted", or the error said) or None; `keep_note`: say that an
        interrupted answer is kept (/retry, /continue: the turn stays); `continued`: the
        chunks go on from an answer shown before (/continue), so their leading space counts."""
        plain = PlainAnswer(self.console.file, keep_leading=continued) if self.plain else None
        answer = plain or MarkdownAnswer(self.console, fold_thinking=self.thinking_view == "fold")
        # Model text reaches a terminal with its control sequences made visible; piped
        # output (--plain, stdout not a terminal) keeps the model's bytes.
        raw = self.plain and not self.console.is_terminal
        stats = None
        problem: str | None = None
        quiet = contextlib.nullcontext() if self.plain else no_echo(sys.stdin)
        with interrupt_once() as interrupts, quiet:
            try:
                with prompt_bar(self.info, self.session):  # the prefill runs in the first next()
                    first = next(chunks, None)
                route = self._thinking_route(answer, raw)
                with answer:
                    try:
                        for chunk in itertools.chain(() if first is None else (first,), chunks):
                            thought = getattr(chunk, "thinking", "")
                            if chunk.text or thought:
                                with interrupts.deferred():
                                    route.add(chunk.text, thought, len(getattr(chunk, "token_ids", ())) or 1)
                            stats = chunk.stats or stats
                    finally:
                        route.end()
                        self.last_thinking = route.thinking
            except KeyboardInterrupt:
                chunks.close()
                problem = "interrupted"
            except Terminated:  # SIGTERM, SIGHUP, SIGQUIT: the turn is closed (and logged) as far as it got
                chunks.close()
                raise
            except ChatbotError as exc:
                chunks.close()
                problem = in_user_words(exc)
            except (RuntimeError, ValueError) as exc:  # the model or sampling failed: keep the chat
                chunks.close()
                problem = f"generation failed: {type(exc).__name__}: {exc}"
        self.keep_thinking(continued)  # the turn is closed now (by chunks.close() above)
        if problem == "interrupted":
            if keep_note:
                self._interrupted_note()
        elif problem is not None:
            self.error(problem)
            self.failed += 1
        elif stats is not None and self.show_stats:
            if self._answer_through_pipe():
                self.info.print()  # see _answer_through_pipe
            self.note(format_stats_line(stats, self.info.width if self.info.is_terminal else None))
        return problem

    def _thinking_route(self, answer: MarkdownAnswer | PlainAnswer, raw: bool) -> ThinkingRoute:
        """Thinking inline on a terminal (dimmed); in a pipe or a one-shot run, to stderr with
        --show-thinking, else nowhere: stdout carries the answer alone. On a terminal it folds
        to one line once the answer starts (--hide-thinking: that line alone), unless
        --show-thinking."""
        inline = self.console.is_terminal and not self.one_shot and self.thinking_view != "hide"
        return ThinkingRoute(
            answer,
            self.session.thinking_opened,
            inline=inline,
            apart=self.info.file if self.thinking_view == "show" and not inline else None,
            dim=self.info.is_terminal,
            raw=raw,
            fold=answer.fold
            if isinstance(answer, MarkdownAnswer) and not self.one_shot and self.thinking_view != "show"
            else None,
        )

    def _interrupted_note(self) -> None:
        """Say what a Ctrl-C left of the last turn: a partial answer, or (stopped while the
        model read the message) none, the message kept; a one-shot offers no command."""
        turn = self.session.turns[-1]
        if turn.answer:
            self.note(
                "[interrupted]"
                if self.one_shot
                else "[interrupted: the partial answer is kept; /continue goes on]"
            )
        elif self.one_shot:
            self.note("[interrupted before the answer]")
        else:
            self.note("[interrupted before the answer: the message is kept; /retry answers it]")

    def _answer_through_pipe(self) -> bool:
        """The answer goes into a pipe (`chatbot run | cat`, `| tee log`) while the notes go
        to a terminal: the pipe's reader may write the answer's last line end to that
        terminal after the stats line, written at once, has begun, which would then read
        on as the answer's last word. A line break first keeps them apart either way."""
        if self.console.is_terminal or not self.info.is_terminal:
            return False
        try:
            return stat.S_ISFIFO(os.fstat(self.console.file.fileno()).st_mode)
        except (AttributeError, OSError, ValueError):
            return False

    # -- loops -------------------------------------------------------------------------

    def run_lines(self, lines: Iterable[str]) -> None:
        """One message or command per line (a pipe), `\"\"\"` blocks joined; stops at the end
        or /exit."""
        for line in lines:
            message = self.blocks.feed(line.rstrip("\r\n"))
            if message is not None:
                self.handle(message)
            if not self.running:
                return
        if self.blocks.is_open:
            self.handle(self.blocks.close())

    def toolbar(self, width: int | None = None) -> StyleAndTextTuples:
        """The line under the prompt (`toolbar_line`), at the terminal's width by default."""
        if width is None:
            from prompt_toolkit.application import get_app_or_none

            app = get_app_or_none()
            width = app.output.get_size().columns if app is not None else 80
        loading = self.pending is not None or self.session is None
        return toolbar_line(None if loading else self.session, self.loaded.name if not loading else "",
                            self.loading_name, width)  # fmt: skip

    def make_prompt(self, input: Any = None, output: Any = None) -> PromptSession[str]:
        """The prompt_toolkit session: history, completion, keys, toolbar."""
        history: History
        try:
            path = private_dir(data_dir()) / "history"
            path.touch(mode=FILE_MODE)
            # A line that cannot be written later (a full disk) is kept in memory, with one
            # warning after the prompt (`_history_warning`).
            history = KeptHistory(str(path))
        except OSError as exc:
            self.note(f"warning: cannot keep input history ({exc.strerror}); going on without it")
            history = InMemoryHistory()
        except ChatbotError as exc:
            self.note(f"warning: {exc}; input history is not kept")
            history = InMemoryHistory()

        keys = KeyBindings()

        @keys.add("escape", "enter")
        def _newline(event: Any) -> None:
            event.current_buffer.insert_text("\n")

        @keys.add("c-c")
        def _interrupt(event: Any) -> None:
            buffer = event.current_buffer
            if buffer.text:
                buffer.reset()
            else:
                event.app.exit(exception=KeyboardInterrupt())

        session: PromptSession[str] = PromptSession(
            history=history,
            completer=SlashCompleter(),
            complete_while_typing=False,
            key_bindings=keys,
            bottom_toolbar=self.toolbar,
            # "… " begins a new line of the message; a row the prompt wraps begins blank
            prompt_continuation=lambda width, line_number, wrap_count: (
                " " * width if wrap_count else "… ".rjust(width)
            ),
            # "> " and "… " before each row; a line taller than half the screen is folded
            input_processors=[FoldLongLines(lambda: 2, _half_screen), WordWrap(lambda: 2)],
            enable_history_search=False,
            input=input,
            output=output,
        )
        return session

    def _history_warning(self, history: History) -> None:
        """Say once that the input history could not be written (it was, inside the prompt)."""
        warning = history.take_warning() if isinstance(history, KeptHistory) else None
        if warning:
            self.note(warning)

    def run_terminal(self, input: Any = None, output: Any = None) -> None:
        """The interactive prompt: Ctrl-C clears the line or stops an answer, Ctrl-D exits."""
        if output is None:
            # With stdout in a pipe (`chatbot run | tee chat.txt`) the prompt goes to the terminal.
            output = create_output(always_prefer_tty=True)
        prompt = self.make_prompt(input, output)
        self.note("type a message; /help for commands and keys; Ctrl-D to exit")
        self._prompting = True
        while self.running:
            if not self._adopt() and not self.running:
                break  # the model failed to load: the caller reports why
            draft, self._draft = self._draft, ""
            try:
                line = prompt.prompt(
                    "… " if self.blocks.is_open else "> ", default=draft, pre_run=self._watch_load
                )
            except KeyboardInterrupt:
                if self.blocks.is_open:
                    self.blocks.close()
                    self.note("(block discarded)")
                else:
                    self.note("(Ctrl-D or /exit to leave)")
                continue
            except EOFError:
                if self.blocks.is_open:
                    self.handle(self.blocks.close())
                break
            self._history_warning(prompt.history)
            if not self.running:  # the load failed while the prompt was up
                break
            message = self.blocks.feed(line)
            if message is not None:
                try:
                    self.handle(message)
                except KeyboardInterrupt:  # a command's output cut short; answers handle their own
                    self.note("(interrupted)")


def _half_screen() -> int:
    """The rows one line of the input may take: half the terminal's."""
    return get_app().output.get_size().rows // 2


def run(repl: Repl, interactive: bool) -> None:
    """The chat: the prompt on a terminal (the terminal put back as it was, even when a signal
    ends it), else one message per line of stdin."""
    if interactive:
        with ended_by_signals(sys.stdin, sys.stdout if sys.stdout.isatty() else sys.stderr):
            repl.run_terminal()
    else:
        repl.run_lines(read_lines(sys.stdin.buffer))
