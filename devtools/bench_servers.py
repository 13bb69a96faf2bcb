"""`scripts/bench-servers`: `chatbot bench load`'s comparison (client counts in turn, a short
prompt a request, one table) on servers started here in turn: chatbot serve and
llama-cpp-python's server, on the same GGUF file and threads.

Each server gets a free local port, is waited for, warmed by one answer, measured at every
client count (`--rounds` times in turn), and stopped; one that cannot start is skipped with
its reason. `--server URL` measures a running server first, as `chatbot bench load` does.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from chatbot.engine.stats import proc_status_kb
from chatbot.errors import ChatbotError, ConfigError
from chatbot.measure.bench_load import load_comparison, measure_server

SETUPS = ("chatbot", "llama.cpp")
START_TIMEOUT_S = 180.0  # importing torch on a busy 2-core machine, then the model
STOP_TIMEOUT_S = 15.0
# What decides that llama-cpp-python's server can run: its module imports (it needs the
# [server] extra), checked in a fresh process so that this one never loads libllama.
LLAMA_SERVER_CHECK = "import llama_cpp.server.app"
# What the console script (`chatbot = "chatbot.cli.app:main"` in pyproject.toml) runs: the module
# imported as itself, not as __main__ (`python -m chatbot.cli` would run it as __main__).
CHATBOT_MAIN = "import sys; from chatbot.cli.app import main; sys.argv[0] = 'chatbot'; sys.exit(main())"


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
    """The threads `chatbot serve` starts with when not told (chatbot.cli.load.set_threads): the
    physical cores less the CPUs other processes keep busy now."""
    import torch

    from chatbot.engine.backends.native.threads import default_threads

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


def run_servers_bench(
    turns: list[str],
    clients: list[int],
    setups: list[str],
    duration_s: float = 30.0,
    max_new_tokens: int = 64,
    gguf: Path | None = None,
    threads: int | None = None,
    server: str | None = None,
    api_key: str | None = None,
    progress: Callable[[str], None] | None = None,
    rounds: int = 1,
) -> dict[str, Any]:
    """Each client count in turn against `server` (when given), then against each of `setups`
    started here.

    Args:
        turns: the short prompts, one a request.
        gguf: the model file both servers load (None: the default model's).
        threads: both servers' threads (None: chatbot serve's default, and the count it
            starts with for llama.cpp, taken before either starts).
        rounds: each server runs the client counts this many times in turn (1, 4, 1, 4, ...),
            so that a change in the machine's load falls on all of them alike.

    Returns:
        `load_comparison`'s figures; each set-up's runs say its threads.

    Raises:
        ChatbotError: `server` does not answer, or no set-up could be measured.
    """
    say = progress or (lambda line: None)
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []

    def measure(setup: str, url: str, **server_options: Any) -> list[dict[str, Any]]:
        plan = (clients, turns, duration_s, max_new_tokens, say, rounds)
        return measure_server(setup, url, *plan, **server_options)

    if server is not None:
        runs += measure("server", server, api_key=api_key)
    # Taken once, before any server here runs (a later count would see our own load): llama.cpp
    # gets the count chatbot serve starts with, which then runs 1 or that many threads a step,
    # whichever measures faster.
    start_threads = threads or serve_default_threads()
    for setup in setups:
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
    return load_comparison(
        runs, skipped, clients, duration_s, max_new_tokens, rounds, server=server, model_file=gguf
    )


def main(argv: list[str] | None = None) -> None:
    """`scripts/bench-servers [--setups chatbot,llama.cpp] [--clients 1,4] [--duration S]
    [--max-new-tokens N] [--rounds N] [--gguf FILE] [--threads N] [--server URL]
    [--conversation FILE] [--json FILE]`; exits 1 when an answer failed or was cut short."""
    import argparse

    from rich.console import Console

    from chatbot.measure.bench import load_conversation
    from chatbot.measure.bench_load import print_load_comparison
    from chatbot.measure.report import parse_counts, write_json

    p = argparse.ArgumentParser(prog="scripts/bench-servers", description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default="chatbot,llama.cpp", help="servers started here, comma-separated")
    p.add_argument("--clients", default="1,4", help="concurrent streaming clients, counts measured in turn")
    p.add_argument("--duration", type=float, default=30.0, help="seconds each run keeps sending")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per answer (greedy)")
    p.add_argument("--rounds", type=int, default=1, help="the client counts this many times in turn")
    p.add_argument("--gguf", type=Path, help="the GGUF file both servers load (default: the default model's)")
    p.add_argument("--threads", type=int, help="both servers' CPU threads (default: chatbot serve's choice)")
    p.add_argument("--server", help="also measure this running server first (its API root, .../v1)")
    p.add_argument("--conversation", type=Path, help='{"turns": [...]} (default: the shipped one)')
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args(argv)
    if not 1 <= a.duration <= 3600 or a.max_new_tokens < 1 or a.rounds < 1 or (a.threads or 1) < 1:
        p.error("--duration is 1 to 3600 s; --max-new-tokens, --rounds and --threads are at least 1")
    setups = parse_setups(a.setups)
    counts = parse_counts(a.clients, "--clients", "1,4", most=64)
    if a.gguf is not None and not a.gguf.expanduser().is_file():
        raise ConfigError(f"--gguf: {a.gguf} is not a file; give a .gguf file")
    result = run_servers_bench(
        load_conversation(a.conversation),
        counts,
        setups,
        a.duration,
        a.max_new_tokens,
        gguf=None if a.gguf is None else a.gguf.expanduser(),
        threads=a.threads,
        server=a.server,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        rounds=a.rounds,
    )
    print_load_comparison(Console(), result)
    write_json(a.json, result)
    if any(r["errors"] or r["incomplete"] for r in result["runs"]):
        raise SystemExit(1)


if __name__ == "__main__":
    from devtools import run_tool

    sys.exit(run_tool("bench-servers", main))
