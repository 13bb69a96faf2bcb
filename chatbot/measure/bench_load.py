"""`chatbot bench load` across client counts and servers: 1 client, then N, against the same
server, and each server started here in turn (chatbot serve, llama-cpp-python's), one table:
aggregate tok/s, the ratio to one client, time to first token p50/p90, answers and errors.

Each request is one short user turn of the conversation, a new conversation (greedy,
`max_tokens` as given), so time to first token is a short prompt's. A server started here
gets a free local port, is waited for, warmed by one answer, measured, and stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
from rich import box
from rich.console import Console

from chatbot.engine.stats import proc_status_kb
from chatbot.errors import ChatbotError, ConfigError
from chatbot.measure.bench_http import make_client, model_of, run_load_bench, stream_once, ttft_figures
from chatbot.measure.report import conditions, loadavg, print_note, table

SETUPS = ("chatbot", "llama.cpp")
START_TIMEOUT_S = 180.0  # importing torch on a busy 2-core machine, then the model
STOP_TIMEOUT_S = 15.0
# What decides that llama-cpp-python's server can run: its module imports (it needs the
# [server] extra), checked in a fresh process so that this one never loads libllama.
LLAMA_SERVER_CHECK = "import llama_cpp.server.app"
# What the console script (`chatbot = "chatbot.cli:main"` in pyproject.toml) runs: the module
# imported as itself, not as __main__ (`python -m chatbot.cli` would run it as __main__).
CHATBOT_MAIN = "import sys; from chatbot.cli import main; sys.argv[0] = 'chatbot'; sys.exit(main())"


def last_line(text: str) -> str:
    """The last non-blank line of a process's or terminal's output (what to show when it failed)."""
    lines = [" ".join(line.split()) for line in re.split(r"[\r\n]+", text)]
    return next((line for line in reversed(lines) if line), "no output")


def parse_setups(text: str) -> list[str]:
    """Set-up names from "chatbot,llama.cpp".

    Raises:
        ConfigError: an unknown name, or none.
    """
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [n for n in names if n not in SETUPS]
    if unknown or not names:
        raise ConfigError(
            f"--setups: unknown set-up {', '.join(unknown) or repr(text)}; choose from chatbot, llama.cpp"
        )
    return names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_missing(timeout_s: float = 120.0) -> str | None:
    """Why llama-cpp-python's server cannot run here (None: it can)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", LLAMA_SERVER_CHECK],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"importing llama_cpp.server took over {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    why = last_line(proc.stderr or proc.stdout)
    return f"llama_cpp.server does not import ({why}); pip install 'llama-cpp-python[server]'"


def serve_default_threads() -> int:
    """The threads `chatbot serve` starts with when not told (cli_common.set_threads): the
    physical cores less the CPUs other processes keep busy now."""
    import torch

    from chatbot.engine.threads import default_threads

    return default_threads(most=torch.get_num_threads())


def server_argv(setup: str, gguf: Path | None, port: int, threads: int | None) -> list[str]:
    """The command line of a set-up's server on 127.0.0.1:`port` (`gguf` None: chatbot serve's
    default model; llama.cpp needs the file)."""
    if setup == "chatbot":
        flags: dict[str, Any] = {"--port": port, "--model": gguf, "--threads": threads}
        argv = [sys.executable, "-c", CHATBOT_MAIN, "serve"]
    else:
        assert setup == "llama.cpp" and gguf is not None and threads
        flags = {"--model": gguf, "--model_alias": gguf.stem, "--host": "127.0.0.1", "--port": port}
        flags.update({"--n_threads": threads, "--n_threads_batch": threads})
        # one request at a time; by default a new request cuts the stream in progress short
        flags["--interrupt_requests"] = "false"
        argv = [sys.executable, "-m", "llama_cpp.server"]
    return argv + [str(part) for flag, value in flags.items() if value for part in (flag, value)]


def proc_rss(pid: int) -> int | None:
    """A process's resident memory from /proc (None where there is none)."""
    kb = proc_status_kb("VmRSS", pid)
    return None if kb is None else kb * 1024


@contextlib.contextmanager
def started_server(
    name: str, argv: list[str], base_url: str, timeout_s: float = START_TIMEOUT_S
) -> Iterator[int]:
    """Run `argv` until its /v1/models answers, yield its process id, stop it afterwards.

    Raises:
        ChatbotError: it exited, or did not answer within `timeout_s` (with its last line).
    """
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def last() -> str:
            log.seek(0)
            return last_line(log.read())

        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise ChatbotError(f"{name} exited with {proc.returncode} while starting: {last()}")
                try:
                    if httpx.get(f"{base_url}/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ChatbotError(f"{name} did not answer within {timeout_s:.0f} s: {last()}")
                time.sleep(0.3)
            yield proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)


def _measure(
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


def run_load_comparison(
    turns: list[str],
    clients: list[int],
    duration_s: float = 30.0,
    max_new_tokens: int = 64,
    server: str | None = None,
    setups: list[str] | None = None,
    gguf: Path | None = None,
    threads: int | None = None,
    model: str | None = None,
    api_key: str | None = None,
    progress: Callable[[str], None] | None = None,
    rounds: int = 1,
) -> dict[str, Any]:
    """Each client count in turn against `server`, or against each of `setups` started here.

    Args:
        turns: the short prompts, one a request.
        gguf: the model file both servers load (None: the default model's).
        threads: both servers' threads (None: chatbot serve's default, and the count it
            starts with for llama.cpp, taken before either starts).
        rounds: each server runs the client counts this many times in turn (1, 4, 1, 4, ...),
            so that a change in the machine's load falls on all of them alike.

    Returns:
        ``{"runs": [run_load_bench's figures + setup, vs_one_client, threads], "skipped":
        [{"setup", "reason"}], ...}``.

    Raises:
        ChatbotError: `server` does not answer, or no set-up could be measured.
    """
    say = progress or (lambda line: None)
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []

    def measure(setup: str, url: str, **server_options: Any) -> list[dict[str, Any]]:
        return _measure(setup, url, clients, turns, duration_s, max_new_tokens, say, rounds, **server_options)

    if server is not None:
        runs += measure("server", server, model=model, api_key=api_key)
    # Taken once, before any server here runs (a later count would see our own load): llama.cpp
    # gets the count chatbot serve starts with, which then runs 1 or that many threads a step,
    # whichever measures faster.
    start_threads = threads or (serve_default_threads() if setups else 0)
    for setup in setups or []:
        if setup == "llama.cpp":
            why = llama_server_missing()
            if why is not None:
                skipped.append({"setup": setup, "reason": why})
                continue
        file = gguf
        if file is None and setup == "llama.cpp":
            from chatbot.models.loader import default_gguf_path

            file = default_gguf_path()
        n_threads = threads or (start_threads if setup == "llama.cpp" else None)
        threads_shown = (
            str(n_threads) if n_threads else f"default ({start_threads} at the start, 1 or that a step)"
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        say(f"{setup}: starting on port {port}")
        try:
            with started_server(setup, server_argv(setup, file, port, n_threads), url) as pid:
                measured = measure(setup, url, rss_of=lambda: proc_rss(pid))
        except ChatbotError as exc:
            skipped.append({"setup": setup, "reason": str(exc)})
            continue
        for run in measured:
            run["threads"] = threads_shown
        runs += measured
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
        "model_file": None if gguf is None else str(gguf),
        "runs": runs,
        "skipped": skipped,
        "conditions": conditions(),
        "cpu_count": os.cpu_count(),
    }


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
