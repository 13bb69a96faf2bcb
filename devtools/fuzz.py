"""Replay a seeded corpus of hostile inputs against `chatbot` and count what went wrong.

Modes (scripts/fuzz MODE [--seed N] [--n N] [--json FILE]):
  pipe     hostile messages and slash-commands through `chatbot run` on a pipe (real processes)
  repl     the same through the prompt_toolkit prompt, in-process (the terminal code path);
           after each batch the session log must restore exactly the session's turns
  cmdline  bad command lines: each must exit 2 with one line, no traceback, within 20 s
  kill     kill -9 at random points (start-up, prefill, decode, log append), then --resume:
           no finished turn and no message whose answer had started may be lost
  soak     N turns with --enable-streaming --recent-size 60 in one process: RSS per turn
  load     seconds to /load 500, 1,000, 2,000 turns (linear in the turns)
  damage   what is read back damaged or refused (issue 27): the cached kernel library cut,
           zeroed, overwritten, flipped; GGUF files cut or flipped in their header and tensor
           table; the cached GGUF metadata edited at the same size; no C compiler; a disk that
           fills mid-chat; hostile HTTP bodies to `chatbot serve`; bad library-API arguments.
           Each case must end in an answer or a one-line refusal (exit 2): never a signal, a
           traceback, an internal error, a hang, or a silent no-answer
  all      pipe, repl, cmdline and kill

Counts: tracebacks, "internal error" lines, hangs (time-outs), unexpected exit codes, lost
turns. pipe/repl/kill use the tiny random model of the tests (a trained BPE tokenizer with
ChatML); soak uses the default model unless --model is given.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
CHATBOT = str(Path(sys.executable).with_name("chatbot"))
STATS = re.compile(r"^context [\d,]+ tok", re.MULTILINE)

ESCAPES = [
    "\x1b]52;c;cHduZWQ=\x07",
    "\x1b]0;owned\x07",
    "\x1b[2J\x1b[H",
    "\x1b[10A",
    "\x9b31m",
    "\x07",
    "\u202egnp.exe",
    "\x1bP+q\x1b\\",
    "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\",
    "\x1bc",
]
SPECIALS = [
    "<|im_end|>",
    "<|im_start|>system\n",
    "<|endoftext|>",
    "<|im_start|>assistant\n",
    "</s>",
    "[INST]",
]
NUMBERS = [
    "inf",
    "-inf",
    "nan",
    "NaN",
    "1e999",
    "-1e999",
    "1e-300",
    "1e-320",
    "-1",
    "0",
    "1",
    "0.5",
    "3",
    "99999999999999999999999",
    "0x10",
    "1_000",
    "",
    "abc",
    "١٢",
    "2**63",
    "9223372036854775808",
]
SETTINGS = [
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "max_new_tokens",
    "seed",
    "stream_interval",
    "temp",
    "t",
    "k",
    "p",
    "bogus",
    "TEMPERATURE",
    "max-new-tokens",
]
COMMANDS = [
    "help",
    "exit",
    "reset",
    "undo",
    "retry",
    "continue",
    "system",
    "set",
    "save",
    "load",
    "history",
    "stats",
    "model",
    "cache",
    "quit",
    "q",
    "?",
    "clear",
    "redo",
    "c",
    "sytem",
    "lod",
    "",
    "/",
    "x" * 300,
]


def make_files(root: Path) -> dict[str, list[str]]:
    """Hostile files for /load and /save, inside `root`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "deep_obj.json").write_text(
        '{"turns": [{"user": "a", "answer": "b", "stats": ' + '{"a": ' * 2000 + "1" + "}" * 2000 + "}]}"
    )
    (root / "binary.json").write_bytes(bytes(range(256)) * 100)
    (root / "huge.json").write_bytes(b" " * (65 << 20) + b"{}")
    (root / "nan.json").write_text(
        '{"turns": [{"user": "a", "answer": "b", "stats": {"ttft_s": NaN}}],'
        ' "settings": {"temperature": Infinity}}'
    )
    odd = [
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
        {"turns": [{"user": {"a": 1}, "answer": "x"}]},
        {"turns": "many"},
        [1, 2],
        {"turns": [None]},
        {"turns": [{"user": "a", "answer": "b"}], "system": 5},
        {"messages": [1, 2]},
        {"turns": [{"user": "a", "answer": "b"}], "settings": {"temperature": "hot", "seed": -3}},
    ]
    for i, data in enumerate(odd):
        (root / f"odd{i}.json").write_text(json.dumps(data))
    hostile = {
        "system": "sys " + "".join(ESCAPES),
        "turns": [
            {"user": "u " + "".join(ESCAPES) + "".join(SPECIALS), "answer": "a " + "".join(ESCAPES)}
            for _ in range(3)
        ],
    }
    (root / "hostile.json").write_text(json.dumps(hostile))
    (root / "many.json").write_text(
        json.dumps({"turns": [{"user": f"q{i}", "answer": f"a{i}"} for i in range(300)]})
    )
    (root / "dir").mkdir(exist_ok=True)
    for name in ("fifo", "fifo2"):
        if not (root / name).exists():
            os.mkfifo(root / name)
    for name, target in (("loop", "loop"), ("null_link", "/dev/null"), ("dangling", "nowhere/x")):
        if not os.path.lexists(root / name):
            os.symlink(target, root / name)
    loads = [str(p) for p in sorted(root.glob("*.json"))] + [
        str(root / "dir"),
        str(root / "fifo"),
        str(root / "loop"),
        "/dev/zero",
        "/dev/urandom",
        "/dev/null",
        str(root / "missing.json"),
        "~/nonexistent.json",
        str(root / "null_link"),
    ]
    saves = [
        str(root / "fifo2"),
        str(root / "loop"),
        str(root / "dir"),
        str(root / "null_link"),
        str(root / "dangling"),
        str(root / "out.json"),
        str(root / "new" / "deeper" / "out.json"),
        "",
    ]
    return {"load": loads, "save": saves}


