"""`scripts/bench-render`: the terminal renderer's own cost per token, against the decode speed it
must keep up with.

A Markdown answer (paragraphs, lists, code, a table; or `--answer table`, one long table) is
cut into ~2,000 token-sized pieces and fed to the live answer renderer as a model at `rate`
tokens/s would feed it: a clock advances 1/rate per piece and by the renderer's own time (it
runs on the decode thread), so the screen refreshes as often as it would (at most 12 times a
second). Output goes to an in-memory terminal, so only our own work is timed, not the
emulator's. "tok/s left" is the decode speed that remains: pieces / (decode time + render
time). Beside it, the way answers were shown before (Rich `Live` re-rendering the whole answer).
"""

from __future__ import annotations

import io
import re
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markdown import Markdown
from rich.table import Table

from chatbot.measure.report import conditions
from chatbot.terminal.live_answer import MarkdownAnswer

_SECTION = """\
## Step {n}: what to do

This paragraph explains step {n} in some detail, so that it wraps over several lines of an
80-column terminal: the words are ordinary, with **bold**, *italic* and `inline code` mixed in.

- the first point of step {n}, long enough to wrap under its bullet on a narrow screen
- a second point
- a third point with `code`

```python
def step_{n}(values):
    total = 0
    for value in values:
        total += value * {n}
    return total
```

| item | count |
|------|-------|
| a{n}  | {n}     |

"""


_TABLE_HEAD = """\
Here is the comparison you asked for:

| name | language | year | speed | notes |
|------|----------|------|-------|-------|
"""
_TABLE_ROW = "| item{n} | Python {v} | {year} | {speed:.1f} ms | fast and small {n} |\n"


def _table_rows(n: int) -> str:
    return _TABLE_ROW.format(n=n, v=n % 4, year=1990 + n, speed=3.5 * n)


ANSWERS: dict[str, tuple[str, Callable[[int], str]]] = {
    "mixed": ("", lambda n: _SECTION.format(n=n)),
    "table": (_TABLE_HEAD, _table_rows),  # one table that grows to the end of the answer
}


def answer_pieces(tokens: int, answer: str = "mixed") -> list[str]:
    """About `tokens` token-sized pieces (a word with its space, or punctuation) of Markdown."""
    head, part = ANSWERS[answer]
    pieces: list[str] = re.findall(r" ?\w+| ?[^\w\s]+|\s+", head)
    n = 1
    while len(pieces) < tokens:
        pieces += re.findall(r" ?\w+| ?[^\w\s]+|\s+", part(n))
        n += 1
    return pieces[:tokens]


def _feed(
    make: Callable[[Console, Callable[[], float]], Any],
    pieces: list[str],
    rate: float,
    width: int,
    height: int,
) -> dict[str, float]:
    screen = io.StringIO()
    console = Console(
        file=screen,
        force_terminal=True,
        width=width,
        height=height,
        color_system="truecolor",
        highlight=False,
    )
    decoded = [0.0]  # the decode time so far; the renderer's own time is added as it passes
    per_piece = []
    start = time.perf_counter()
    with make(console, lambda: decoded[0] + time.perf_counter() - start) as answer:
        for piece in pieces:
            decoded[0] += 1.0 / rate
            t = time.perf_counter()
            answer.add(piece)
            per_piece.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    per_piece.sort()
    return {
        "ms_per_token": 1000 * total / len(pieces),
        "p99_ms": 1000 * per_piece[int(0.99 * (len(per_piece) - 1))],
        "max_ms": 1000 * per_piece[-1],
        "budget_share": total / (len(pieces) / rate),
        "decode_left_tok_s": len(pieces) / (len(pieces) / rate + total),
        "bytes_written": len(screen.getvalue()),
    }


