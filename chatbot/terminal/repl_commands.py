"""The REPL's slash commands: `ReplCommands`, the handlers `Repl` (chatbot/terminal/repl.py)
inherits and dispatches to by name (`Repl.handlers`). Each takes the parsed `Command`, acts on
the session and prints what it did (notes and tables go to the info console).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from chatbot.conversation.log import data_dir
from chatbot.errors import ContextFullError
from chatbot.limits import expand, without_surrogates
from chatbot.terminal.commands import (
    CLEAR_FLAG,
    Command,
    help_rows,
    help_text,
    settings_rows,
    settings_text,
)
from chatbot.terminal.render import (
    columns,
    history_renderable,
    key_value_table,
    sampling_brief,
    stats_renderable,
)
from chatbot.terminal.sanitize import safe_text
from chatbot.terminal.tty import interrupt_once
from chatbot.wording import counted

if TYPE_CHECKING:  # torch and transformers come with these: the prompt must not wait for them
    from chatbot.conversation.chat import Chat, ModelInfo

__all__ = ["KEYS", "KEYS_HELP", "ReplCommands"]

KEYS = [
    ("Enter", "send"),
    ("Alt+Enter (or Esc, Enter)", "new line"),
    ('""" on a line', "open/close a multi-line block; a paste keeps its lines in one message"),
    ("Ctrl-C", "stop the answer (it is kept; /continue goes on) or clear the line"),
    ("Ctrl-D", "leave"),
    ("Tab", "complete commands and settings"),
    ("//text", "send a message that starts with a slash"),
]
KEYS_HELP = "keys:\n" + "\n".join(f"  {key.ljust(26)} {what}" for key, what in KEYS)


