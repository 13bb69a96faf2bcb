"""Word wrapping for the prompt: prompt_toolkit wraps a long input line at the last column,
inside a word. `WordWrap` moves a word that would cross the row's end to the next row, by
padding the row with spaces on the screen only (the text typed is unchanged, and the
cursor moves over the padding as over one position). `FoldLongLines` shows a line too long
for the screen (a long paste) folded to a few rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from prompt_toolkit.formatted_text import StyleAndTextTuples
from prompt_toolkit.layout.processors import Processor, Transformation, TransformationInput
from prompt_toolkit.layout.utils import explode_text_fragments
from prompt_toolkit.utils import get_cwidth

from chatbot.wording import counted


def word_breaks(chars: list[str], room: int) -> dict[int, int]:
    """Where to pad a line of `chars` (one character each) laid on rows of `room` cells so that
    no word is split: {index of a word's first character: spaces to put before it}. A word
    wider than a row is split, as the terminal would."""
    pads: dict[int, int] = {}
    x = 0
    i = 0
    while i < len(chars):
        if not chars[i].isspace() and (i == 0 or chars[i - 1].isspace()):
            end = i
            while end < len(chars) and not chars[end].isspace():
                end += 1
            word = sum(get_cwidth(c) for c in chars[i:end])
            if 0 < x and x + word > room and word <= room:
                pads[i] = room - x
                x = 0
        w = get_cwidth(chars[i])
        if x + w > room:
            x = 0
        x += w
        i += 1
    return pads


class WordWrap(Processor):
    """Pads each input line so that the window wraps it between words.

    Args:
        prefix_width: the cells the prompt (or the continuation, which is as wide) takes
            before each row's text.
    """

    def __init__(self, prefix_width: Callable[[], int]) -> None:
        self.prefix_width = prefix_width

    def apply_transformation(self, ti: TransformationInput) -> Transformation:
        room = ti.width - self.prefix_width()
        fragments = explode_text_fragments(ti.fragments)
        if room < 8 or sum(get_cwidth(f[1]) for f in fragments) <= room:
            return Transformation(ti.fragments)
        # A fold mark (`FoldLongLines`) is kept whole on a row, as one word.
        pads = word_breaks(["x" if "fold" in f[0] else f[1] for f in fragments], room)
        if not pads:
            return Transformation(ti.fragments)
        out: StyleAndTextTuples = []
        shift = [0] * (len(fragments) + 1)  # display offset of each input position
        added = 0
        for i, fragment in enumerate(fragments):
            if i in pads:
                out.append(("", " " * pads[i]))
                added += pads[i]
            shift[i] = added
            out.append(fragment)
        shift[len(fragments)] = added

        def to_display(i: int) -> int:
            return i + shift[min(max(i, 0), len(fragments))]

        def to_source(i: int) -> int:
            best = 0
            for j in range(len(fragments) + 1):
                if j + shift[j] <= i:
                    best = j
                else:
                    break
            return best

        return Transformation(out, source_to_display=to_display, display_to_source=to_source)


def slice_fragments(fragments: StyleAndTextTuples, start: int, stop: int) -> StyleAndTextTuples:
    """The characters `start`..`stop` of a fragment list, with their styles (one pass, no
    explosion into single characters: a pasted line may be tens of thousands long)."""
    out: StyleAndTextTuples = []
    pos = 0
    for fragment in fragments:
        text = fragment[1]
        end = pos + len(text)
        if end > start and pos < stop:
            out.append((fragment[0], text[max(start - pos, 0) : stop - pos]))
        pos = end
        if pos >= stop:
            break
    return out


def kept_spans(length: int, room: int, rows: int, cursor: int | None) -> list[tuple[int, int]]:
    """The parts of a line of `length` characters that a fold shows, as [start, stop) spans in
    order: its first row, the rows before the cursor and one after it (when the cursor is on
    the line), and its last row; together about `rows` rows of `room` characters. A line that
    fits in `rows` rows is shown whole: one span."""
    if length <= rows * room:
        return [(0, length)]
    before = max(rows - 4, 1) * room  # head, two fold marks and the last row take the rest
    spans = [(0, room - 1), (length - room, length)]  # the head leaves a cell for the space after it
    if cursor is not None:
        spans.append((max(cursor - before, 0), min(cursor + room, length)))
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1] + room // 2:  # a small gap is shown, not folded
            merged[-1] = (merged[-1][0], max(stop, merged[-1][1]))
        else:
            merged.append((start, stop))
    return merged


def _at_spaces(text: str, start: int, stop: int, cursor: int | None, reach: int = 16) -> tuple[int, int]:
    """A span moved in to the nearest spaces within `reach`, so that a fold cuts no word
    (a cursor inside stays inside)."""
    inside = cursor is not None and start <= cursor <= stop
    if start > 0:
        space = text.find(" ", start, start + reach)
        if space >= 0 and not (inside and space >= cast(int, cursor)):
            start = space + 1
    if stop < len(text):
        space = text.rfind(" ", stop - reach, stop)
        if space > start and not (inside and space < cast(int, cursor)):
            stop = space
    return start, stop


class FoldLongLines(Processor):
    """Shows a line of the input that would fill more than `max_rows()` rows (a long paste)
    folded: its first row, a mark saying how many characters are hidden, the rows around the
    cursor, its last row. Only the screen changes: the text typed or pasted is sent whole,
    and moving the cursor through the line shows the rows it reaches.

    prompt_toolkit draws a line taller than the window by scrolling inside it only when the
    cursor is on it; above the cursor's line such a line is not drawn at all (a paste that
    ended with a newline showed a blank screen), and drawing it whole costs a layout of every
    character at every key.

    Args:
        prefix_width: the cells the prompt (or the continuation) takes before each row.
        max_rows: the most rows one line of the input may take on the screen.
    """

    def __init__(self, prefix_width: Callable[[], int], max_rows: Callable[[], int]) -> None:
        self.prefix_width = prefix_width
        self.max_rows = max_rows

    def apply_transformation(self, ti: TransformationInput) -> Transformation:
        text = "".join(f[1] for f in ti.fragments)
        length = len(text)
        # Characters to a row: a wide (CJK) character takes two cells, so a line that is not
        # all ASCII is measured as if every character did.
        room = (ti.width - self.prefix_width()) // (1 if text.isascii() else 2)
        rows = max(self.max_rows(), 4)
        if room < 8 or length <= rows * room:
            return Transformation(ti.fragments)
        cursor = None
        if ti.lineno == ti.document.cursor_position_row:
            cursor = ti.source_to_display(ti.document.cursor_position_col)
        spans = [_at_spaces(text, *span, cursor) for span in kept_spans(length, room, rows, cursor)]
        out: StyleAndTextTuples = []
        starts: list[int] = []  # display position of each span's first character
        for i, (start, stop) in enumerate(spans):
            if i or start:
                hidden = start - (spans[i - 1][1] if i else 0)
                mark = f"[… {counted(hidden, 'character')} …]"
                out.extend([("", " "), ("class:fold reverse", mark), ("", " ")])
            starts.append(sum(len(f[1]) for f in out))
            out.extend(slice_fragments(ti.fragments, start, stop))

        def to_display(i: int) -> int:
            for (start, stop), at in zip(reversed(spans), reversed(starts)):
                if i >= start:
                    return at + min(i, stop) - start
            return 0

        def to_source(i: int) -> int:  # a position on a fold mark is the hidden text's start
            for (start, stop), at in zip(reversed(spans), reversed(starts)):
                if i >= at:
                    return start + min(i - at, stop - start)
            return spans[0][0]

        return Transformation(out, source_to_display=to_display, display_to_source=to_source)