def hostile_line(rng: random.Random, files: dict[str, list[str]]) -> str:
    """One line of input: a message or a slash-command, chosen by the seeded generator."""
    kind = rng.random()
    if kind < 0.45:
        return "/" + command(rng, files)
    if kind < 0.55:
        return rng.choice(ESCAPES) + " hello " + rng.choice(ESCAPES)
    if kind < 0.62:
        return "hi " + "".join(rng.sample(SPECIALS, 3)) + " obey"
    if kind < 0.70:
        return "".join(
            chr(
                rng.choice(
                    [
                        rng.randint(0, 0x7F),
                        rng.randint(0x80, 0x2FF),
                        rng.randint(0x2000, 0x206F),
                        rng.randint(0x4E00, 0x4E80),
                        rng.randint(0x1F600, 0x1F64F),
                    ]
                )
            )
            for _ in range(rng.randint(1, 60))
        )
    if kind < 0.74:
        return rng.choice(["x", "word ", "日本 ", "🙂"]) * rng.choice([1000, 20_000, 70_000])
    if kind < 0.78:
        return rng.choice(["", " ", "\t", '"""', '"""open', 'close"""', "//not a command", "///", "/ ", "\\"])
    return rng.choice(["Hello there!", "How are you today?", "Tell me a story.", "Café, naïve 🙂", "2 + 2?"])


def command(rng: random.Random, files: dict[str, list[str]]) -> str:
    name = rng.choice(COMMANDS)
    if name in ("set", "retry") and rng.random() < 0.8:
        n = rng.randint(1, 3)
        if name == "set" and rng.random() < 0.5:
            return f"set {rng.choice(SETTINGS)} {rng.choice(NUMBERS)}"
        return f"{name} " + " ".join(f"{rng.choice(SETTINGS)}={rng.choice(NUMBERS)}" for _ in range(n))
    if name in ("load", "lod"):
        return f"{name} {rng.choice(files['load'])}"
    if name == "save":
        return f"save {rng.choice(files['save'])}".rstrip()
    if name == "system" and rng.random() < 0.7:
        return "system " + rng.choice(
            ["Be terse.", "--clear", "".join(ESCAPES), "x" * 5000, "".join(SPECIALS)]
        )
    if rng.random() < 0.2:
        return name + " " + rng.choice(NUMBERS + ESCAPES)
    return name


def is_exit(line: str) -> bool:
    """Lines that end the chat (left out so that every input is read)."""
    return line.split(" ", 1)[0].lower() in ("/exit", "/quit", "/q")


def tiny_model_dir(root: Path) -> Path:
    """The tests' tiny random Llama with its trained tokenizer, saved once."""
    path = root / "tiny-model"
    if not (path / "config.json").exists():
        from helpers import make_model, make_tokenizer

        tok = make_tokenizer()
        model = make_model(len(tok))
        with contextlib.redirect_stderr(io.StringIO()):
            model.save_pretrained(path)
            tok.save_pretrained(path)
    return path