class ReplCommands:
    """The slash commands' handlers, mixed into `Repl`: what they read and call of it is
    declared here (the session, the model, the consoles, `note`, `_progress`, `_stream`)."""

    session: Chat[Any]
    loaded: ModelInfo
    info: Console
    plain: bool
    running: bool
    last_thinking: str  # the thinking of the answer streamed last
    thoughts: dict[int, tuple[Any, str]]  # id of a turn -> (the turn, its thinking)

    if TYPE_CHECKING:

        def note(self, text: str) -> None: ...

        def _progress(
            self, what: str
        ) -> contextlib.AbstractContextManager[Callable[[int, int], None] | None]: ...

        def _stream(
            self, chunks: Generator[Any, None, None], keep_note: bool = True, continued: bool = False
        ) -> str | None: ...

    def _help(self, _: Command) -> None:
        if self.info.is_terminal:
            self.info.print(columns(help_rows(), self.info.width))
            self.info.print()
            self.info.print("keys:")
            self.info.print(columns(KEYS, self.info.width))
        else:
            self.info.print(help_text() + "\n\n" + KEYS_HELP, highlight=False, markup=False)

    def _exit(self, _: Command) -> None:
        self.running = False

    def _reset(self, _: Command) -> None:
        self.session.reset()
        self.note("conversation cleared (the system prompt is kept)")

    def _undo(self, _: Command) -> None:
        turn = self.session.undo()
        self.note(f"removed: {_brief(turn.user)} → {_brief(turn.answer)}")

    def _retry(self, command: Command) -> None:
        sampling = self.session.sampling
        for key, value in command.values.items():
            sampling = sampling.with_value(key, "none" if value is None else value)
        self._stream(self.session.retry(sampling if command.values else None))

    def _continue(self, _: Command) -> None:
        self._stream(self.session.continue_answer(), continued=True)

    def _system(self, command: Command) -> None:
        if not command.arg:
            default = None if self.session.system else self.session.template_system()
            if self.session.system:
                self.note(f"system prompt: {self.session.system}")
            elif default:
                self.note(f"system prompt (the template's default): {default}; /system TEXT replaces it")
            else:
                self.note("no system prompt; /system TEXT sets one")
            return
        text = None if command.arg == CLEAR_FLAG else command.arg
        try:
            with self._progress("re-encoding") as progress, interrupt_once():
                n = self.session.set_system(text, progress)
        except KeyboardInterrupt:
            n = -1
        if n < 0:
            self.note("stopped; the rest is encoded with the next message")
        else:
            what = "system prompt removed" if text is None else "system prompt set"
            self.note(what + self.session.encoded_note(n, system=True))

    def _set(self, command: Command) -> None:
        if not command.values:
            if self.info.is_terminal:
                self.info.print(columns(settings_rows(self.session.sampling), self.info.width))
            else:
                self.info.print(settings_text(self.session.sampling), highlight=False, markup=False)
            return
        sampling = self.session.sampling
        for key, value in command.values.items():
            sampling = sampling.with_value(key, "none" if value is None else value)
        self.session.set_sampling(sampling)
        self.note(", ".join(f"{k} = {'random' if v is None else v}" for k, v in command.values.items()))

    def _save(self, command: Command) -> None:
        path = (
            expand(command.arg)
            if command.arg
            else (data_dir() / "saved" / time.strftime("chat-%Y%m%d-%H%M%S.json"))
        )
        # the default folder is made; a folder the user names must exist (a typo is refused)
        written = self.session.save(path, model=self.loaded.name, make_folder=not command.arg)
        self.session.keep_saved_cache(self.session.to_dict(self.loaded.name))
        self.note(f"saved {counted(len(self.session.turns), 'turn')} to {written}")

    def _load(self, command: Command) -> None:
        from chatbot.conversation.saved import read_saved

        data = read_saved(command.arg)
        self.session.take_saved_cache(data)
        self._restore(data)
        model = data.get("model")
        if isinstance(model, str) and model and model != self.loaded.name:
            self.note(f"that chat was with {without_surrogates(model)}; continuing with {self.loaded.name}")

    def _restore(self, data: dict[str, Any]) -> None:
        try:
            with self._progress("encoding the history") as progress, interrupt_once():
                problems: list[str] = []
                n = self.session.restore(data, progress, warnings=problems)
            for problem in problems:
                self.note(f"warning: {problem}")
            self.note(
                f"loaded {counted(len(self.session.turns), 'turn')}"
                + self.session.encoded_note(n, system=False)
            )
        except KeyboardInterrupt:
            self.note(
                f"loaded {counted(len(self.session.turns), 'turn')}; encoding stopped, the rest is "
                "encoded with the next message"
            )
        except ContextFullError as exc:
            # The conversation is kept (not encoded): the user decides what to drop.
            self.note(
                f"loaded {counted(len(self.session.turns), 'turn')}, but they do not fit: {exc}; "
                "/undo drops the last turn"
            )

    def _history(self, _: Command) -> None:
        self.info.print(history_renderable(self.session.turns, self.session.system, markdown=not self.plain))

    def _stats(self, _: Command) -> None:
        if not self.session.turns:
            self.note("no turns yet")
            return
        self.info.print(stats_renderable(self.info, self.session.turns, self.session.summary()))

    def keep_thinking(self, continued: bool) -> None:
        """The answer just streamed closed the last turn: its thinking (`last_thinking`) is
        that turn's, after what it had where the answer was `continued`, instead of it on a
        /retry. Turns no longer in the chat (/undo, /reset, /load) are let go."""
        turns, thought, self.last_thinking = self.session.turns, self.last_thinking, ""
        live = {id(t) for t in turns}
        self.thoughts = {k: v for k, v in self.thoughts.items() if k in live}
        if turns:
            before = self.thoughts.get(id(turns[-1]), (None, ""))[1] if continued else ""
            self.thoughts[id(turns[-1])] = (turns[-1], before + thought)

    def _thinking(self, _: Command) -> None:
        turns = self.session.turns
        turn, thought = self.thoughts.get(id(turns[-1]), (None, "")) if turns else (None, "")
        thought = thought.strip() if turn is turns[-1] else ""
        if not thought:
            self.note("the last answer had no thinking")
            return
        self.info.print(Text(safe_text(thought), style="dim italic"), crop=False)

    def _model(self, _: Command) -> None:
        title, rows = self.session.describe_model(self.loaded)
        rows["sampling"] = sampling_brief(self.session.sampling)
        self.info.print(key_value_table(title, rows))

    def _cache(self, _: Command) -> None:
        title, rows = self.session.describe_cache()
        self.info.print(key_value_table(title, rows))


def _brief(text: str, n: int = 40) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[: n - 1] + "…"
