"""The prompt's word wrapping (`chatbot.terminal.wrap_input`) as a function: where a line
laid on rows of a given width gets padded so that no word is split."""

from __future__ import annotations

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