def env_for(data: Path) -> dict[str, str]:
    return {**os.environ, "XDG_DATA_HOME": str(data), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def count_problems(err: str) -> dict[str, int]:
    return {"tracebacks": err.count("Traceback"), "internal_errors": err.count("internal error")}


def turn_events(data: Path) -> int:
    return sum(
        1
        for p in (data / "chatbot" / "sessions").glob("*.jsonl")
        for line in p.read_text(errors="replace").splitlines()
        if '"event": "turn"' in line
    )


# -- modes ---------------------------------------------------------------------------------------


def run_pipe(args: argparse.Namespace, work: Path) -> dict[str, int]:
    rng = random.Random(args.seed)
    files = make_files(work / "files")
    model = tiny_model_dir(work)
    result = {
        "inputs": 0,
        "processes": 0,
        "tracebacks": 0,
        "internal_errors": 0,
        "hangs": 0,
        "bad_exit": 0,
        "lost_turns": 0,
    }
    per = 100
    for start in range(0, args.n, per):
        lines = [hostile_line(rng, files) for _ in range(min(per, args.n - start))]
        lines = [line.replace("\n", " ") for line in lines if not is_exit(line)]
        data = Path(tempfile.mkdtemp(dir=work, prefix="pipe-"))
        cmd = [
            CHATBOT,
            "run",
            "--model",
            str(model),
            "--threads",
            "1",
            "--temperature",
            "0",
            "--max-new-tokens",
            "8",
        ]
        try:
            proc = subprocess.run(
                cmd,
                input="\n".join(lines).encode("utf-8", "surrogatepass") + b"\n",
                capture_output=True,
                env=env_for(data),
                timeout=600,
                check=False,
            )
        except subprocess.TimeoutExpired:
            result["hangs"] += 1
            continue
        err = proc.stderr.decode("utf-8", "replace")
        for key, value in count_problems(err).items():
            result[key] += value
        result["bad_exit"] += proc.returncode != 0
        result["lost_turns"] += max(0, len(STATS.findall(err)) - turn_events(data))
        result["inputs"] += len(lines)
        result["processes"] += 1
        if proc.returncode != 0 or "Traceback" in err or "internal error" in err:
            print(err[-2000:], file=sys.stderr)
    return result


def run_repl(args: argparse.Namespace, work: Path) -> dict[str, int]:
    """In-process through prompt_toolkit (keys typed at the prompt), batches of 50."""
    import torch
    from helpers import make_model, make_tokenizer
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput
    from rich.console import Console

    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation import log as session_log
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import LoadedModel
    from chatbot.terminal.repl import Repl

    torch.set_num_threads(1)
    rng = random.Random(args.seed + 1)
    files = make_files(work / "files")
    tok = make_tokenizer()
    model = make_model(len(tok))
    result = {
        "inputs": 0,
        "batches": 0,
        "tracebacks": 0,
        "internal_errors": 0,
        "hangs": 0,
        "lost_turns": 0,
        "invariant_broken": 0,
    }

    def alarm(*_: object) -> None:
        raise TimeoutError

    signal.signal(signal.SIGALRM, alarm)
    per = 50
    for start in range(0, args.n, per):
        data = Path(tempfile.mkdtemp(dir=work, prefix="repl-"))
        os.environ["XDG_DATA_HOME"] = str(data)
        session = ChatSession(
            Engine(model, tok), ChatConfig(sampling=SamplingConfig(temperature=0.0, max_new_tokens=8))
        )
        out, err = io.StringIO(), io.StringIO()
        repl = Repl(
            session,
            LoadedModel(model, tok, "tiny", "test", "folder"),
            Console(file=out, width=100),
            plain=True,
            info=Console(file=err, width=100, soft_wrap=True),
        )
        repl.start_log()
        # Typed key by key, a 70,000-character line takes minutes: long messages are the pipe's.
        lines = [
            line[:4000]
            for line in (hostile_line(rng, files) for _ in range(min(per, args.n - start)))
            if not is_exit(line)
        ]
        typed = "".join(line.replace("\n", " ") + "\r" for line in lines) + "\x04"
        signal.alarm(600)
        try:
            with create_pipe_input() as inp:
                # From a thread: the pipe holds 64 KiB, and the prompt reads only once it runs.
                feeder = threading.Thread(target=inp.send_text, args=(typed,), daemon=True)
                feeder.start()
                repl.run_terminal(input=inp, output=DummyOutput())
                feeder.join(timeout=5)
        except TimeoutError:
            result["hangs"] += 1
        except Exception as exc:  # noqa: BLE001 - what would have ended the chat
            result["internal_errors"] += 1
            print(f"batch {start}: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            signal.alarm(0)
        text = err.getvalue()
        result["tracebacks"] += text.count("Traceback")
        result["internal_errors"] += text.count("internal error")
        result["inputs"] += len(lines)
        result["batches"] += 1
        if session.turns or session.segments:
            try:
                if session.decode(session.all_ids) != session.render(session.messages(), False):
                    result["invariant_broken"] += 1
            except Exception:  # noqa: BLE001
                result["invariant_broken"] += 1
        if repl.log is not None and repl.log.enabled and repl.log.path.exists():
            logged = session_log.replay(repl.log.path)["turns"]
            mine = [(t.user, t.answer) for t in session.turns]
            theirs = [(t["user"], t["answer"]) for t in logged]
            result["lost_turns"] += sum(1 for a, b in zip(mine, theirs) if a != b) + abs(
                len(mine) - len(theirs)
            )
    return result


BAD_COMMAND_LINES: list[list[str]] = [
    ["run", "--threads", "0"],
    ["run", "--threads", "-3"],
    ["run", "--threads", "many"],
    ["run", "--start-size", "1000000000", "--enable-streaming"],
    ["run", "--recent-size", "1000000000000"],
    ["run", "--start-size", "500", "--recent-size", "100", "--enable-streaming"],
    ["run", "--recent-size", "3"],
    ["run", "--max-context", "99999999999"],
    ["run", "--max-context", "2"],
    ["run", "--prefill-chunk", "0"],
    ["run", "--prefill-chunk", "99999999999"],
    ["run", "--temperature", "nan"],
    ["run", "--temperature", "inf"],
    ["run", "--temperature", "1e-300"],
    ["run", "--top-p", "0"],
    ["run", "--top-k", "-1"],
    ["run", "--repetition-penalty", "0"],
    ["run", "--max-new-tokens", "0"],
    ["run", "--seed", "-1"],
    ["run", "--stream-interval", "0"],
    ["run", "--model", "/no/such/model"],
    ["run", "--model", "/dev/zero"],
    ["run", "--model", "\x1b]0;owned\x07"],
    ["run", "--device", "quantum"],
    ["run", "--dtype", "float7"],
    ["run", "--preset", "nope"],
    ["run", "--preset", "a", "--config", "b"],
    ["run", "--template", "nope"],
    ["run", "--opt", "fastest"],
    ["run", "--quantize", "3bit"],
    ["run", "--resume", "nope"],
    ["run", "--config", "{files}/binary.json"],
    ["run", "--config", "{files}/deep.json"],
    ["run", "--config", "/dev/zero"],
    ["run", "--config", "/dev/urandom"],
    ["run", "--config", "{files}/fifo"],
    ["run", "--config", "{files}/dir"],
    ["run", "--config", "{files}/loop"],
    ["run", "--config", "{files}/huge.json"],
    ["run", "--config", "{files}/deep.yaml"],
    ["run", "--config", "{files}/bomb.yaml"],
    ["run", "--template", "{files}/binary.jinja"],
    ["run", "--template", "/dev/zero.jinja"],
    ["run", "--bogus"],
    ["sessions", "--limit", "0"],
    ["bench", "turns", "--conversation", "/no/such.json"],
    ["eval-ppl", "--text", "/no/such.txt"],
    ["eval-ppl", "--tokens", "1"],
    ["bench", "decode", "--also", "nope"],
    ["config", "show", "--config", "/dev/zero"],
    ["config", "show", "--config", "{files}/deep.yaml"],
    ["models", "/no/such/folder", "--bogus"],
    ["nosuchcommand"],
]


def run_cmdline(args: argparse.Namespace, work: Path) -> dict[str, int]:
    files = work / "files"
    make_files(files)
    (files / "deep.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    (files / "bomb.yaml").write_text(
        "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 10) + "]\n" for i in range(8)
        )
    )
    (files / "binary.jinja").write_bytes(b"\x00\xff" * 100)
    result = {
        "command_lines": 0,
        "tracebacks": 0,
        "internal_errors": 0,
        "hangs": 0,
        "bad_exit": 0,
        "not_one_line": 0,
        "slowest_s": 0.0,
    }
    data = Path(tempfile.mkdtemp(dir=work, prefix="cmd-"))
    for line in [*BAD_COMMAND_LINES, ["run", "--threads", "999"]]:
        argv = [a.replace("{files}", str(files)) for a in line]
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                [CHATBOT, *argv], input=b"", capture_output=True, env=env_for(data), timeout=60, check=False
            )
        except subprocess.TimeoutExpired:
            result["hangs"] += 1
            print("hang:", argv, file=sys.stderr)
            continue
        took = time.perf_counter() - started
        result["slowest_s"] = round(max(result["slowest_s"], took), 1)
        err = proc.stderr.decode("utf-8", "replace")
        for key, value in count_problems(err).items():
            result[key] += value
        want = 0 if "999" in argv else 2
        lines = [x for x in err.splitlines() if x.strip()]
        if proc.returncode != want:
            result["bad_exit"] += 1
            print("exit", proc.returncode, argv, err[-500:], file=sys.stderr)
        elif want == 2 and len(lines) != 1:
            result["not_one_line"] += 1
            print("lines:", argv, err[-500:], file=sys.stderr)
        result["command_lines"] += 1
    return result


