"""Printing and saving benchmark figures (Rich tables, JSON)."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from chatbot.doctor import cpu_model
from chatbot.errors import ConfigError


def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15-minute load averages (zeros where the OS has none)."""
    if not hasattr(os, "getloadavg"):
        return (0.0, 0.0, 0.0)
    one, five, fifteen = os.getloadavg()
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def conditions() -> str:
    """What every printed figure is measured beside: the CPU and the load average now."""
    one, five, fifteen = loadavg()
    return (
        f"{cpu_model()}, {os.cpu_count()} CPUs, "
        f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min)"
    )


def machine_info() -> dict[str, Any]:
    """The platform, CPU, load, threads and torch build the figures were taken on."""
    import torch  # here: the HTTP benches print conditions without loading torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "loadavg": list(loadavg()),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    """`result` with the machine's description, as JSON at `path` (None: nothing is written)."""
    if path is None:
        return
    data = dict(result)
    data.setdefault("machine", machine_info())
    Path(path).write_text(json.dumps(data, indent=1))


def table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], left: int = 0, **options: Any
) -> Table:
    """A Rich table of `rows` under `columns`, right-aligned but for the first `left` columns.

    Args:
        options: more of `rich.table.Table`'s settings (box, padding, show_header...).
    """
    out = Table(title=title, **options)
    for i, col in enumerate(columns):
        out.add_column(col, justify="left" if i < left else "right")
    for row in rows:
        out.add_row(*row)
    return out


def print_note(console: Console, text: str) -> None:
    """A line in dim type, as it is (no markup): the conditions and legends under a table."""
    console.print(text, style="dim", markup=False)


def print_turns(console: Console, result: dict[str, Any]) -> None:
    """`chatbot bench turns`: the persistent cache against re-encoding, per turn."""

    def row(turn: dict[str, Any]) -> list[str]:
        p, r = turn["persistent"], turn["reencode"]
        ratio = r["ttft_s"] / p["ttft_s"] if p["ttft_s"] else float("nan")
        load = f"{(p['loadavg'] + r['loadavg']) / 2:.2f}" if "loadavg" in p and "loadavg" in r else ""
        prefill = [
            f"{p['prefill_tokens']:,}",
            f"{p['ttft_s']:.3f}",
            f"{r['prefill_tokens']:,}",
            f"{r['ttft_s']:.3f}",
        ]
        return [str(turn["turn"]), *prefill, f"{ratio:.1f}x", load]

    modes = ("persistent", "re-encode")
    columns = ["turn", *(f"{what} ({mode})" for mode in modes for what in ("prefill tok", "first token s"))]
    title = (
        f"multi-turn chat, {result['model']}, greedy, {result['max_new_tokens']} new tokens per turn, "
        f"medians of {result.get('repeats', 1)} plays"
    )
    console.print(table(title, [*columns, "ratio", "load avg"], map(row, result["turns"])))
    console.print(
        f"last turn: time to first token {result['ratio_last_turn']:.1f}x faster with the persistent cache; "
        f"{result['prefill_ratio_last_turn']:.1f}x fewer tokens prefilled"
    )
    print_note(
        console,
        f"{result.get('conditions') or conditions()}; load avg: the 1-minute load average after "
        "each turn (median over the plays)",
    )


def print_resume(console: Console, result: dict[str, Any]) -> None:
    """`chatbot bench resume`: a chat resumed from its disk cache against re-encoding it."""
    rows = [
        [label, f"{result[mode]['encoded_tokens']:,}", f"{result[mode]['first_token_s']:.3f}"]
        for label, mode in (("from the disk cache", "disk"), ("re-encoded", "reencode"))
    ]
    window = " (--enable-streaming)" if result.get("streaming") else ""
    title = (
        f"--resume of a chat of {result['history_tokens']:,} tokens{window}, {result['model']}, "
        f"medians of {result['repeats']}"
    )
    console.print(table(title, ["history", "tokens encoded", "to first token s"], rows, left=1))
    ratio = result.get("ratio")
    console.print(
        (f"{ratio:.1f}x sooner from the disk cache; " if ratio else "")
        + f"the file: {result['file_bytes'] / 1e6:,.1f} MB, {result['bytes_per_1k_tokens'] / 1e6:,.2f} MB "
        "per 1,000 tokens"
    )
    print_note(
        console,
        f"{result.get('conditions') or conditions()}; to first token: from the start of the restore "
        "to the next answer's first token (the model's load not counted)",
    )