class _WholeAnswerLive:
    """Answers as shown before: Rich Live re-rendering all of the Markdown at each refresh."""

    def __init__(self, console: Console, clock: Callable[[], float]) -> None:
        self.text = ""
        self.clock = clock
        self.last = -1e9
        self.live = Live(
            console=console,
            auto_refresh=False,
            vertical_overflow="crop",
            get_renderable=lambda: Markdown(self.text),
        )

    def __enter__(self) -> _WholeAnswerLive:  # noqa: PYI034
        self.live.start()
        return self

    def add(self, text: str) -> None:
        self.text += text
        if self.clock() - self.last >= 1 / 12:
            self.last = self.clock()
            self.live.refresh()

    def __exit__(self, *exc: object) -> None:
        self.live.stop()


def run_render_bench(
    tokens: int = 2000,
    rate: float = 150.0,
    width: int = 80,
    height: int = 24,
    repeats: int = 3,
    answer: str = "mixed",
) -> dict[str, Any]:
    """Median of `repeats` runs of each renderer over the same pieces."""
    pieces = answer_pieces(tokens, answer)
    setups: dict[str, Callable[[Console, Callable[[], float]], Any]] = {
        "append-only blocks (ours)": lambda c, clock: MarkdownAnswer(c, clock=clock),
        "whole-answer Live (before)": _WholeAnswerLive,
    }
    rows = []
    for name, make in setups.items():
        runs = sorted(
            (_feed(make, pieces, rate, width, height) for _ in range(repeats)),
            key=lambda r: r["ms_per_token"],
        )
        rows.append({"renderer": name, **runs[len(runs) // 2]})
    return {
        "tokens": len(pieces),
        "answer": answer,
        "rate_tok_s": rate,
        "width": width,
        "height": height,
        "budget_ms_per_token": 1000 / rate,
        "rows": rows,
        "conditions": conditions(),
    }


def print_render(console: Console, result: dict[str, Any]) -> None:
    table = Table(
        title=f"renderer cost, {result.get('answer', 'mixed')} answer, "
        f"{result['tokens']:,} tokens at {result['rate_tok_s']:g} tok/s, "
        f"{result['width']} columns (budget {result['budget_ms_per_token']:.2f} ms/token)"
    )
    for col in ("renderer", "ms/token", "p99 ms", "max ms", "share of decode time", "tok/s left"):
        table.add_column(col, justify="left" if col == "renderer" else "right", no_wrap=col == "renderer")
    for r in result["rows"]:
        table.add_row(
            r["renderer"],
            f"{r['ms_per_token']:.3f}",
            f"{r['p99_ms']:.2f}",
            f"{r['max_ms']:.1f}",
            f"{100 * r['budget_share']:.1f}%",
            f"{r['decode_left_tok_s']:.1f}" if "decode_left_tok_s" in r else "-",  # older JSON
        )
    console.print(table)
    console.print(result.get("conditions") or conditions(), style="dim", markup=False)


def main(argv: list[str] | None = None) -> None:
    """`scripts/bench-render [--tokens N] [--rate TOK_S] [--width COLUMNS] [--answer mixed|table]
    [--json FILE]`."""
    import argparse
    from pathlib import Path

    from chatbot.measure.report import write_json

    p = argparse.ArgumentParser(prog="scripts/bench-render", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000, help="pieces of the Markdown answer (at least 10)")
    p.add_argument("--rate", type=float, default=150.0, help="decode speed to keep up with, tokens/s")
    p.add_argument("--width", type=int, default=80, help="terminal columns (at least 20)")
    p.add_argument("--answer", choices=sorted(ANSWERS), default="mixed", help="the Markdown streamed")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args(argv)
    if a.tokens < 10 or a.width < 20 or a.rate <= 0:
        p.error("--tokens is at least 10, --width at least 20, --rate above 0")
    result = run_render_bench(a.tokens, a.rate, a.width, answer=a.answer)
    print_render(Console(), result)
    if a.json:
        write_json(a.json, result)


if __name__ == "__main__":
    import sys

    from devtools import run_tool

    sys.exit(run_tool("bench-render", main))
