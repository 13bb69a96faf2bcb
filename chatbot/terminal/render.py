"""Turning engine output into text on the terminal: stats lines, tables, live answers."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar

from markdown_it import MarkdownIt
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.markdown import CodeBlock, Markdown, MarkdownElement
from rich.measure import Measurement
from rich.padding import Padding
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from chatbot.config import UNSET_TEXT
from chatbot.conversation.chat import RemoteStats
from chatbot.engine.stats import TurnStats
from chatbot.settings import layer
from chatbot.terminal.sanitize import safe_text


def format_cache(stats: TurnStats) -> str:
    reused = f" · reused {stats.reused_tokens:,} of {stats.reused_of:,} tok" if stats.reused_of else ""
    if stats.sinks or stats.evicted_total:
        return (
            f"cache {stats.cache_tokens:,}/{(stats.cache_capacity or 0):,} · "
            f"{stats.sinks} sinks · {stats.evicted_total:,} evicted" + reused
        )
    return f"cache {stats.cache_tokens:,}" + reused


FINISH_WORDS = {"length": "max tokens", "context": "context full", "interrupted": "interrupted"}
"""How the stats line and /stats name why an answer ended (other reasons as the engine says)."""


def finish_word(reason: str) -> str:
    """The words for a finish reason (`FINISH_WORDS`), e.g. "max tokens" for "length"."""
    return FINISH_WORDS.get(reason, reason)


def format_stats_line(stats: TurnStats, width: int | None = None) -> str:
    """One line, e.g. `context 41 tok · 0.09 s · first token 0.12 s · 96 tok · 24.1 tok/s ·
    41.5 ms/tok (p90 55) · cache 412`; an answer from a server has its own line
    (`format_remote_stats_line`). With `width`, lines of at most that many characters,
    broken between the parts (never inside "41.5 ms/tok")."""
    line = format_remote_stats_line(stats) if isinstance(stats, RemoteStats) else _stats_line(stats)
    return line if width is None else wrap_parts(line.split(" · "), width)


def wrap_parts(parts: list[str], width: int) -> str:
    """`parts` joined by " · ", on as many lines of at most `width` characters as they need; a
    line breaks only between parts (its "·" ends the line), a part longer than the width
    stands alone on its line."""
    lines: list[str] = []
    line = ""
    for part in parts:
        if not line:
            line = part
        elif len(line) + 3 + len(part) + 2 <= width:  # room for " · " now and " ·" at the end
            line += " · " + part
        else:
            lines.append(line + " ·")
            line = part
    lines.append(line)
    return "\n".join(lines)


def _stats_line(stats: TurnStats) -> str:
    parts = [
        f"context {stats.context_tokens:,} tok",
        f"{stats.context_time_s:.2f} s",
        f"first token {stats.ttft_s:.2f} s",
        *thought_parts(stats),
        f"{stats.generated_tokens - stats.thinking_tokens:,} tok",
    ]
    if stats.token_latencies_s:
        parts.append(f"{stats.decode_tps:.1f} tok/s")
        parts.append(f"{stats.ms_per_token_mean:.1f} ms/tok (p90 {stats.ms_per_token_p90:.0f})")
    if stats.draft_acceptance is not None:
        parts.append(format_draft(stats))
    parts.append(format_cache(stats))
    if stats.finish_reason in FINISH_WORDS:
        parts.append(finish_word(stats.finish_reason))
    return " · ".join(parts)


def format_remote_stats_line(stats: RemoteStats) -> str:
    """The stats line of an answer from a server, e.g. `prompt 412 tok (380 cached) · first
    token 0.12 s · 96 tok · 24.1 tok/s · p50 40 / p90 55 ms/tok · server`. Without the
    server's usage the prompt is `prompt ? tok` and the answer's count (its chunks) is
    marked estimated."""
    cached = stats.cached_tokens
    estimated = stats.estimated
    if estimated:
        parts = ["prompt ? tok"]
    else:
        parts = [
            f"prompt {stats.prompt_tokens:,} tok" + (f" ({cached:,} cached)" if cached is not None else "")
        ]
    parts.append(f"first token {stats.ttft_s:.2f} s")
    parts.extend(thought_parts(stats))
    answered = stats.generated_tokens - stats.thinking_tokens
    parts.append(f"{answered:,} tok" + (" (estimated)" if estimated else ""))
    if stats.token_latencies_s:
        parts.append(f"{stats.decode_tps:.1f} tok/s")
        parts.append(f"p50 {stats.ms_per_token_p50:.0f} / p90 {stats.ms_per_token_p90:.0f} ms/tok")
    parts.append("server")
    if stats.finish_reason in ("length", "interrupted"):
        parts.append(finish_word(stats.finish_reason))
    return " · ".join(parts)


def format_draft(stats: TurnStats) -> str:
    """The share of speculative draft tokens kept (`--draft ngram`), e.g. `draft 71%`;
    "" where nothing was drafted."""
    share = stats.draft_acceptance
    return "" if share is None else f"draft {100 * share:.0f}%"


def thought_parts(stats: TurnStats) -> list[str]:
    """The stats line's thinking, apart from the answer (`thought 412 tok`, `9.8 s`); none
    where the model did not think."""
    if not stats.thinking_tokens:
        return []
    return [f"thought {stats.thinking_tokens:,} tok", f"{stats.thinking_time_s:.1f} s"]


def stats_table(turns: list[Any], summary: dict[str, Any]) -> Table:
    """A Rich table of every turn so far, plus totals (for /stats)."""
    last = turns[-1].stats if turns else None
    window = (f" (streaming cache: {last.sinks} sinks + recent, at most {last.cache_capacity:,} tokens)"
              if last is not None and last.sinks and last.cache_capacity else "")  # fmt: skip
    table = Table(
        title=f"turns{window}",
        show_footer=False,
    )
    # Two-line headers and unwrapped cells: the table fits an 80-column terminal whole.
    drafted = any(t.stats.draft_tokens for t in turns)  # a column only where drafts ran
    for col in ("#", "fed\ntok", "fed\ns", "TTFT\ns", "new\ntok", "tok/s", "p50\nms",
                "p90\nms", *(("draft",) if drafted else ()), "cache", "end"):  # fmt: skip
        # the reason ("max tokens") may take two lines, broken between its words
        table.add_column(col, justify="right", no_wrap=col != "end")
    for i, t in enumerate(turns, 1):
        s = t.stats
        draft = (format_draft(s).removeprefix("draft ") or "-",) if drafted else ()
        table.add_row(
            str(i),
            _count(s, s.context_tokens),
            _prefill_time(s),
            f"{s.ttft_s:.2f}",
            f"{s.generated_tokens:,}",
            f"{s.decode_tps:.1f}",
            f"{s.ms_per_token_p50:.1f}",
            f"{s.ms_per_token_p90:.1f}",
            *draft,
            _count(s, s.cache_tokens),
            safe_text(finish_word(s.finish_reason)),
        )
    table.add_row(
        "all", _total(summary["context_tokens"]), "", "", f"{summary['generated_tokens']:,}",
        f"{summary['decode_tps']:.1f}", "", "", *(("",) if drafted else ()),
        _total(summary["cache_tokens"]), "", style="bold",
    )  # fmt: skip
    return table


def stats_lines(turns: list[Any], summary: dict[str, Any]) -> Text:
    """/stats for a terminal too narrow for the table: a line per turn, wrapped by words."""
    text = Text()
    for i, t in enumerate(turns, 1):
        s = t.stats
        text.append(f"turn {i}", style="bold")
        text.append(
            f" · fed {_count(s, s.context_tokens)} tok · {_prefill_time(s)} s · TTFT {s.ttft_s:.2f} s · "
            f"{s.generated_tokens:,} new · {s.decode_tps:.1f} tok/s · p50 {s.ms_per_token_p50:.1f} ms · "
            f"p90 {s.ms_per_token_p90:.1f} ms · {format_draft(s) + ' · ' if s.draft_tokens else ''}"
            f"cache {_count(s, s.cache_tokens)} · "
            f"{finish_word(s.finish_reason)}\n"
        )
    text.append("all", style="bold")
    text.append(
        f" · fed {_total(summary['context_tokens'])} tok · {summary['generated_tokens']:,} new · "
        f"{summary['decode_tps']:.1f} tok/s · cache {_total(summary['cache_tokens'])}"
    )
    return text


def _count(stats: TurnStats, value: int) -> str:
    """A turn's token count; "?" where a server sent no usage (the count is unknown)."""
    return "?" if isinstance(stats, RemoteStats) and stats.estimated else f"{value:,}"