def parse_counts(text: str, option: str, example: str, most: int | None = None, what: str = "") -> list[int]:
    """Counts from "8" or "1,4" (each at least 1 and at most `most`; in the order given, without
    repeats), for the command-line option `option`.

    Raises:
        ConfigError: not such a list (the message names `what` is expected, and an `example`).
    """
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or not all(1 <= n <= (most or n) for n in counts):
        within = f"from 1 to {most}" if most else "of 1 or more"
        raise ConfigError(
            f"{option}: expected {what or 'a count or counts'} {within} like {example}, not {text!r}"
        )
    return list(dict.fromkeys(counts))


def read_text(path: Path) -> str:
    """A text file for a benchmark, with a clear error when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def print_streaming(console: Console, result: dict[str, Any]) -> None:
    """`chatbot bench streaming`: a table per window size, a row per mark."""
    columns = ["window passed", "tokens passed", "decode tok/s", "cache tokens", "cache MB"]
    columns += ["recompute tok/s", "speed-up", "load avg"]
    for run in result["runs"]:
        opt = f", --opt {result['opt']}" if "opt" in result else ""
        window = f"{run['recent_size']} recent (window {run['window']}){opt}"
        title = f"{result['model']}: {result['start_size']} sinks + {window}"
        rows = [
            [
                f"{m['multiple']}x",
                f"{m['tokens_passed']:,}",
                f"{m['decode_tps']:.1f}",
                f"{m['cache_tokens']:,}",
                f"{m['cache_bytes'] / 1e6:.1f}",
                f"{m['recompute_tps']:.2f}",
                f"{m['decode_tps'] / m['recompute_tps']:.1f}x",
                f"{m['loadavg']:.2f}" if "loadavg" in m else "",
            ]
            for m in run["marks"]
        ]
        console.print(table(title, columns, rows))
        console.print(
            f"at {run['marks'][-1]['multiple']}x the window: {run['speedup_vs_recompute']:.1f}x faster "
            "than sliding window with recomputation"
        )
    print_note(console, f"{conditions()}; load avg: the 1-minute load average at each mark")


def print_http_turns(console: Console, result: dict[str, Any]) -> None:
    """`chatbot bench turns --server`: the server's prefix cache against no cache, per turn."""

    def row(turn: dict[str, Any]) -> list[str]:
        c, u = turn["prefix_cache"], turn["no_cache"]
        ratio = u["ttft_s"] / c["ttft_s"] if c["ttft_s"] else float("nan")
        tokens = ["-" if c[k] is None else f"{c[k]:,}" for k in ("prompt_tokens", "cached_tokens")]
        load = f"{c['loadavg']:.2f}" if c.get("loadavg") is not None else ""
        return [str(turn["turn"]), *tokens, f"{c['ttft_s']:.3f}", f"{u['ttft_s']:.3f}", f"{ratio:.1f}x", load]

    title = (
        f"multi-turn chat through HTTP, {result['model']} at {result['server']}, greedy, "
        f"{result['max_new_tokens']} new tokens per turn"
    )
    columns = ["turn", "prompt tok", "cached tok", "first token s (prefix cache)", "first token s (no cache)"]
    console.print(table(title, [*columns, "ratio", "load avg"], map(row, result["turns"])))
    console.print(
        f"last turn: time to first token {result['ratio_last_turn']:.1f}x faster with the prefix cache; "
        f"{result['same_answers']}/{len(result['turns'])} answers identical with and without it"
    )
    print_note(
        console, f"{result.get('conditions') or conditions()} (this machine's; the server's if it runs here)"
    )


def print_load(console: Console, result: dict[str, Any]) -> None:
    """`chatbot bench load`: answers, errors, time to first token, server memory."""

    def mb(v: Any) -> str:
        return "-" if v is None else f"{v / 2**20:,.0f} MiB"

    rows = {
        "answers complete": f"{result['complete']:,}",
        "answers incomplete": f"{result['incomplete']:,}",
        "errors": f"{result['errors']:,}",
        "time to first token p50 / p99": f"{result['ttft_p50_s']:.2f} s / {result['ttft_p99_s']:.2f} s",
        "tokens generated": f"{result['tokens']:,} ({result['tokens_per_s']:.1f} tok/s over all clients)",
        "server RSS start / after 1/4 / end": " / ".join(
            mb(result[k]) for k in ("rss_start_bytes", "rss_quarter_bytes", "rss_end_bytes")
        ),
        "CPU and load (this machine)": result.get("conditions") or conditions(),
    }
    title = f"{result['clients']} streaming clients for {result['duration_s']:.0f} s, {result['model']} at "
    title += result["server"]
    console.print(table(title, ["", ""], rows.items(), left=2, show_header=False))
    for line in result.get("error_samples", []):
        console.print(f"error: {line}", markup=False)
