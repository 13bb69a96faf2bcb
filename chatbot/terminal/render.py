"""Turning engine output into text on the terminal: stats lines, tables, live answers."""

from __future__ import annotations

import re
import sys
from typing import IO, Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markdown import Markdown
from rich.table import Table
from rich.text import Text

from chatbot.engine.stats import TurnStats
from chatbot.terminal.sanitize import safe_text


def format_cache(stats: TurnStats) -> str:
    if stats.sinks or stats.evicted_total:
        return (
            f"cache {stats.cache_tokens:,}/{(stats.cache_capacity or 0):,} · "
            f"{stats.sinks} sinks · {stats.evicted_total:,} evicted"
        )
    return f"cache {stats.cache_tokens:,}"


def format_stats_line(stats: TurnStats) -> str:
    """One line, e.g. `context 41 tok · 0.09 s · first token 0.12 s · 96 tok · 24.1 tok/s ·
    41.5 ms/tok (p90 55) · cache 412`."""
    parts = [
        f"context {stats.context_tokens:,} tok",
        f"{stats.context_time_s:.2f} s",
        f"first token {stats.ttft_s:.2f} s",
        f"{stats.generated_tokens:,} tok",
    ]
    if stats.token_latencies_s:
        parts.append(f"{stats.decode_tps:.1f} tok/s")
        parts.append(f"{stats.ms_per_token_mean:.1f} ms/tok (p90 {stats.ms_per_token_p90:.0f})")
    parts.append(format_cache(stats))
    if stats.finish_reason in ("length", "context", "interrupted"):
        parts.append({"length": "max tokens", "context": "context full", "interrupted": "interrupted"}[stats.finish_reason])
    return " · ".join(parts)


def stats_table(turns: list[Any], summary: dict[str, Any]) -> Table:
    """A Rich table of every turn so far, plus totals (for /stats)."""
    last = turns[-1].stats if turns else None
    window = (f" (streaming cache: {last.sinks} sinks + recent, at most {last.cache_capacity:,} tokens)"
              if last is not None and last.sinks and last.cache_capacity else "")  # fmt: skip
    table = Table(title=f"turns{window}", show_footer=False, caption="fed: context tokens prefilled for the turn; TTFT: time to first token; "
                  "p50/p90: ms per new token")
    # Two-line headers and unwrapped cells: the table fits an 80-column terminal whole.
    for col in ("#", "fed\ntok", "fed\ns", "TTFT\ns", "new\ntok", "tok/s", "p50\nms",
                "p90\nms", "cache", "end"):  # fmt: skip
        table.add_column(col, justify="right", no_wrap=True)
    for i, t in enumerate(turns, 1):
        s = t.stats
        table.add_row(
            str(i), f"{s.context_tokens:,}", f"{s.context_time_s:.2f}", f"{s.ttft_s:.2f}",
            f"{s.generated_tokens:,}", f"{s.decode_tps:.1f}", f"{s.ms_per_token_p50:.1f}",
            f"{s.ms_per_token_p90:.1f}", f"{s.cache_tokens:,}", safe_text(s.finish_reason),
        )
    table.add_row(
        "all", f"{summary['context_tokens']:,}", "", "", f"{summary['generated_tokens']:,}",
        f"{summary['decode_tps']:.1f}", "", "", f"{summary['cache_tokens']:,}", "", style="bold",
    )
    return table


THINK_OPEN = re.compile(r"<(think|thinking|reasoning)>")


def split_thinking(text: str) -> list[tuple[str, bool]]:
    """Cut text into (part, is_thinking) pieces; the tags stay in the thinking parts.

    A tag that is still open (the answer is streaming) makes the rest thinking.
    """
    parts: list[tuple[str, bool]] = []
    pos = 0
    while pos < len(text):
        m = THINK_OPEN.search(text, pos)
        if m is None:
            parts.append((text[pos:], False))
            break
        if m.start() > pos:
            parts.append((text[pos : m.start()], False))
        close = f"</{m.group(1)}>"
        end = text.find(close, m.end())
        end = len(text) if end < 0 else end + len(close)
        parts.append((text[m.start() : end], True))
        pos = end
    return parts


def answer_renderable(text: str) -> RenderableType:
    """Markdown with code highlighted; thinking parts dimmed (shown, not swallowed)."""
    pieces: list[RenderableType] = []
    for part, thinking in split_thinking(text):
        if thinking:
            pieces.append(Text(part.strip("\n"), style="dim italic"))
        elif part.strip():
            pieces.append(Markdown(part, code_theme="monokai"))
    return Group(*pieces) if len(pieces) != 1 else pieces[0]


def meter_style(used: int, capacity: int) -> str:
    """The context meter's colour: green, then yellow past 60 %, red past 85 %."""
    frac = used / capacity if capacity else 0.0
    return "red" if frac >= 0.85 else "yellow" if frac >= 0.6 else "green"


def sampling_brief(s: Any) -> str:
    if s.greedy:
        text = "greedy"
    else:
        text = f"temp {s.temperature:g} · top-p {s.top_p:g} · top-k {s.top_k}"
    if s.repetition_penalty != 1.0:
        text += f" · rep {s.repetition_penalty:g}"
    text += f" · max {s.max_new_tokens}"
    if s.seed is not None:
        text += f" · seed {s.seed}"
    return text


def history_renderable(turns: list[Any], system: str | None, markdown: bool = True, first: int = 1) -> RenderableType:
    """The conversation so far, for /history; turns are numbered from `first`. Every text is
    shown with its control sequences made visible (it may come from a loaded file)."""
    items: list[RenderableType] = []
    if system:
        items.append(Text.assemble(("system  ", "bold magenta"), (safe_text(system), "magenta")))
    for i, t in enumerate(turns, first):
        items.append(Text.assemble((f"[{i}] you  ", "bold cyan"), safe_text(t.user)))
        mark = "  [interrupted]" if t.interrupted else ""
        items.append(Text.assemble((f"[{i}] bot{mark}", "bold green")))
        answer = safe_text(t.answer)
        items.append(answer_renderable(answer) if markdown else Text(answer))
    if not items:
        items.append(Text("(no messages yet)", style="dim"))
    return Group(*items)


def key_value_table(title: str, rows: dict[str, str]) -> Table:
    table = Table(show_header=False, title=title)
    for k, v in rows.items():
        table.add_row(safe_text(k), safe_text(v))
    return table


class PlainAnswer:
    """Raw text as it arrives (pipes, --plain)."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out or sys.stdout
        self.text = ""

    def __enter__(self) -> PlainAnswer:
        return self

    def add(self, text: str) -> None:
        self.text += text
        self.out.write(text)
        self.out.flush()

    def __exit__(self, *exc: object) -> None:
        self.out.write("\n")
        self.out.flush()


class MarkdownAnswer:
    """Markdown re-rendered in place while tokens arrive (Rich Live).

    The Markdown is parsed when the screen refreshes (12 times a second), not per token.
    While streaming, an answer taller than the screen shows its end; when it is done the
    whole answer is printed.
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.text = ""
        self._rendered_text: str | None = None
        self._renderable: RenderableType = Text("")
        self.live = Live(console=console, refresh_per_second=12, vertical_overflow="crop",
                         get_renderable=self._get_renderable)

    def _get_renderable(self) -> RenderableType:
        text = self.text
        if text != self._rendered_text:
            self._renderable = answer_renderable(text) if text.strip() else Text("")
            self._rendered_text = text
        return self._renderable

    def __enter__(self) -> MarkdownAnswer:
        self.live.__enter__()
        return self

    def add(self, text: str) -> None:
        self.text += text

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(None, None, None)
