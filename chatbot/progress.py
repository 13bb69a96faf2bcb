"""What a long wait is waiting for: the core says it (`waiting`), a front end listens (`listen`).

A step that can take more than about a second the first time (building the native kernels,
reading a GGUF file's tokenizer, a dequantized copy) runs inside ``waiting("...")``; the
terminal shows the words on its loading line or toolbar, a pipe shows nothing. Waits nest (the
innermost is the one shown) and may run in any thread: the model loads behind the prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Listener = Callable[[str | None], None]
"""Told the current wait's words when one starts or ends (None: no wait now)."""

_lock = threading.Lock()
_waits: list[str] = []
_listeners: list[Listener] = []


def current() -> str | None:
    """The words of the innermost wait going on now, or None."""
    with _lock:
        return _waits[-1] if _waits else None


def _tell() -> None:
    with _lock:
        now, listeners = (_waits[-1] if _waits else None), list(_listeners)
    for listener in listeners:
        listener(now)


@contextmanager
def waiting(what: str) -> Iterator[None]:
    """Say that the code inside waits on `what` (e.g. "building the native kernels (once)")."""
    with _lock:
        _waits.append(what)
    _tell()
    try:
        yield
    finally:
        with _lock:
            _waits.remove(what)
        _tell()


@contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Tell `listener` of every wait that starts or ends while inside (and of one going on)."""
    with _lock:
        _listeners.append(listener)
        now = _waits[-1] if _waits else None
    if now is not None:
        listener(now)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
