"""`chatbot bench load` across client counts: 1 client, then N, against the same server, one
table: aggregate tok/s, the ratio to one client, time to first token p50/p90, answers and
errors (`scripts/bench-servers` makes the same table of servers it starts).

Each request is one short user turn of the conversation, a new conversation (greedy,
`max_tokens` as given), so time to first token is a short prompt's.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from rich import box
from rich.console import Console

from chatbot.errors import ChatbotError
from chatbot.measure.bench_http import make_client, model_of, run_load_bench, stream_once, ttft_figures
from chatbot.measure.report import conditions, loadavg, print_note, table


def measure_server(
    setup: str,
    base_url: str,
    clients: list[int],
    turns: list[str],
    duration_s: float,
    max_new_tokens: int,
    progress: Callable[[str], None],
    rounds: int,
    model: str | None = None,
    api_key: str | None = None,
    rss_of: Callable[[], int | None] | None = None,
) -> list[dict[str, Any]]:
    """One untimed answer, then a load run per client count on the server at `base_url`,
    all the counts `rounds` times in turn; each count's runs pooled into one (`pooled`)."""
    client = make_client(base_url, api_key, timeout=120.0)
    model = model_of(client, model)
    try:
        stream_once(client, model, [{"role": "user", "content": turns[0]}], 4)
    except (openai.OpenAIError, OSError, httpx.HTTPError) as exc:
        raise ChatbotError(
            f"{setup}: the first (untimed) answer failed: {type(exc).__name__}: {exc}"
        ) from None
    by_count: dict[int, list[dict[str, Any]]] = {n: [] for n in clients}
    for i, n in ((i, n) for i in range(rounds) for n in clients):
        label = f"{setup}, {n} client{'s' * (n > 1)}" + (f", round {i + 1}/{rounds}" if rounds > 1 else "")
        progress(f"{label} for {duration_s:g} s")

        def say(line: str, label: str = label) -> None:
            progress(f"{label}: {line}")

        run = run_load_bench(
            base_url,
            turns,
            n,
            duration_s,
            max_new_tokens,
            model,
            api_key,
            progress=say,
            single_turn=True,
            rss_of=rss_of,
        )
        run["loadavg_end"] = loadavg()[0]
        by_count[n].append(run)
    runs = [{"setup": setup, **pooled(by_count[n])} for n in clients]
    one = next((r["tokens_per_s"] for r in runs if r["clients"] == 1), None)
    ones = next((r["tokens_per_s_rounds"] for r in runs if r["clients"] == 1), None)
    for run in runs:
        run["vs_one_client"] = run["tokens_per_s"] / one if one and run["clients"] != 1 else None
        run["vs_one_client_rounds"] = (
            [n / o if o else None for n, o in zip(run["tokens_per_s_rounds"], ones)]
            if ones and run["clients"] != 1
            else None
        )
    return runs


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one client count as one: counts and times summed (tok/s is all their tokens over
    all their time), time to first token over all their answers, the highest RSS, the mean
    load average at their ends; each run's tok/s kept in `tokens_per_s_rounds`."""
    first = runs[0]
    ttfts = [t for r in runs for t in r["ttfts_s"]]
    elapsed = sum(r["elapsed_s"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    steps = [r["batch_steps"] for r in runs if r.get("batch_steps") is not None]
    rows = [r["batch_rows"] for r in runs if r.get("batch_rows") is not None]
    rss = [r["rss_max_bytes"] for r in runs if r.get("rss_max_bytes") is not None]
    return {
        **{
            k: first[k] for k in ("server", "model", "clients", "duration_s", "max_new_tokens", "single_turn")
        },
        "rounds": len(runs),
        **{
            k: sum(r[k] for r in runs)
            for k in ("complete", "incomplete", "errors", "tokens", "tokens_counted_as_chunks")
        },
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "tokens_per_s_rounds": [r["tokens_per_s"] for r in runs],
        **ttft_figures(ttfts),
        "batch_rows_per_step": sum(rows) / sum(steps) if steps and sum(steps) else None,
        "rss_max_bytes": max(rss) if rss else None,
        "loadavg_end": statistics.fmean(r["loadavg_end"] for r in runs),
        "loadavg_ends": [r["loadavg_end"] for r in runs],
        "error_samples": [line for r in runs for line in r["error_samples"]][:5],
    }


def load_comparison(
    runs: list[dict[str, Any]],
    skipped: list[dict[str, str]],
    clients: list[int],
    duration_s: float,
    max_new_tokens: int,
    rounds: int,
    server: str | None = None,
    model_file: Path | None = None,
) -> dict[str, Any]:
    """The servers' runs (`measure_server`'s) and the set-ups skipped (``{"setup", "reason"}``)
    as one comparison, the figures `print_load_comparison` prints.

    Raises:
        ChatbotError: no set-up was measured.
    """
    if not runs:
        raise ChatbotError(
            "no set-up was measured: " + "; ".join(f"{s['setup']}: {s['reason']}" for s in skipped)
        )
    return {
        "clients": clients,
        "duration_s": duration_s,
        "rounds": rounds,
        "max_new_tokens": max_new_tokens,
        "server": server,
        "model_file": None if model_file is None else str(model_file),
        "runs": runs,
        "skipped": skipped,
        "conditions": conditions(),
        "cpu_count": os.cpu_count(),
    }


def run_load_comparison(
    server: str,
    turns: list[str],
    clients: list[int],
    duration_s: float = 30.0,
    max_new_tokens: int = 64,
    model: str | None = None,
    api_key: str | None = None,
    progress: Callable[[str], None] | None = None,
    rounds: int = 1,
) -> dict[str, Any]:
    """Each client count in turn against `server`, `rounds` times (1, 4, 1, 4, ...), so that a
    change in the machine's load falls on every count alike.

    Args:
        turns: the short prompts, one a request.

    Returns:
        `load_comparison`'s figures.

    Raises:
        ChatbotError: `server` does not answer.
    """
    say = progress or (lambda line: None)
    plan = (clients, turns, duration_s, max_new_tokens, say, rounds)
    runs = measure_server("server", server, *plan, model=model, api_key=api_key)
    return load_comparison(runs, [], clients, duration_s, max_new_tokens, rounds, server=server)


def print_load_comparison(console: Console, result: dict[str, Any]) -> None:
    """The runs side by side: a row per set-up and client count (fits 80 columns)."""
    runs = result["runs"]
    n_rounds = result.get("rounds", 1)
    rounds = f" x {n_rounds} rounds in turn, pooled" if n_rounds > 1 else ""
    title = (
        f"{', '.join(sorted({r['model'] for r in runs}))}: streaming clients at once, "
        f"{result['duration_s']:g} s a run{rounds}, greedy, {result['max_new_tokens']} new tokens, "
        "a short prompt a request"
    )
    columns = ["setup", "clients", "answers", "errors", "tok/s", "vs 1", "TTFT\np50 s", "TTFT\np90 s"]

    def row(r: dict[str, Any]) -> list[str]:
        ratio, rss, batch = r.get("vs_one_client"), r.get("rss_max_bytes"), r.get("batch_rows_per_step")
        return [
            r["setup"],
            str(r["clients"]),
            f"{r['complete']:,}",
            f"{r['errors']:,}",
            f"{r['tokens_per_s']:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            f"{r['ttft_p50_s']:.2f}",
            f"{r['ttft_p90_s']:.2f}",
            "-" if batch is None else f"{batch:.2f}",
            "-" if rss is None else f"{rss / 2**20:,.0f}",
            f"{r['loadavg_end']:.2f}",
        ]

    console.print(
        table(
            title,
            [*columns, "batch", "RSS\nMiB", "load"],
            map(row, runs),
            left=1,
            box=box.SIMPLE_HEAD,
            padding=(0, 0),
        )
    )
    for r in runs:
        if r.get("vs_one_client") is not None:
            each = [f"{x:.2f}x" for x in r.get("vs_one_client_rounds") or [] if x is not None]
            console.print(
                f"{r['setup']}: {r['clients']} clients {r['vs_one_client']:.2f}x the tok/s of 1 client"
                + (f" (by round: {', '.join(each)})" if n_rounds > 1 else "")
                + f", first token p90 {r['ttft_p90_s']:.2f} s",
                markup=False,
            )
    for r in runs:
        if r["incomplete"]:
            console.print(
                f"{r['setup']}, {r['clients']} clients: {r['incomplete']} answers cut short "
                "(no text, or no finish reason)",
                markup=False,
            )
    for s in result["skipped"]:
        console.print(f"{s['setup']}: skipped: {s['reason']}", markup=False)
    threads = {r["setup"]: r["threads"] for r in runs if "threads" in r}
    counted = sorted({r["setup"] for r in runs if r.get("tokens_counted_as_chunks")})
    notes = [
        "tok/s: all the clients' answer tokens over the run's time, to its last answer",
        "vs 1: against 1 client",
        "TTFT: time to first token",
        "batch: mean requests in chatbot serve's batched decode steps",
        "load: 1-minute load average at the run's end" + (" (mean of the rounds)" if n_rounds > 1 else ""),
    ]
    if any(r["setup"] == "server" for r in runs):
        notes.append(f"server: {result['server']}")
    if threads:
        notes.append("threads: " + ", ".join(f"{k} {v}" for k, v in threads.items()))
    if counted:
        notes.append(f"{', '.join(counted)}: no usage streamed, a token counted per chunk of text")
    print_note(console, f"{'; '.join(notes)}. {result['conditions']}")
    for r in runs:
        for line in r.get("error_samples", []):
            console.print(f"{r['setup']}: error: {line}", markup=False)
