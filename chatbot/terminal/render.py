"""Turning engine output into text on the terminal: stats lines, tables, live answers."""

from __future__ import annotations

import sys
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.markdown import Markdown
from rich.table import Table
from rich.text import Text

from chatbot.engine.stats import TurnStats


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
    table = Table(title="turns", show_footer=False)
    for col in ("#", "context tok", "context s", "first token s", "tokens", "tok/s", "ms/tok p50", "p90", "cache", "end"):
        table.add_column(col, justify="right")
    for i, t in enumerate(turns, 1):
        s = t.stats
        table.add_row(
            str(i), f"{s.context_tokens:,}", f"{s.context_time_s:.2f}", f"{s.ttft_s:.2f}",
            f"{s.generated_tokens:,}", f"{s.decode_tps:.1f}", f"{s.ms_per_token_p50:.1f}",
            f"{s.ms_per_token_p90:.1f}", format_cache(s).removeprefix("cache "), s.finish_reason,
        )
    table.add_row(
        "all", f"{summary['context_tokens']:,}", "", "", f"{summary['generated_tokens']:,}",
        f"{summary['decode_tps']:.1f}", "", "", f"{summary['cache_tokens']:,}", "", style="bold",
    )
    return table


class PlainAnswer:
    """Raw text as it arrives (pipes, --plain)."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out or sys.stdout

    def __enter__(self) -> PlainAnswer:
        return self

    def add(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def __exit__(self, *exc: object) -> None:
        self.out.write("\n")
        self.out.flush()


class MarkdownAnswer:
    """Markdown re-rendered in place while tokens arrive (Rich Live)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.text = ""
        self.live = Live(Text(""), console=console, refresh_per_second=12, vertical_overflow="visible")

    def __enter__(self) -> MarkdownAnswer:
        self.live.__enter__()
        return self

    def add(self, text: str) -> None:
        self.text += text
        self.live.update(Markdown(self.text, code_theme="monokai"))

    def __exit__(self, *exc: object) -> None:
        self.live.update(Markdown(self.text, code_theme="monokai"))
        self.live.__exit__(None, None, None)
