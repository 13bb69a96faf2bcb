"""Bounded reading of files that come from outside: sizes, nesting, kinds of file.

`--config`, `/load`, `--resume`, chat templates and session logs are read through here, so
that `/dev/zero`, a FIFO, a binary file or JSON nested ten thousand deep gives a one-line
error instead of a hang, a memory blow-up or a RecursionError.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chatbot.errors import ChatbotError

MiB = 1 << 20
MAX_CONFIG_BYTES = 1 * MiB  # a preset or a chat template
MAX_SAVED_BYTES = 64 * MiB  # a saved chat (/load)
MAX_LOG_BYTES = 256 * MiB  # a session log (--resume, chatbot sessions)
MAX_LOG_LINE_BYTES = 64 * MiB  # one event of a session log
MAX_DEPTH = 64  # nesting of JSON / YAML: ours is at most 4 deep
MAX_NODES = 2_000_000  # values in one document (YAML aliases can multiply them)


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for an error message (from its st_mode)."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def expand(path: str | os.PathLike[str]) -> Path:
    """`~` expanded; a clear error (not RuntimeError) when there is no home directory.

    Raises:
        ChatbotError: `~` cannot be expanded.
    """
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise ChatbotError(f"cannot expand {str(path)!r}: no home directory (set HOME)") from None


def open_regular(path: str | os.PathLike[str], what: str = "file") -> int:
    """A read-only descriptor of a regular file; FIFOs, devices, sockets and folders are refused
    without blocking (a FIFO with no writer would hang a plain open).

    Raises:
        ChatbotError: no such file, not a regular file, or it cannot be opened.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ChatbotError(f"no such {what}: {p}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ChatbotError(f"cannot read {p}: a loop of symbolic links") from None
        raise ChatbotError(f"cannot read {p}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ChatbotError(f"cannot read {p}: it is {file_kind(mode)}, not a {what}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | os.PathLike[str], limit: int, what: str = "file") -> bytes:
    """At most `limit` bytes of a regular file.

    Raises:
        ChatbotError: not a regular file, unreadable, or larger than `limit`.
    """
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise ChatbotError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ChatbotError(f"{path} is too large for a {what} (over {limit // MiB} MiB)")
    return data


def read_text(path: str | os.PathLike[str], limit: int, what: str = "file") -> str:
    """A regular file of at most `limit` bytes, decoded as UTF-8.

    Raises:
        ChatbotError: as `read_bytes`, or the file is not UTF-8 text (e.g. binary).
    """
    data = read_bytes(path, limit, what)
    if b"\x00" in data:
        raise ChatbotError(f"{path} is not a {what}: it holds binary data")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatbotError(f"{path} is not a {what}: not UTF-8 text (byte {exc.start})") from None


def without_surrogates(text: str) -> str:
    """`text` with each lone surrogate (JSON's "\\ud800", which no UTF-8 can carry) replaced by
    U+FFFD: text from a file or a server is cleaned so where it comes in, before a tokenizer,
    a pipe or a save meets it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_nesting(data: Any, what: str, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """Refuse data nested deeper than `max_depth` or with more than `max_nodes` values
    (walked without recursion; shared YAML aliases count each time they are reached).

    Raises:
        ChatbotError: too deep or too big.
    """
    stack: list[tuple[Any, int]] = [(data, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ChatbotError(f"{what} is too big (over {max_nodes:,} values)")
        if isinstance(value, (dict, list, tuple)):
            if depth > max_depth:
                raise ChatbotError(f"{what} is nested too deeply (over {max_depth} levels)")
            children = value.values() if isinstance(value, dict) else value
            if isinstance(value, dict):
                stack.extend((k, depth + 1) for k in value)
            stack.extend((v, depth + 1) for v in children)


def _no_constant(name: str) -> None:
    return None  # NaN / Infinity are not JSON: read as null, never as a float nobody can print


def loads_json(text: str, what: str) -> Any:
    """Parse JSON with bounded nesting; NaN and Infinity become None.

    Raises:
        ChatbotError: invalid JSON, or nested too deeply.
    """
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ChatbotError(f"{what} is nested too deeply") from None
    except ValueError as exc:
        raise ChatbotError(f"{what} is not valid JSON ({exc})") from None
    check_nesting(data, what)
    return data


def loads_yaml(text: str, what: str) -> Any:
    """Parse YAML (safe loader) with bounded nesting and size.

    Raises:
        ChatbotError: nested too deeply or too big (YAML syntax errors pass through as
            yaml.YAMLError, for the caller's line numbers).
    """
    import yaml

    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ChatbotError(f"{what} is nested too deeply") from None
    check_nesting(data, what)
    return data


def finite(value: Any) -> bool:
    """A real number that is neither NaN nor infinite (bools excluded)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def bounded_lines(
    path: str | os.PathLike[str], limit: int = MAX_LOG_BYTES, line_limit: int = MAX_LOG_LINE_BYTES
) -> Iterator[str]:
    """The lines of a regular file as text (bad UTF-8 replaced), reading at most `limit`
    bytes; a line longer than `line_limit` is skipped whole.

    Raises:
        ChatbotError: not a regular file, or unreadable.
    """
    fd = open_regular(path, "session log")
    read = 0
    with os.fdopen(fd, "rb") as f:
        while read < limit:
            try:
                raw = f.readline(line_limit + 1)
            except OSError as exc:
                raise ChatbotError(f"cannot read {path}: {exc.strerror or exc}") from None
            if not raw:
                return
            read += len(raw)
            if len(raw) > line_limit and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n") and read < limit:  # skip the rest of the line
                    raw = f.readline(min(line_limit, limit - read))
                    read += len(raw)
                continue
            yield raw.decode("utf-8", errors="replace")
