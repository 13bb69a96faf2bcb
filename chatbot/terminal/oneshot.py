"""`chatbot run "PROMPT"` (or `-p PROMPT`): one answer, then exit. The answer goes to stdout,
notes and the stats line to stderr; text piped in goes before the prompt, in the same user
message (`cat notes.txt | chatbot run "Summarize this."`). The exit status says whether it
answered: 0, else 1 (the error line was printed) or 130 (Ctrl-C).
"""

from __future__ import annotations

from typing import IO

from chatbot.errors import ConfigError
from chatbot.terminal.input import clean_message
from chatbot.terminal.repl import MAX_MESSAGE_CHARS, Repl

INTERRUPTED = 130


def one_shot_message(argument: str | None, option: str | None, stdin: IO[bytes] | None) -> str | None:
    """The message of a one-shot run: the prompt, after the text piped in (None: no prompt
    was given, so `run` chats as usual).

    Args:
        argument, option: the prompt as `run`'s argument, and as `-p/--prompt`.
        stdin: the standard input where it is not a terminal (read to its end), else None.

    Raises:
        ConfigError: both forms given, an empty prompt, or a message over the limit.
    """
    if argument is not None and option is not None:
        raise ConfigError("give the prompt once: as the argument or with -p/--prompt, not both")
    prompt = argument if argument is not None else option
    if prompt is None:
        return None
    prompt = clean_message(prompt).strip()
    if not prompt:
        raise ConfigError('empty prompt: give the question, e.g. chatbot run "What is a KV cache?"')
    try:
        piped = clean_message(stdin.read().decode("utf-8", errors="replace")) if stdin is not None else ""
    except OSError as exc:  # `< folder`, a stream closed under us
        raise ConfigError(f"cannot read the text piped in: {exc.strerror or exc}") from None
    # The piped text, a blank line, the prompt: the prompt reads as an instruction about the text.
    message = f"{piped.strip()}\n\n{prompt}" if piped.strip() else prompt
    if len(message) > MAX_MESSAGE_CHARS:
        raise ConfigError(
            f"the message is too long ({len(message):,} characters with the piped text; "
            f"the limit is {MAX_MESSAGE_CHARS:,})"
        )
    return message


def answer_once(repl: Repl, message: str) -> int:
    """Send `message` on `repl`'s session and show the answer (no prompt, no commands: a
    message starting with a slash is sent as it is). Returns the exit status: 0 answered, 1
    failed (its error line is printed), 130 stopped by Ctrl-C."""
    failed, turns = repl.failed, len(repl.session.turns)
    repl.one_shot = True
    for note in repl.session.take_notes():  # e.g. --think on a model that has no switch
        repl.note(note)
    repl.chat(message)
    if repl.failed > failed:
        return 1
    if len(repl.session.turns) == turns or repl.session.turns[-1].interrupted:
        return INTERRUPTED
    return 0
