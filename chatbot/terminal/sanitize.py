"""Text that is safe to show on a terminal.

Anything that did not come from us (model output, a loaded session file, a session log, a
pasted message, a file name in an error) may hold control sequences: ESC starts CSI (cursor
moves, clear screen), OSC (window title, OSC 52 clipboard writes, hyperlinks) and others;
C1 controls (U+0080-U+009F) are the same in 8-bit form; bidi overrides reorder what a line
seems to say. `safe_text` makes every such character visible instead of acting on it, so a
person sees that something was there and the terminal does nothing. Newlines and tabs stay.
"""

from __future__ import annotations

import re

__all__ = ["BIDI_CONTROLS", "is_safe", "safe_line", "safe_text"]

# Explicit directional formatting characters (Unicode TR9): embeddings, overrides,
# isolates and their terminators, plus the marks that can flip a run's order.
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")

# C0 controls but tab and newline, DEL, C1 controls, bidi controls, lone surrogates (which
# cannot be encoded and crash a write to the terminal) and the line/paragraph separators
# (some terminals treat them as new lines in the middle of a record).
_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff]"
)


def _visible(match: re.Match[str]) -> str:
    ch = match.group()
    code = ord(ch)
    if code < 0x20:
        return chr(0x2400 + code)  # the Control Pictures block: ␛ for ESC, ␍ for CR
    if code == 0x7F:
        return "\u2421"  # ␡
    if 0xD800 <= code <= 0xDFFF:
        return "\ufffd"
    return f"<U+{code:04X}>"


def safe_text(text: str) -> str:
    """`text` with every control character made visible (ESC as ␛, CR as ␍, C1 and bidi
    controls as `<U+202E>`), lone surrogates as U+FFFD; newlines and tabs are kept.

    The result holds no character a terminal acts on, so `safe_text(safe_text(t)) ==
    safe_text(t)`.
    """
    if not isinstance(text, str):
        text = str(text)
    return _UNSAFE.sub(_visible, text.replace("\r\n", "\n"))


def safe_line(text: str) -> str:
    """`safe_text` on one line: newlines shown as ␤ (an error message stays one line even
    when a file name holds a newline)."""
    return safe_text(text).replace("\n", "\u2424")


def is_safe(text: str) -> bool:
    """True when `text` holds no character that `safe_text` would change."""
    return _UNSAFE.search(text) is None
