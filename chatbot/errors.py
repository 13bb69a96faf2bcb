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
    """The model cannot run with the attention-sink cache."""


class CommandError(ChatbotError):
    """A slash-command could not be parsed or run."""


class NonFiniteOutputError(ChatbotError):
    """The model produced NaN or infinity: damaged weights or metadata, not a bad answer."""


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (300 characters at most), for one-line errors."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