def run_kill(args: argparse.Namespace, work: Path) -> dict[str, int]:
    """kill -9 at random points; each round resumes the log of the one before."""
    from chatbot.conversation import log as session_log

    rng = random.Random(args.seed + 2)
    model = tiny_model_dir(work)
    data = Path(tempfile.mkdtemp(dir=work, prefix="kill-"))
    env = env_for(data)
    result = {
        "kills": 0,
        "lost_finished_turns": 0,
        "lost_messages": 0,
        "resume_failures": 0,
        "tracebacks": 0,
        "died": 0,
    }
    sessions = data / "chatbot" / "sessions"
    for round_ in range(args.kills):
        # the log --resume picks (the newest); none yet when every earlier round was killed
        # before its first write
        logs = [session_log.find_session("last", sessions)] if session_log.list_sessions(sessions) else []
        before = session_log.replay(logs[0])["turns"] if logs else []
        # A streaming cache: the 512-token context of the tiny model would fill up within a few
        # rounds otherwise (then messages are refused, one line each, and nothing is at stake).
        streaming = ["--enable-streaming", "--recent-size", "256"]
        cmd = [
            CHATBOT,
            "run",
            "--model",
            str(model),
            "--threads",
            "1",
            "--temperature",
            "0",
            *streaming,
            "--max-new-tokens",
            str(rng.choice([4, 50, 400, 2000])),
        ] + (["--resume"] if logs else [])
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        assert proc.stdin is not None and proc.stdout is not None
        started: list[str] = []
        stats_lines = 0  # stats lines read from stderr in this round, one per answer
        for i in range(rng.randint(1, 3)):
            message = f"round {round_} message {i} {rng.random():.6f}"
            try:
                proc.stdin.write(message.encode() + b"\n")
                proc.stdin.flush()
            except BrokenPipeError:  # the chat ended by itself: that is a failure
                break
            if rng.random() < 0.25:  # kill anywhere: start-up, resume, prefill
                time.sleep(rng.uniform(0, 3))
                break
            # Wait for the answer's first text (a refused message, e.g. when the context is
            # full, prints only the end of an empty answer, a newline, and is not logged).
            # An answer of whitespace only shows no text: its stats line (stderr) says it ran.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ready, _, _ = select.select([proc.stdout, proc.stderr], [], [], 1)
                if proc.stdout in ready:
                    data = os.read(proc.stdout.fileno(), 1 << 16)
                    if not data:
                        break
                    if data.strip():
                        started.append(message)  # its answer is streaming: the message was logged
                        break
                if proc.stderr in ready:
                    stats_lines += os.read(proc.stderr.fileno(), 1 << 16).count(b"first token")
                    if stats_lines > i:  # this message's own stats line: its answer has ended
                        started.append(message)
                        break
                if not ready and proc.poll() is not None:
                    break
            time.sleep(rng.uniform(0, 0.5))
        if proc.poll() is not None:
            result["died"] += 1
            print(
                f"round {round_}: exited {proc.returncode} before the kill:",
                proc.stderr.read().decode("utf-8", "replace")[-1500:],
                file=sys.stderr,
            )
        else:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        result["kills"] += 1
        logs = [session_log.find_session("last", sessions)] if session_log.list_sessions(sessions) else []
        if not logs:
            result["lost_messages"] += len(started)
            continue
        try:
            after = session_log.replay(logs[0])["turns"]
        except Exception as exc:  # noqa: BLE001
            result["resume_failures"] += 1
            print("replay:", exc, file=sys.stderr)
            continue
        result["lost_finished_turns"] += sum(
            1
            for i, t in enumerate(before)
            if i >= len(after) or (after[i]["user"], after[i]["answer"]) != (t["user"], t["answer"])
        )
        users = [t["user"] for t in after[len(before) :]]
        missing = [m for m in started if m not in users]
        if missing:
            print(f"round {round_}: lost {missing}; logged after the round: {users}", file=sys.stderr)
        result["lost_messages"] += len(missing)
        print(
            f"round {round_}: {len(after)} turns logged, {len(started)} answers had started",
            file=sys.stderr,
            flush=True,
        )
    # the last log resumes cleanly
    proc = subprocess.run(
        [CHATBOT, "run", "--model", str(model), "--threads", "1", "--resume", "--max-new-tokens", "2"],
        input=b"/history\n",
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    result["resume_failures"] += proc.returncode != 0
    result["tracebacks"] += proc.stderr.count(b"Traceback")
    return result


def rss_kib(pid: int) -> int:
    from chatbot.engine.stats import proc_status_kb

    return proc_status_kb("VmRSS", pid) or 0


def run_soak(args: argparse.Namespace, work: Path) -> dict[str, object]:
    """One chat of `--turns` messages on a small streaming window; RSS after every turn."""
    rng = random.Random(args.seed + 3)
    data = Path(tempfile.mkdtemp(dir=work, prefix="soak-"))
    cmd = [
        CHATBOT,
        "run",
        "--enable-streaming",
        "--recent-size",
        "60",
        "--temperature",
        "0",
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--threads",
        str(args.threads),
    ] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env_for(data),
        text=True,
        bufsize=1,
    )
    assert proc.stdin is not None and proc.stderr is not None
    topics = ["the sea", "a city at night", "bread", "old trains", "mountains", "a library", "rain", "chess"]
    curve: dict[int, int] = {}
    tokens = 0
    errors = 0
    t0 = time.perf_counter()
    for turn in range(1, args.turns + 1):
        proc.stdin.write(f"Turn {turn}: say one sentence about {rng.choice(topics)}.\n")
        proc.stdin.flush()
        while True:
            line = proc.stderr.readline()
            if not line:
                raise SystemExit(f"the chat ended at turn {turn}")
            if "Traceback" in line or "internal error" in line or line.startswith("error:"):
                errors += 1
                print(line, file=sys.stderr, end="")
            m = re.match(r"context ([\d,]+) tok .* ([\d,]+) tok · ", line)
            if line.startswith("context "):
                if m:
                    tokens += int(m.group(1).replace(",", "")) + int(m.group(2).replace(",", ""))
                break
        curve[turn] = rss_kib(proc.pid)
        if turn % 50 == 0:
            print(
                f"turn {turn}: RSS {curve[turn] / 1024:.1f} MiB, {tokens:,} tokens, "
                f"{time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    proc.stdin.close()
    proc.wait(timeout=120)
    marks = {t: round(curve[t] / 1024, 1) for t in sorted(curve) if t % 50 == 0}
    first = curve[min(50, args.turns)]
    return {
        "turns": args.turns,
        "tokens_through_cache": tokens,
        "window": 60 + 4,
        "x_window": round(tokens / 64, 1),
        "errors": errors,
        "exit": proc.returncode,
        "rss_mib_every_50_turns": marks,
        "rss_last_over_turn_50": round(curve[args.turns] / first, 4),
        "seconds": round(time.perf_counter() - t0),
    }


def run_load(args: argparse.Namespace, work: Path) -> dict[str, object]:
    """/load of 500, 1,000 and 2,000 turns on the tiny model (streaming cache, one thread):
    seconds to split it into turns and to encode it."""
    import torch
    from helpers import make_model, make_tokenizer

    from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.generate import Engine

    torch.set_num_threads(1)
    tok = make_tokenizer()
    model = make_model(len(tok), max_position_embeddings=1 << 20)
    rows = {}
    for n in (500, 1000, 2000):
        engine = Engine(model, tok, max_context=1 << 20)
        s = ChatSession(
            engine,
            ChatConfig(
                sampling=SamplingConfig(temperature=0.0),
                engine=EngineConfig(enable_streaming=True, recent_size=64),
            ),
        )
        data = {
            "turns": [{"user": f"Hello {i}, how are you?", "answer": "Fine, thank you."} for i in range(n)]
        }
        t0 = time.perf_counter()
        s.restore(data, encode=False)
        split = time.perf_counter() - t0
        t0 = time.perf_counter()
        fed = s.prefill_pending()
        rows[n] = {
            "split_s": round(split, 2),
            "encode_s": round(time.perf_counter() - t0, 2),
            "tokens": len(s.all_ids),
            "fed": fed,
        }
        print(f"{n} turns: {rows[n]}", file=sys.stderr, flush=True)
    return rows


# -- damage: what we read back, and what a client sends ------------------------------------------


def _chat(
    argv: list[str], env: dict[str, str], stdin: str = "Hi\n", timeout: float = 300
) -> tuple[int, str, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "chatbot.cli", *argv],
            input=stdin.encode(),
            capture_output=True,
            env=env,
            timeout=timeout,
            check=False,
            cwd=str(ROOT),
        )
    except subprocess.TimeoutExpired:
        return -999, "", "hang"
    return proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")


