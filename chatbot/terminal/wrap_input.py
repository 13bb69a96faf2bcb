"""Word wrapping for the prompt: prompt_toolkit wraps a long input line at the last column,
inside a word. `WordWrap` moves a word that would cross the row's end to the next row, by
padding the row with spaces on the screen only (the text typed is unchanged, and the
cursor moves over the padding as over one position)."""

from __future__ import annotations

from collections.abc import Callable

from prompt_toolkit.formatted_text import StyleAndTextTuples
from prompt_toolkit.layout.processors import Processor, Transformation, TransformationInput
from prompt_toolkit.layout.utils import explode_text_fragments
from prompt_toolkit.utils import get_cwidth


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
        pads = word_breaks([f[1] for f in fragments], room)
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