def _prefill_time(stats: TurnStats) -> str:
    """The time a turn's prefill took; "?" for a server's answer (no server reports it: its
    time to the first token, TTFT, includes it)."""
    return "?" if isinstance(stats, RemoteStats) else f"{stats.context_time_s:.2f}"


def _total(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


# What /stats's words mean, a paragraph each (wrapped as evenly as the width allows).
STATS_KEY = (
    "fed: context tokens prefilled for the turn and the time that took (all its parts, after a /continue)",
    "TTFT: time to the answer's first token; p50/p90: ms per new token",
)


def stats_renderable(console: Console, turns: list[Any], summary: dict[str, Any]) -> RenderableType:
    """The /stats table where it fits the console's width whole, else one line per turn;
    under either, what its words mean."""
    table = stats_table(turns, summary)
    key = list(STATS_KEY)
    if summary.get("thinking_tokens"):
        thought = [f"{i}: {t.stats.thinking_tokens:,} tok, {t.stats.thinking_time_s:.1f} s"
                   for i, t in enumerate(turns, 1) if t.stats.thinking_tokens]  # fmt: skip
        key.insert(0, f"thought {summary['thinking_tokens']:,} of the new tokens in "
                   f"{summary['thinking_time_s']:.1f} s (turn {'; '.join(thought)})")  # fmt: skip
    if any(isinstance(t.stats, RemoteStats) for t in turns):
        key[-1] += "; ?: not reported by the server"
    width = Measurement.get(console, console.options.update_width(10_000), table).maximum
    lines = [line for part in key for line in balanced_lines(part, min(width, console.width))]
    if width <= console.width:
        table.caption = "\n".join(lines)
        return table
    return Group(stats_lines(turns, summary), Text("\n".join(lines), style="dim"))


def columns(rows: Sequence[tuple[str, ...]], width: int) -> RenderableType:
    """Rows of aligned columns, the last one wrapped by words; on a narrow terminal (where
    the first columns would take half the width) each row's last cell goes below the rest."""
    first = max((len("  ".join(row[:-1])) for row in rows), default=0)
    if first + 2 > width // 2:
        stacked: list[RenderableType] = []
        for row in rows:
            stacked.append(Text("  ".join(row[:-1]), style="bold"))
            stacked.append(Padding(Text(row[-1]), (0, 0, 0, 4)))
        return Group(*stacked)
    grid = Table.grid(padding=(0, 2))
    for i in range(len(rows[0])):
        last = i == len(rows[0]) - 1
        grid.add_column(no_wrap=not last, overflow="fold", ratio=1 if last else None)
    for row in rows:
        grid.add_row(*row)
    return grid


def markdown_parser() -> MarkdownIt:
    """Rich's Markdown parser, with raw HTML off: a model's `<placeholder>` or `<br>` is text
    to show, not markup for Rich to drop."""
    return MarkdownIt("commonmark", {"html": False}).enable("strikethrough").enable("table")


CODE_THEME = "monokai"


def code_block(code: str, lexer: str, padding: tuple[int, int, int, int] = (1, 0, 1, 0)) -> Syntax:
    """A code block as every view shows it (the streamed answer, /history): highlighted,
    from column 0 (no side padding, so copied lines keep their own indent), a line longer
    than the width wrapped between words (a word longer than the width alone is cut).
    `padding`: blank rows above and below, as (top, 0, bottom, 0)."""
    return Syntax(code, lexer or "text", theme=CODE_THEME, word_wrap=True, padding=padding)


class _AnswerCodeBlock(CodeBlock):
    """Rich's code block drawn by `code_block`, as the streamed answer draws it."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield code_block(str(self.text).rstrip(), self.lexer_name)


class AnswerMarkdown(Markdown):
    """Rich Markdown that shows everything the model wrote (see `markdown_parser`), its code
    blocks as the streamed answer shows them (`code_block`)."""

    elements: ClassVar[dict[str, type[MarkdownElement]]] = {
        **Markdown.elements,
        "fence": _AnswerCodeBlock,
        "code_block": _AnswerCodeBlock,
    }

    def __init__(self, markup: str, code_theme: str = CODE_THEME) -> None:
        super().__init__("", code_theme=code_theme)  # parsed below, once (the live answer's cost)
        self.markup = markup
        self.parsed = markdown_parser().parse(markup)


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
            pieces.append(AnswerMarkdown(part))
    return Group(*pieces) if len(pieces) != 1 else pieces[0]


def meter_style(used: int, capacity: int) -> str:
    """The context meter's colour: green, then yellow past 60 %, red past 85 %."""
    frac = used / capacity if capacity else 0.0
    return "red" if frac >= 0.85 else "yellow" if frac >= 0.6 else "green"


def sampling_brief(s: Any) -> str:
    """The settings in a few words (the toolbar, /model); those left to a server
    (`SamplingConfig.unset`) are not shown as numbers."""
    given = s.given()
    parts = ["greedy"] if s.greedy else []
    for row in layer("sampling"):
        value = given.get(row.name)
        if row.brief is None or value is None or value == row.brief_off or (row.brief_sampled and s.greedy):
            continue
        parts.append(row.brief.format(value))
    if s.unset - {"seed"}:
        parts.append(f"others: the {UNSET_TEXT}s" if parts else f"the {UNSET_TEXT}s")
    return " · ".join(parts)


def history_renderable(
    turns: list[Any], system: str | None, markdown: bool = True, first: int = 1
) -> RenderableType:
    """The conversation so far, for /history; turns are numbered from `first`. Every text is
    shown with its control sequences made visible (it may come from a loaded file)."""
    items: list[RenderableType] = []
    if system:
        items.append(Text.assemble(("system  ", "bold magenta"), (safe_text(system), "magenta")))
    for i, t in enumerate(turns, first):
        items.append(Text.assemble((f"[{i}] you  ", "bold cyan"), safe_text(t.user)))
        if t.interrupted and not t.answer:
            # Ctrl-C while the model read the message (or a killed run): no answer; /retry gives one
            items.append(Text.assemble((f"[{i}] bot  [not answered: interrupted]", "bold green")))
            continue
        mark = "  [interrupted]" if t.interrupted else ""
        items.append(Text.assemble((f"[{i}] bot{mark}", "bold green")))
        answer = safe_text(t.answer)
        items.append(answer_renderable(answer) if markdown else Text(answer))
    if not items:
        items.append(Text("(no messages yet)", style="dim"))
    return Group(*items)


_NUMBER = re.compile(r"[\d][\d.,]*")


def wrap_words(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` cells, broken between words. A number stays with
    the word after it (its unit: "92 MB", "8,192 tokens"); only a word longer than a line (a
    path) is folded, on lines of its own, after its last "/" that fits (anywhere, where none does)."""
    width = max(width, 8)
    units: list[str] = []
    for word in text.split():
        if units and _NUMBER.fullmatch(units[-1]):
            units[-1] += " " + word
        else:
            units.append(word)
    lines: list[str] = []
    line = ""
    for unit in units:
        joined = f"{line} {unit}" if line else unit
        if cell_len(joined) <= width:
            line = joined
            continue
        if line:
            lines.append(line)
        while cell_len(unit) > width:
            cut = next(i for i in range(len(unit), 0, -1) if cell_len(unit[:i]) <= width)
            slash = unit.rfind("/", 0, cut)
            cut = slash + 1 if slash > 0 else cut
            lines.append(unit[:cut])
            unit = unit[cut:]
        line = unit
    if line:
        lines.append(line)
    return lines


def balanced_lines(text: str, width: int) -> list[str]:
    """`wrap_words` in as many lines as at `width`, but as even as they can be: no last line
    of a word or two under long ones."""
    lines = wrap_words(text, width)
    while width > 8 and len(narrower := wrap_words(text, width - 1)) == len(lines):
        lines, width = narrower, width - 1
    return lines


class KeyValueTable:
    """Keys and values in a box as wide as the console allows; a value is wrapped between
    words (`wrap_words`) to the room its column has."""

    def __init__(self, title: str, rows: dict[str, str]) -> None:
        self.title = title
        self.rows = [(safe_text(k), safe_text(v)) for k, v in rows.items()]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        key_width = max((cell_len(k) for k, _ in self.rows), default=0)
        room = options.max_width - key_width - 7  # "│ key │ value │"
        table = Table(show_header=False, title=self.title)
        table.add_column(no_wrap=True)
        table.add_column(overflow="fold")  # a console narrower than a key: Rich's fold at least
        for k, v in self.rows:
            table.add_row(Text(k), Text("\n".join(wrap_words(v, room))))
        yield table


def key_value_table(title: str, rows: dict[str, str]) -> KeyValueTable:
    """Keys and values for /model and /cache (see `KeyValueTable`)."""
    return KeyValueTable(title, rows)


def toolbar_line(session: Any, model_name: str, loading_name: str, width: int) -> Any:
    """The line under the prompt, as prompt_toolkit's (style, text) pairs: while the model
    loads (`session` None), what the load waits for; then the model, the cache meter and the
    sampling in brief. On a narrow terminal the less useful parts go first, so that it is
    never cut (the meter stays). Names come from files and servers: their control characters
    are shown, not sent (`safe_line`), as everywhere else."""
    from chatbot import progress
    from chatbot.terminal.sanitize import safe_line

    if session is None:
        what, name = safe_line(progress.current() or ""), safe_line(loading_name)
        lines = [f" loading {name}: {what}… · /help", f" loading: {what}… · /help"]
        line = next((t for t in lines if len(t) < width), lines[-1]) if what else f" loading {name}… · /help"
        return [("", line if len(line) < width else line[: width - 2] + "…")]
    gauge = session.meter()
    model = safe_line(f"{model_name} {gauge.where}".strip())
    used, cap = gauge.used, gauge.capacity
    if used is None:
        meter = ("", f"{gauge.label} ? tok")
    elif not cap:
        meter = ("", f"{gauge.label} {used:,} tok")
    else:
        colour = {"green": "ansigreen", "yellow": "ansiyellow", "red": "ansired"}[meter_style(used, cap)]
        meter = (f"bold {colour}", f"{gauge.label} {used:,}/{cap:,}")
    parts: list[tuple[str, str]] = []
    for name, tail in ((model, sampling_brief(session.sampling)), (model, ""), ("", "")):
        parts = [("", f" {name} · " if name else " "), meter]
        parts.append(("", f" · {tail} · /help" if tail else " · /help"))
        if sum(len(part[1]) for part in parts) < width:
            break
    return parts
