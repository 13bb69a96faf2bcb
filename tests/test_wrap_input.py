"""The prompt's word wrapping (`chatbot.terminal.wrap_input`) as a function: where a line
laid on rows of a given width gets padded so that no word is split."""

from __future__ import annotations

import re

from chatbot.terminal.wrap_input import word_breaks


def rows(text: str, room: int) -> list[str]:
    """The rows the screen shows of `text` with the padding `word_breaks` says."""
    pads = word_breaks(list(text), room)
    laid = "".join(" " * pads.get(i, 0) + c for i, c in enumerate(text))
    return [laid[i : i + room] for i in range(0, len(laid), room)]


def test_words_move_whole_to_the_next_row():
    text = "then a Markdown table with some rows and more"
    shown = rows(text, 12)
    assert all(w in text.split() for row in shown for w in row.split())
    assert " ".join(" ".join(shown).split()) == text


def test_a_word_longer_than_a_row_is_split_as_the_terminal_would():
    pads = word_breaks(list("ab " + "x" * 25), 10)
    assert pads == {}  # no padding: the word does not fit any row


def test_a_short_line_is_left_alone():
    assert word_breaks(list("short line"), 40) == {}


def fold(text: str, cursor: int | None, width: int = 80, rows: int = 12):
    """`FoldLongLines` applied to one line of `text` (with the cursor at `cursor`, or on
    another line): the text shown and the two position maps."""
    from prompt_toolkit.document import Document
    from prompt_toolkit.layout.processors import TransformationInput

    from chatbot.terminal.wrap_input import FoldLongLines

    document = Document(text + "\nnext", len(text) + 1 if cursor is None else cursor)
    ti = TransformationInput(None, document, 0, lambda i: i, [("", text)], width, 24)  # type: ignore[arg-type]
    t = FoldLongLines(lambda: 2, lambda: rows).apply_transformation(ti)
    return "".join(f[1] for f in t.fragments), t.source_to_display, t.display_to_source


LONG = " ".join(f"word{i}" for i in range(2500))  # 18,889 characters


def test_a_long_line_shows_its_start_a_fold_mark_and_its_end():
    shown, _, _ = fold(LONG, None)
    assert shown.startswith("word0 word1 ") and shown.endswith(" word2498 word2499")
    (hidden,) = re.findall(r"\[… ([\d,]+) characters …\]", shown)
    assert len(shown) < 4 * 78 and int(hidden.replace(",", "")) > len(LONG) - 4 * 78
    # The fold cuts between words: every word shown is one of the line's, whole.
    words = set(LONG.split())
    assert all(w in words for w in re.sub(r"\[… [\d,]+ characters …\]", " ", shown).split())


def test_the_cursor_anywhere_in_a_folded_line_is_shown_on_its_character():
    for cursor in (0, 5, 3000, 9000, len(LONG) - 100, len(LONG)):
        shown, to_display, to_source = fold(LONG, cursor)
        assert len(shown) <= 12 * 78, cursor
        at = to_display(cursor)
        assert shown[at : at + 8] == LONG[cursor : cursor + 8], cursor  # the rows around the cursor
        assert to_source(at) == cursor
        assert shown.endswith("word2499")  # the line's end stays in view


def test_a_line_that_fits_is_not_folded():
    text = "short words " * 60  # 720 characters: 10 rows of 78
    shown, to_display, _ = fold(text, 30)
    assert shown == text and to_display(30) == 30


def test_a_folded_line_of_wide_characters_stays_within_its_rows():
    from prompt_toolkit.utils import get_cwidth

    text = "日本語のテキストと中文文本 " * 800  # two cells a character
    shown, to_display, _ = fold(text, len(text) // 2)
    assert get_cwidth(shown) <= 12 * 78
    assert shown[to_display(len(text) // 2) :].startswith(text[len(text) // 2 : len(text) // 2 + 5])