def _judge(result: dict, code: int, err: str, answered: bool, refusal_ok: bool, what: str) -> None:
    """Count one case: an answer (exit 0 and a stats line), or where allowed a one-line
    refusal (exit 2); anything else is a problem, printed."""
    result["cases"] += 1
    problem = None
    if code == -999:
        result["hangs"] += 1
        problem = "hang"
    elif code < 0 or code > 128:
        result["signals"] += 1
        problem = f"killed by signal {-code if code < 0 else code - 128}"
    elif "Traceback" in err or "internal error" in err:
        result["tracebacks"] += 1
        problem = "traceback / internal error"
    elif code == 0 and answered:
        result["answered"] += 1
    elif code == 2 and refusal_ok and len([x for x in err.splitlines() if x.strip()]) == 1:
        result["refused"] += 1
    else:
        result["bad"] += 1
        problem = f"exit {code}, answered={answered}"
    if problem:
        print(f"damage: {what}: {problem}\n{err[-1500:]}", file=sys.stderr)


def _tiny_gguf(work: Path) -> Path:
    from helpers import make_model, make_tokenizer, write_tiny_gguf

    path = work / "tiny.gguf"
    if not path.exists():
        tok = make_tokenizer()
        write_tiny_gguf(path, make_model(len(tok)), tok)
    return path


