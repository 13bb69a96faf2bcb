"""Exceptions raised by the core. Only the CLI turns them into messages."""


class ChatbotError(Exception):
    """Base class: the message says what went wrong and what to do."""


class ModelLoadError(ChatbotError):
    """A model or tokenizer could not be found or loaded."""


class ConfigError(ChatbotError):
    """A setting, flag or preset value is invalid."""


class ContextFullError(ChatbotError):
    """The conversation would not fit in the model's context."""


class StreamingUnsupportedError(ChatbotError):
    """The model cannot run with the attention-sink cache (or not with the window asked for).

    Args:
        message: what is wrong, in the engine's words (the CLI names the flag).
        recent_fits: the largest recent window that would fit, where a smaller one would do
            (0: none would: fewer sinks are needed); None where the window is not the cause.
    """

    def __init__(self, message: str, recent_fits: int | None = None) -> None:
        super().__init__(message)
        self.recent_fits = recent_fits


class CommandError(ChatbotError):
    """A slash-command could not be parsed or run."""


class NonFiniteOutputError(ChatbotError):
    """The model produced NaN or infinity: damaged weights or metadata, not a bad answer."""


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (300 characters at most), for one-line errors."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
