"""The core's errors in the words of the command line and the chat: the engine says what is
wrong ("the attention-sink cache must lie inside the model's sliding window"), and this says
which flag or command changes it."""

from __future__ import annotations

from chatbot.errors import ContextFullError, StreamingUnsupportedError


def in_user_words(exc: Exception) -> str:
    """`exc`'s message, with the flag or command that helps where there is one."""
    if isinstance(exc, StreamingUnsupportedError):
        text = f"--enable-streaming: {exc}"
        if exc.recent_fits:
            return f"{text}; use --recent-size {exc.recent_fits} or less"
        if exc.recent_fits == 0:
            return f"{text}; use fewer --start-size tokens"
        return text
    if isinstance(exc, ContextFullError):
        return f"{exc}: /reset, or restart with --enable-streaming"
    return str(exc)