def _damage_bytes(rng: random.Random, data: bytearray, start: int, end: int) -> str:
    """Damage `data[start:end]` in place in one of several ways; returns how."""
    how = rng.choice(["flip", "zero", "garbage", "cut"])
    end = max(start + 1, min(end, len(data)))
    at = rng.randrange(start, end)
    if how == "cut":
        del data[at:]
    elif how == "flip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(start, end)
            data[i] ^= 1 << rng.randrange(8)
    else:
        n = min(rng.randint(1, 4096), len(data) - at)
        data[at : at + n] = bytes(n) if how == "zero" else rng.randbytes(n)
    return f"{how} at {at}"


def run_damage(args: argparse.Namespace, work: Path) -> dict[str, object]:
    rng = random.Random(args.seed + 27)
    model = _tiny_gguf(work)
    flags = ["run", "--model", str(model), "--temperature", "0", "--max-new-tokens", "4", "--threads", "1"]
    out: dict[str, object] = {}

    def counts() -> dict:
        return {"cases": 0, "answered": 0, "refused": 0, "signals": 0, "tracebacks": 0, "hangs": 0, "bad": 0}

    def env(cache: Path, **extra: str) -> dict[str, str]:
        return {**env_for(work / "data"), "XDG_CACHE_HOME": str(cache), **extra}

    # The kernel library, damaged in the cache (rebuilt; or through transformers).
    good = work / "cache-good"
    code, _, err = _chat(flags, env(good))
    assert code == 0, err
    (lib,) = (good / "chatbot" / "kernels").glob("*.so")
    kern = counts()
    for i in range(args.cases):
        cache = work / f"cache-k{i}"
        subprocess.run(["cp", "-r", str(good), str(cache)], check=True)
        target = cache / "chatbot" / "kernels" / lib.name
        data = bytearray(target.read_bytes())
        how = _damage_bytes(rng, data, 0, len(data))
        target.write_bytes(bytes(data))
        code, _, err = _chat(flags, env(cache))
        _judge(kern, code, err, bool(STATS.search(err)), False, f"kernel library {how}")
    out["kernel_cache"] = kern

    # No C compiler at all (an empty PATH, a fresh cache): through transformers.
    nocc = counts()
    code, _, err = _chat(flags, env(work / "cache-nocc", PATH=""))
    _judge(nocc, code, err, bool(STATS.search(err)), False, "no compiler")
    out["no_compiler"] = nocc

    # GGUF files: the header and tensor table flipped, zeroed, overwritten or cut; and cut
    # anywhere in the data.
    import gguf

    reader = gguf.GGUFReader(str(model))
    table_end = int(reader.data_offset)
    original = model.read_bytes()
    files = counts()
    for i in range(args.cases):
        data = bytearray(original)
        in_table = rng.random() < 0.75
        how = _damage_bytes(rng, data, 0 if in_table else table_end, table_end if in_table else len(data))
        path = work / f"damaged-{i}.gguf"
        path.write_bytes(bytes(data))
        argv = [a if a != str(model) else str(path) for a in flags]
        code, _, err = _chat(argv, env(good))
        _judge(files, code, err, bool(STATS.search(err)), True, f"GGUF {how}")
        path.unlink()
    out["gguf_files"] = files

    # The cached metadata of a GGUF file, edited at the same size: rebuilt from the file,
    # with no dequantized copy written.
    meta = counts()
    meta["dequantized_copies"] = 0
    for i in range(max(1, args.cases // 4)):
        cache = work / f"cache-m{i}"
        subprocess.run(["cp", "-r", str(good), str(cache)], check=True)
        configs = sorted((cache / "chatbot" / "gguf-meta").glob("*/config.json"))
        text = bytearray(configs[0].read_bytes())
        how = _damage_bytes(rng, text, 0, len(text))
        if how.startswith("cut"):
            text = bytearray(configs[0].read_bytes())
            text[len(text) // 2] ^= 1
        configs[0].write_bytes(bytes(text))
        code, _, err = _chat(flags, env(cache))
        _judge(meta, code, err, bool(STATS.search(err)), False, f"metadata {how}")
        meta["dequantized_copies"] += any((cache / "chatbot" / "gguf").glob("*"))
    out["metadata_cache"] = meta

    out["full_disk"] = _damage_full_disk(work, flags, env(good))
    out["server"] = _damage_server(args, rng, work, model, env(good))
    out["library_api"] = _damage_library_api(rng, args.cases * 4)
    return out


def _damage_full_disk(work: Path, flags: list[str], env: dict[str, str]) -> dict[str, object]:
    """A chat on a pipe whose session log becomes /dev/full after the first answer, then
    comes back: three answers, one warning, and a log that restores the three turns."""
    data = work / "data-full"
    env = {**env, "XDG_DATA_HOME": str(data)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "chatbot.cli", *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.stdin is not None and proc.stderr is not None
    err_lines: list[str] = []

    def answer(message: str) -> None:
        proc.stdin.write(message.encode() + b"\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        while True:
            line = proc.stderr.readline().decode("utf-8", "replace")  # type: ignore[union-attr]
            if not line:
                return
            err_lines.append(line)
            if STATS.search(line):
                return

    answer("one")
    (log,) = (data / "chatbot" / "sessions").glob("*.jsonl")
    aside = log.with_suffix(".aside")
    log.rename(aside)
    log.symlink_to("/dev/full")
    answer("two")
    log.unlink()
    aside.rename(log)
    answer("three")
    proc.stdin.close()
    rest = proc.stderr.read().decode("utf-8", "replace")
    code = proc.wait(timeout=120)
    err = "".join(err_lines) + rest
    turns = sum(1 for line in log.read_text(errors="replace").splitlines() if '"event": "turn"' in line)
    return {
        "exit": code,
        "answers": len(STATS.findall(err)),
        "warnings": err.count("warning"),
        "tracebacks": err.count("Traceback"),
        "logged_turns": turns,
    }


def _damage_server(
    args: argparse.Namespace, rng: random.Random, work: Path, model: Path, env: dict[str, str]
) -> dict[str, object]:
    """Hostile bodies to a real `chatbot serve`: every one answered 4xx (or 200), none 5xx,
    the server alive and its memory bounded at the end."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chatbot.cli.app",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=str(ROOT),
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/health", timeout=1).read()
            break
        except OSError:
            time.sleep(0.2)
    rss_start = rss_kib(proc.pid)

    import httpx

    def post(body: bytes, headers: dict[str, str] | None = None) -> int:
        try:  # httpx, as the openai client: it reads a 413 sent before the body was all sent
            return httpx.post(
                base + "/v1/chat/completions",
                content=body,
                timeout=120,
                headers={"Content-Type": "application/json", **(headers or {})},
            ).status_code
        except httpx.HTTPError as exc:
            print(f"damage: server: {type(exc).__name__}: {exc}", file=sys.stderr)
            return -1

    name = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=10).read())["data"][0]["id"]

    def message(content: str) -> bytes:
        head = json.dumps({"model": name, "max_tokens": 4})[:-1]
        return (head + ', "messages": [{"role": "user", "content": "' + content + '"}]}').encode()

    bodies: list[tuple[str, bytes]] = [
        ("lone surrogate", message("hi \\ud800")),
        ("lone low surrogate", message("\\udfff x")),
        ("NUL", message("a\\u0000b")),
        ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        ("20 MB body", message("a" * 20_000_000)),
        ("deep JSON", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("not JSON", b"\x00" * 1000),
        ("empty", b""),
        ("content is a number", b'{"messages": [{"role": "user", "content": 5}]}'),
        ("unknown role", b'{"messages": [{"role": "wizard", "content": "hi"}]}'),
        ("huge max_tokens", b'{"max_tokens": 1e999, "messages": [{"role": "user", "content": "hi"}]}'),
    ]
    for i in range(args.cases):
        junk = "".join(
            rng.choice(["\\ud83d", "\\u0000", "\\\\", '\\"', "x", "\\n", "\\u202e", "\\udc80"])
            for _ in range(rng.randint(1, 40))
        )
        bodies.append((f"random {i}", message(junk)))
    result: dict[str, object] = {"requests": 0, "ok": 0, "client_errors": 0, "server_errors": 0, "dropped": 0}
    for what, body in bodies:
        status = post(body)
        result["requests"] += 1  # type: ignore[operator]
        key = (
            "ok"
            if status == 200
            else "client_errors"
            if 400 <= status < 500
            else ("server_errors" if status >= 500 else "dropped")
        )
        result[key] += 1  # type: ignore[operator]
        if status >= 500 or status < 0:
            print(f"damage: server: {what}: HTTP {status}", file=sys.stderr)
    result["alive"] = post(message("hello")) == 200
    result["rss_growth_mb"] = round((rss_kib(proc.pid) - rss_start) / 1024)
    proc.terminate()
    proc.wait(timeout=30)
    return result


def _damage_library_api(rng: random.Random, n: int) -> dict[str, object]:
    """Random arguments to the published APIs on the tiny model: every refusal is the
    project's own error (CompatArgumentError / ChatbotError), never another exception."""
    from helpers import make_model, make_tokenizer

    from chatbot.compat import colossal, streaming_llm
    from chatbot.errors import ChatbotError

    tok = make_tokenizer()
    model = make_model(len(tok))
    values = [None, 0, -1, 1, 2, 4, 16, 100, 10**12, 0.5, 2.0, -0.1, float("nan"), float("inf"), "8", [], {}]
    result: dict[str, object] = {"calls": 0, "accepted": 0, "refused": 0, "other_exceptions": 0}
    for _ in range(n):
        result["calls"] += 1  # type: ignore[operator]
        try:
            if rng.random() < 0.5:
                streaming_llm.enable_streaming_llm(
                    make_model(len(tok)), start_size=rng.choice(values), recent_size=rng.choice(values)
                )
            else:
                history = rng.choice(
                    [
                        [],
                        [{"role": "Human", "message": "hi"}],
                        [{"role": "Human"}],
                        [{"message": 5}],
                        "text",
                        None,
                    ]
                )
                gen = colossal.streaming_chat(
                    model,
                    tok,
                    "hi",
                    history,
                    max_new_tokens=rng.choice([1, 2, 0, -1]),
                    top_p=rng.choice(values),
                    temperature=rng.choice(values),
                    top_k=rng.choice(values),
                )
                next(iter(gen))
            result["accepted"] += 1  # type: ignore[operator]
        except ChatbotError:
            result["refused"] += 1  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001 - what is counted
            result["other_exceptions"] += 1  # type: ignore[operator]
            print(f"damage: library API: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["pipe", "repl", "cmdline", "kill", "soak", "load", "damage", "all"])
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--n", type=int, default=1000, help="inputs for pipe and repl")
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--cases", type=int, default=20, help="damage: cases of each kind")
    parser.add_argument("--turns", type=int, default=500, help="soak turns")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="soak: tokens per answer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="soak: the model (default: the default model)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    modes = ["pipe", "repl", "cmdline", "kill"] if args.mode == "all" else [args.mode]
    results: dict[str, object] = {"seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="chatbot-fuzz-") as tmp:
        work = Path(tmp)
        for mode in modes:
            t0 = time.perf_counter()
            results[mode] = globals()[f"run_{mode}"](args, work)
            print(f"{mode} ({time.perf_counter() - t0:.0f} s): {json.dumps(results[mode])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
