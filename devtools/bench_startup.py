"""`scripts/bench-startup`: how long `chatbot run --model FILE` takes to show its prompt and
to have its model ready, against llama.cpp loading the same file.

Our side runs the real command in a pseudo-terminal (standard library only: `pty`,
`select`, `termios`), 80x24 with TERM=xterm-256color and the user's own environment (XDG
cache and all), and timestamps the raw output: the prompt prompt_toolkit draws, the banner
note "... · ready in 1.3 s ..." and, after "/quit", the process's exit. prompt_toolkit asks
the terminal where the cursor is (`ESC [6n`); we answer as a terminal does rather than set
PROMPT_TOOLKIT_NO_CPR, so that the REPL runs exactly as it does for a person (with the
variable set it skips a render path). llama.cpp's side is a fresh Python process that
builds `Llama(...)` with the settings of `chatbot bench decode` and prints the time: both
sides include Python's own start-up. The two sides take turns, after one untimed run each
(the first load of a GGUF file writes its metadata cache); the figures are medians.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import pty
import re
import select
import signal
import statistics
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chatbot.errors import ChatbotError, ConfigError
from devtools.bench_servers import CHATBOT_MAIN, last_line

TIMEOUT_S = 300.0  # to the prompt and the model ready: a cold start of a large file fits
EXIT_TIMEOUT_S = 30.0  # from "/quit" to the process gone
ROWS, COLUMNS = 24, 80
# The settings of `chatbot bench decode`'s llama.cpp worker (bench_decode._llama_cpp_worker).
LLAMA_SCRIPT = (
    "import sys, time\n"
    "from llama_cpp import Llama\n"
    "n = int(sys.argv[2])\n"
    "Llama(model_path=sys.argv[1], n_ctx=4096, n_batch=512, n_threads=n, n_threads_batch=n, verbose=False)\n"
    "print(repr(time.time()), flush=True)\n"
)
CPR_REQUEST = b"\x1b[6n"
CPR_ANSWER = b"\x1b[1;1R"  # "the cursor is at row 1, column 1", as a terminal would reply
QUIT = b"/quit\r"

# Escape sequences a terminal consumes without printing: OSC (title, hyperlinks), CSI
# (colours, cursor moves, modes), and the two-byte ones (`ESC >`, `ESC =`, `ESC ( B`).
_ESCAPES = re.compile(rb"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b\[[0-?]*[ -/]*[@-~]|\x1b[ -/]*[0-~]")
_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # all but \t \n \r
START_NOTE = "type a message"  # the REPL's note just before its first prompt
# The model banner (chatbot.cli.app.run); Rich wraps it at the width, anywhere between words.
_BANNER = re.compile(r"·\s+(?:ready|loaded)\s+in\s+\S")
# prompt_toolkit draws "> " at the start of a line; the space is often a cursor move.
_PROMPT = re.compile(r"(?:^|[\r\n])[ \t]*>")


def strip_ansi(raw: bytes) -> str:
    """The text a terminal would print for `raw`, without its escape sequences and
    control characters (line ends kept), decoded as UTF-8."""
    text = _ESCAPES.sub(b"", raw).decode("utf-8", errors="replace")
    return _CONTROLS.sub("", text)


def prompt_seen(text: str) -> bool:
    """Whether the REPL's prompt is on the screen: its start note, then on a later line the
    prompt ">" or the toolbar (whose "/help" is not the note's)."""
    start = text.find(START_NOTE)
    if start < 0:
        return False
    line_end = min((i for i in (text.find("\n", start), text.find("\r", start)) if i >= 0), default=-1)
    if line_end < 0:
        return False
    after = text[line_end:]
    return _PROMPT.search(after) is not None or "/help" in after


def banner_seen(text: str) -> bool:
    """Whether the model banner ("... · ready in 1.3 s (load 0.9 s) · ...") has been printed."""
    return _BANNER.search(text) is not None


@dataclass
class StartupWatch:
    """Reads a terminal's output as it comes and notes when the prompt and the banner first
    appeared (seconds since `t0`, the process's start)."""

    t0: float
    raw: bytearray = field(default_factory=bytearray)
    prompt_s: float | None = None
    ready_s: float | None = None
    cpr_answered: int = 0

    def feed(self, data: bytes, now: float) -> int:
        """Take `data` read at `now` (perf_counter); return how many cursor-position
        requests are waiting for an answer (one may be split between two reads)."""
        self.raw += data
        text = strip_ansi(bytes(self.raw))
        if self.prompt_s is None and prompt_seen(text):
            self.prompt_s = now - self.t0
        if self.ready_s is None and banner_seen(text):
            self.ready_s = now - self.t0
        waiting = self.raw.count(CPR_REQUEST) - self.cpr_answered
        self.cpr_answered += waiting
        return waiting

    @property
    def both_seen(self) -> bool:
        return self.prompt_s is not None and self.ready_s is not None

    def missing(self) -> str:
        """What has not appeared yet: "the prompt", "the model banner" or both."""
        pairs = (("the prompt", self.prompt_s), ("the model banner", self.ready_s))
        return " and ".join(what for what, at in pairs if at is None)

    def last_line(self) -> str:
        """The last line written, or the error chatbot ended with (wrapped between words on
        the terminal: its lines joined again)."""
        lines = [line.strip() for line in strip_ansi(bytes(self.raw)).splitlines() if line.strip()]
        start = max((i for i, line in enumerate(lines) if line.startswith("chatbot")), default=-1)
        return " ".join(lines[start:]) if start >= 0 else last_line(strip_ansi(bytes(self.raw)))


def chatbot_run_argv(model: Path | None, threads: int | None) -> list[str]:
    """`chatbot run` as the console script starts it, with this Python."""
    argv = [sys.executable, "-c", CHATBOT_MAIN, "run", "--no-stats"]
    if model is not None:
        argv += ["--model", str(model)]
    if threads:
        argv += ["--threads", str(threads)]
    return argv


def terminal_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The user's environment, as a terminal of 80x24 columns would give it."""
    out = dict(os.environ if env is None else env)
    out["TERM"] = "xterm-256color"
    for name in ("COLUMNS", "LINES"):  # the terminal's size is set on it, as a resize does
        out.pop(name, None)
    return out


def _read(fd: int, wait_s: float) -> bytes | None:
    """What the terminal has within `wait_s` (b"": nothing yet; None: it was closed)."""
    ready, _, _ = select.select([fd], [], [], max(wait_s, 0.0))
    if not ready:
        return b""
    try:
        data = os.read(fd, 65536)
    except OSError:  # EIO: every process holding the terminal is gone
        return None
    return data or None


def _exit_code(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def run_in_pty(
    argv: Sequence[str],
    env: dict[str, str] | None = None,
    *,
    timeout_s: float = TIMEOUT_S,
    exit_timeout_s: float = EXIT_TIMEOUT_S,
) -> dict[str, Any]:
    """Start `argv` in a new pseudo-terminal, wait for its prompt and model banner (in either
    order), send "/quit" and wait for it to exit.

    Returns:
        prompt_s, ready_s (from the start), exit_s (from "/quit" to the process gone),
        exit_status, order ("prompt first" or "banner first") and cpr_answered.

    Raises:
        ChatbotError: the process ended or timed out before both appeared, did not leave
            after "/quit", or left with a non-zero status; the message has its last line.
    """
    env = terminal_env(env)
    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # the child: set the size before anything reads it, then become the command
        try:
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
            os.execve(argv[0], list(argv), env)
        finally:
            os._exit(127)
    watch = StartupWatch(t0)
    quit_at: float | None = None
    exit_status: int | None = None
    try:
        deadline = t0 + timeout_s
        while True:
            now = time.perf_counter()
            if now > deadline:
                if quit_at is None:
                    raise ChatbotError(
                        f"chatbot run: no sign of {watch.missing()} within {timeout_s:.0f} s; "
                        f"its last line: {watch.last_line()}"
                    )
                raise ChatbotError(f"chatbot run did not leave within {exit_timeout_s:.0f} s of /quit")
            data = _read(fd, min(deadline - now, 0.5))
            if data is None:
                exit_status = _exit_code(pid)
                break
            if not data:
                continue
            for _ in range(watch.feed(data, time.perf_counter())):
                os.write(fd, CPR_ANSWER)
            if quit_at is None and watch.both_seen:
                os.write(fd, QUIT)
                quit_at = time.perf_counter()
                deadline = quit_at + exit_timeout_s
        ended = time.perf_counter()
    finally:
        if exit_status is None:  # stopped early: take down what we started
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        os.close(fd)
    if quit_at is None:
        raise ChatbotError(
            f"chatbot run exited (status {exit_status}) before {watch.missing()}: {watch.last_line()}"
        )
    if exit_status != 0:
        raise ChatbotError(f"chatbot run left with status {exit_status} after /quit: {watch.last_line()}")
    assert watch.prompt_s is not None and watch.ready_s is not None  # both_seen before /quit
    return {
        "prompt_s": watch.prompt_s,
        "ready_s": watch.ready_s,
        "exit_s": ended - quit_at,
        "exit_status": exit_status,
        "order": "prompt first" if watch.prompt_s <= watch.ready_s else "banner first",
        "cpr_answered": watch.cpr_answered,
    }


# --- llama.cpp -------------------------------------------------------------------------------


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_load(gguf: Path, threads: int, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Seconds from starting a fresh Python process to llama.cpp's `Llama(...)` built on
    `gguf` (the process's own clock, printed as it is done).

    Raises:
        ChatbotError: llama.cpp could not load the file (its last line), or took too long.
    """
    argv = [sys.executable, "-c", LLAMA_SCRIPT, str(gguf), str(threads)]
    started = time.time()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ChatbotError(f"llama.cpp did not load {gguf} within {timeout_s:.0f} s") from None
    stamps = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not stamps:
        raise ChatbotError(f"llama.cpp could not load {gguf}: {last_line(proc.stderr or proc.stdout)}")
    return {"load_s": float(stamps[-1]) - started}


# --- the bench -------------------------------------------------------------------------------


def check_gguf(path: Path) -> Path:
    """`path` as a GGUF file, or a one-line error."""
    if not path.exists():
        raise ConfigError(f"--model: no such file: {path}")
    if not path.is_file():
        raise ConfigError(f"--model: {path} is not a file; give a .gguf file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ConfigError(f"--model: cannot read {path}: {exc.strerror}") from None
    if magic != b"GGUF":
        raise ConfigError(f"--model: {path} is not a GGUF file (llama.cpp and this bench read GGUF files)")
    return path


def _threads(threads: int | None) -> int:
    """The thread count both sides get: --threads, or what `chatbot run` would pick now."""
    if threads:
        return min(threads, os.cpu_count() or threads)
    import torch

    from chatbot.engine.backends.native.threads import default_threads

    return default_threads(most=torch.get_num_threads())


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_startup_bench(
    model: Path | None = None,
    *,
    rounds: int = 5,
    threads: int | None = None,
    timeout_s: float = TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time `chatbot run` to its prompt and its model ready, and llama.cpp's load, `rounds`
    times each, alternating, after one untimed run of each.

    Args:
        model: the GGUF file (default: the embedded default model; `chatbot run` then runs
            without --model, as a user starts it).
        rounds: timed runs per side; figures are medians.
        threads: CPU threads for both sides (default: what `chatbot run` would pick now).
        timeout_s: the most one run may take to its prompt and banner.
        progress: told of each run as it starts.

    Returns:
        ``{"ours": {...}, "llama_cpp": {...} or None, "ratios": {...}, "first_run_s", "machine",
        "settings"}``; "ours" has the medians prompt_s, ready_s, exit_s and every run.

    Raises:
        ConfigError: the file is missing or not a GGUF file.
        ChatbotError: a run failed (its last line).
    """
    from chatbot.measure.report import cpu_model, loadavg

    if model is not None:
        gguf = check_gguf(Path(model).expanduser())
    else:
        from chatbot.models.loader import default_gguf_path

        gguf = default_gguf_path()
    n_threads = _threads(threads)
    argv = chatbot_run_argv(gguf if model is not None else None, n_threads)
    llama = llama_cpp_available()
    tell = progress or (lambda line: None)
    load_start = loadavg()
    started = time.perf_counter()

    def ours() -> dict[str, Any]:
        run = run_in_pty(argv, timeout_s=timeout_s)
        run["loadavg"] = loadavg()[0]
        return run

    def theirs() -> dict[str, Any]:
        run = llama_cpp_load(gguf, n_threads, timeout_s)
        run["loadavg"] = loadavg()[0]
        return run

    tell("untimed first run: chatbot run")
    warmup = ours()
    llama_warmup = None
    if llama:
        tell("untimed first run: llama.cpp")
        llama_warmup = theirs()
    our_runs: list[dict[str, Any]] = []
    llama_runs: list[dict[str, Any]] = []
    for n in range(rounds):
        tell(f"round {n + 1}/{rounds}: chatbot run")
        our_runs.append(ours())
        if llama:
            tell(f"round {n + 1}/{rounds}: llama.cpp")
            llama_runs.append(theirs())
    summary: dict[str, Any] = {"runs": our_runs}
    for key in ("prompt_s", "ready_s", "exit_s"):
        summary[key] = _median([r[key] for r in our_runs])
    summary["order"] = sorted({r["order"] for r in our_runs})
    llama_summary = None
    if llama:
        assert llama_warmup is not None
        llama_summary = {
            "load_s": _median([r["load_s"] for r in llama_runs]),
            "first_run_s": llama_warmup["load_s"],
            "runs": llama_runs,
        }
    llama_load = llama_summary["load_s"] if llama_summary else None
    return {
        "ours": summary,
        "first_run_s": max(warmup["prompt_s"], warmup["ready_s"]),
        "first_run": warmup,
        "llama_cpp": llama_summary,
        "llama_cpp_note": None if llama else "llama-cpp-python is not installed: ours only",
        "ratios": {
            "prompt_vs_llama_load": _ratio(summary["prompt_s"], llama_load),
            "ready_vs_llama_load": _ratio(summary["ready_s"], llama_load),
        },
        "machine": {
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": list(load_start),
            "loadavg_end": list(loadavg()),
            "python": sys.version.split()[0],
        },
        "settings": {
            "model": str(gguf),
            "default_model": model is None,
            "rounds": rounds,
            "threads": n_threads,
            "terminal": f"{COLUMNS}x{ROWS}, TERM=xterm-256color, cursor-position requests answered",
            "command": argv[:1] + ["-c", "<chatbot.cli.app:main>"] + argv[3:],
            "llama_cpp": "Llama(model_path, n_ctx=4096, n_batch=512, n_threads, verbose=False)",
            "wall_s": round(time.perf_counter() - started, 1),
        },
    }


# --- output ------------------------------------------------------------------------------------


def _s(value: float | None) -> str:
    return f"{value:.2f}" if value is not None and math.isfinite(value) else ""


def print_startup(console: Any, result: dict[str, Any]) -> None:
    """A Rich table of the medians, the ratios to llama.cpp, and the conditions."""
    from rich.table import Table

    s, m, ours = result["settings"], result["machine"], result["ours"]
    name = Path(s["model"]).name
    threads = f"{s['threads']} thread{'s' if s['threads'] != 1 else ''}"
    table = Table(title=f"start-up: {name}, {threads}, medians of {s['rounds']} rounds")
    table.add_column("", no_wrap=True)
    table.add_column("median s", justify="right", no_wrap=True)
    table.add_column("runs s", justify="right")
    table.add_column("first run s", justify="right", no_wrap=True)
    first = result["first_run"]
    rows = [
        ("chatbot run: to the prompt", ours["prompt_s"], [r["prompt_s"] for r in ours["runs"]],
         first["prompt_s"]),
        ("chatbot run: model ready (banner)", ours["ready_s"], [r["ready_s"] for r in ours["runs"]],
         first["ready_s"]),
        ("chatbot run: leaving after /quit", ours["exit_s"], [r["exit_s"] for r in ours["runs"]],
         first["exit_s"]),
    ]  # fmt: skip
    llama = result["llama_cpp"]
    if llama:
        rows.append(("llama.cpp: Llama() loaded", llama["load_s"], [r["load_s"] for r in llama["runs"]],
                     llama["first_run_s"]))  # fmt: skip
    for label, median, runs, first_s in rows:
        table.add_row(label, _s(median), " ".join(_s(x) for x in runs), _s(first_s))
    console.print(table)
    ratios = result["ratios"]
    if llama and ratios["prompt_vs_llama_load"] is not None:
        console.print(
            f"to the prompt / llama.cpp's load: {ratios['prompt_vs_llama_load']:.2f}x; "
            f"model ready / llama.cpp's load: {ratios['ready_vs_llama_load']:.2f}x",
            markup=False,
        )
    elif result.get("llama_cpp_note"):
        console.print(result["llama_cpp_note"], style="dim", markup=False)
    load = f"load average {m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f}"
    console.print(
        f"{m['cpu_model']}, {m['cpu_count']} CPUs, {load} (1 min); {threads} on both sides; "
        f"{' / '.join(ours['order'])}. Each side in a fresh process, the sides alternated, timed "
        "from its start (Python's own start-up in both): ours in an 80x24 pseudo-terminal to the "
        "first prompt drawn and to the banner '... loaded in ...'; llama.cpp to Llama(...) built. "
        "first run: the untimed warm-up (the first load of a GGUF file writes its metadata cache).",
        style="dim",
        markup=False,
    )


def main(argv: list[str] | None = None) -> None:
    """`scripts/bench-startup [--model FILE.gguf] [--rounds N] [--threads N] [--json FILE]`."""
    import argparse

    from rich.console import Console

    from chatbot.measure.report import write_json

    p = argparse.ArgumentParser(prog="scripts/bench-startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "-m", type=Path, help="the GGUF file (default: the embedded default model)")
    p.add_argument("--rounds", type=int, default=5, help="timed runs per side, alternated; medians")
    p.add_argument("--threads", type=int, help="CPU threads of both sides (default: chatbot run's choice)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args(argv)
    if a.rounds < 1:
        raise ConfigError("--rounds: at least 1")
    err = Console(stderr=True, highlight=False)
    result = run_startup_bench(
        a.model, rounds=a.rounds, threads=a.threads, progress=lambda line: err.print(f"[dim]{line}[/dim]")
    )
    print_startup(Console(), result)
    if a.json:
        write_json(a.json, result)


if __name__ == "__main__":
    from devtools import run_tool

    sys.exit(run_tool("bench-startup", main))
