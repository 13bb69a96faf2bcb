"""`chatbot run` shows its prompt while the model loads (in a background thread): what a person
sees on a terminal (a pseudo-terminal behind pyte) before, during and after the load.

The REPL's side runs with a scripted model whose "load" ends when the test says so (a file
appears: tests/scripted_chat.py --load-when), so every state is reached on purpose, not by
timing. The real command runs on the default model and on a damaged GGUF file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from screen import Terminal

pytest.importorskip("pyte")

SCRIPT = Path(__file__).parent / "scripted_chat.py"
ANSWER = "The answer is **forty-two**, as computed."


def scripted(tmp_path: Path, fails: bool = False, columns: int = 80) -> tuple[Terminal, Path]:
    answer = tmp_path / "answer.md"
    answer.write_text(ANSWER, encoding="utf-8")
    flag = tmp_path / "loaded"
    argv = [sys.executable, str(SCRIPT), str(answer), "--load-when", str(flag)]
    if fails:
        argv.append("--load-fails")
    env = {"XDG_DATA_HOME": str(tmp_path / "data")}
    term = Terminal(argv, columns=columns, lines=24, cwd=str(tmp_path), env=env)
    term.wait_prompt(120)
    return term, flag


def screen_text(term: Terminal) -> str:
    return "\n".join(term.lines())


def toolbar(term: Terminal) -> str:
    """The line under the prompt: the screen's last line that is not empty."""
    return next((line for line in reversed(term.screen_lines()) if line.strip()), "")


def wait_toolbar(term: Terminal, text: str) -> None:
    term.wait_for(lambda: text in toolbar(term), 30, f"{text!r} in the toolbar")


def test_the_prompt_is_up_while_the_model_loads_and_a_message_waits_for_it(tmp_path, terminals):
    term, flag = scripted(tmp_path)
    terminals.append(term)
    wait_toolbar(term, "loading scripted… · /help")
    term.type("what is the answer?\r")
    term.wait_text("(Ctrl-C: back to the prompt)", 30)
    assert "forty-two" not in screen_text(term)
    flag.touch()
    term.wait_text("tok/s", 60)
    lines = term.lines()
    sent = lines.index("> what is the answer?")
    banner = lines.index("scripted · ready in 0.0 s (load 0.0 s)")
    answer = next(i for i, line in enumerate(lines) if "forty-two" in line)
    assert sent < banner < answer  # the load's notes, then the answer to the waiting message
    term.wait_prompt(30)
    wait_toolbar(term, "scripted · cache")  # the toolbar of a loaded model


def test_a_load_that_ends_at_the_prompt_prints_its_notes_above_it(tmp_path, terminals):
    term, flag = scripted(tmp_path)
    terminals.append(term)
    term.type("half a mess")  # typing, not sent
    term.wait_for(lambda: "> half a mess" in term.screen_lines(), 30, "the typed text")
    flag.touch()
    term.wait_text("scripted · ready in 0.0 s (load 0.0 s)", 30)
    wait_toolbar(term, "scripted · cache")
    assert "> half a mess" in term.screen_lines()  # the typed text is kept
    assert term.lines().count("scripted · ready in 0.0 s (load 0.0 s)") == 1
    term.type("age\r")
    term.wait_text("tok/s", 60)
    assert "forty-two" in screen_text(term)


def test_ctrl_c_while_a_resumed_chat_is_encoded_at_the_prompt_keeps_the_typed_text(tmp_path, terminals):
    """The load ends with the prompt up and `--resume` re-encodes the logged chat there;
    Ctrl-C stops the encoding (the rest is encoded with the next message) and leaves what was
    typed at the prompt as it was, and the chat goes on."""
    answer = tmp_path / "answer.md"
    answer.write_text(ANSWER, encoding="utf-8")
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    first = subprocess.run([sys.executable, str(SCRIPT), str(answer)], input="an earlier question\n",
                           env=env, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert first.returncode == 0, first.stderr
    (log,) = (tmp_path / "data").rglob("*.jsonl")
    flag = tmp_path / "loaded"
    argv = [sys.executable, str(SCRIPT), str(answer), "--load-when", str(flag), "--resume", str(log),
            "--prefill-delay", "20"]  # fmt: skip
    term = Terminal(
        argv, columns=80, lines=24, cwd=str(tmp_path), env={"XDG_DATA_HOME": str(tmp_path / "data")}
    )
    terminals.append(term)
    term.wait_prompt(120)
    term.type("half a mess")
    term.wait_for(lambda: "> half a mess" in term.screen_lines(), 30, "the typed text")
    flag.touch()
    term.wait_text("resuming session", 30)
    time.sleep(0.5)  # inside the encoding's pass
    term.type("\x03")
    term.wait_text("encoding stopped", 15)  # well before the 20 s pass would end
    term.wait_for(lambda: "> half a mess" in term.screen_lines(), 15, "the typed text, kept")
    time.sleep(0.5)
    assert "(Ctrl-D or /exit to leave)" not in screen_text(term)  # no second Ctrl-C reached the prompt
    prompt = next(line for line in reversed(term.screen_lines()) if line.startswith(">"))
    assert prompt == "> half a mess"
    term.type("age\r")
    term.wait_text("tok/s", 60)
    assert "forty-two" in screen_text(term)


@pytest.mark.parametrize("message", ["keep this message", "//undo is a command"])
def test_ctrl_c_while_waiting_for_the_model_gives_the_message_back(tmp_path, terminals, message):
    """The message comes back as typed: `//text` sends "/text" as a message, and given back
    as "/text", Enter would run the command."""
    term, flag = scripted(tmp_path)
    terminals.append(term)
    term.type(message + "\r")
    term.wait_text("(Ctrl-C: back to the prompt)", 30)
    term.type("\x03")
    term.wait_text("(the model is still loading; nothing was sent)", 30)
    term.wait_for(lambda: f"> {message}" in term.screen_lines(), 30, "the message back at the prompt")
    flag.touch()
    wait_toolbar(term, "scripted · cache")
    term.type("\r")
    term.wait_text("tok/s", 60)
    assert "forty-two" in screen_text(term)
    log = next((tmp_path / "data").rglob("*.jsonl"))
    events = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    sent = message.removeprefix("/") if message.startswith("//") else message
    assert [e["user"] for e in events if e["event"] == "turn"] == [sent]  # sent once, as a message


def test_help_runs_while_loading_and_other_commands_wait(tmp_path, terminals):
    term, flag = scripted(tmp_path)
    terminals.append(term)
    term.type("/help\r")
    term.wait_text("/retry", 30)
    term.wait_prompt(30)
    wait_toolbar(term, "loading scripted…")  # /help did not wait for the model
    term.type("/history\r")
    term.wait_text("(Ctrl-C: back to the prompt)", 30)
    assert "(no messages yet)" not in screen_text(term)
    flag.touch()
    term.wait_text("(no messages yet)", 30)  # /history ran once the model was there
    lines = term.lines()
    assert lines.index("scripted · ready in 0.0 s (load 0.0 s)") < lines.index("(no messages yet)")
    term.wait_prompt(30)


def test_a_load_that_fails_at_the_prompt_leaves_with_one_line(tmp_path, terminals):
    term, flag = scripted(tmp_path, fails=True)
    terminals.append(term)
    flag.touch()
    term.wait_for(lambda: not term.proc.isalive(), 30, "the program to end")
    term.pump(0.3)
    assert term.proc.exitstatus == 2
    text = screen_text(term)
    assert "chatbot: error: cannot read GGUF file scripted.gguf: it is truncated" in text
    assert "Traceback" not in term.raw


def test_exit_while_loading_leaves_at_once(tmp_path, terminals):
    term, _ = scripted(tmp_path)
    terminals.append(term)
    term.type("/exit\r")
    term.wait_for(lambda: not term.proc.isalive(), 10, "the program to end")
    term.pump(0.3)
    assert term.proc.exitstatus == 0
    assert "Traceback" not in term.raw


# -- the real command -----------------------------------------------------------------------


def chatbot(tmp_path: Path, *args: str) -> Terminal:
    env = {"XDG_DATA_HOME": str(tmp_path / "data")}
    return Terminal([sys.executable, "-m", "chatbot.cli", "run", *args], columns=80, lines=24, env=env)


@pytest.mark.slow
def test_chatbot_run_shows_the_prompt_first_and_answers_a_message_sent_at_once(tmp_path, terminals):
    term = chatbot(tmp_path, "--greedy", "--max-new-tokens", "8")
    terminals.append(term)
    term.wait_prompt(120)
    term.type("Name a colour.\r")
    term.wait_text("tok/s", 180)
    raw = term.raw
    # The prompt (its toolbar saying the model loads) was drawn before the model was ready.
    assert raw.index("loading SmolLM2-135M-Instruct…") < raw.index("ready in")
    lines = term.lines()
    assert lines.index("> Name a colour.") < next(i for i, x in enumerate(lines) if "ready in" in x)
    term.wait_prompt(60)
    term.type("/exit\r")
    term.wait_for(lambda: not term.proc.isalive(), 30, "the program to end")
    term.pump(0.3)
    assert term.proc.exitstatus == 0


def test_chatbot_run_left_while_loading_exits_at_once_and_cleanly(tmp_path, terminals):
    term = chatbot(tmp_path)
    terminals.append(term)
    term.wait_prompt(120)
    term.type("/exit\r")
    term.wait_for(lambda: not term.proc.isalive(), 60, "the program to end")
    term.pump(0.3)
    assert "ready in" not in term.raw  # it left before the model was ready
    assert term.proc.exitstatus == 0
    assert "Traceback" not in term.raw and "Fatal" not in term.raw


def test_chatbot_run_on_a_damaged_gguf_shows_one_error_line(tmp_path, terminals):
    bad = tmp_path / "damaged.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)  # the magic, then no valid header
    term = chatbot(tmp_path, "--model", str(bad))
    terminals.append(term)
    term.wait_for(lambda: not term.proc.isalive(), 120, "the program to end")
    term.pump(0.3)
    assert term.proc.exitstatus == 2
    errors = [line for line in term.lines() if line.startswith("chatbot: error:")]
    assert errors and "cannot read GGUF file" in errors[0] and "damaged.gguf" in "".join(term.lines())
    assert "Traceback" not in term.raw


def test_a_missing_model_file_fails_before_any_prompt(tmp_path):
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "chatbot.cli", "run", "--model", str(tmp_path / "nope.gguf")],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"chatbot: error: no such file or folder: {tmp_path / 'nope.gguf'}"
    assert time.perf_counter() - start < 60


def test_what_runs_before_the_prompt_imports_neither_torch_nor_numpy():
    """The prompt comes up in ~0.4 s because nothing before it imports torch (0.6 s),
    transformers (0.8 s) or numpy: the CLI, the settings, the model check and the REPL."""
    code = (
        "import sys\n"
        "from chatbot.cli.app import app\n"
        "from chatbot.models.presets import resolve_settings, select_preset\n"
        "from chatbot.models.source import check_source\n"
        "from chatbot.terminal.repl import Repl, ChatStart\n"
        "from chatbot.terminal.tty import make_consoles\n"
        "source = check_source(None, tables=False)\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'gguf') if m in sys.modules]\n"
        "print(source.kind, source.name, heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "default SmolLM2-135M-Instruct []"


def test_folders_being_written_are_removed_by_a_hurried_exit(tmp_path):
    """`chatbot run` quit while its model loads leaves with os._exit (no `finally`, no
    atexit): the cache folder being written at that moment must still go."""
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from chatbot.models.manifest import remove_partial, scratch_folder, staging\n"
        "target = Path(sys.argv[1]) / 'converted'\n"
        "scratch = scratch_folder('chatbot-test-')\n"
        "with staging(target) as tmp:\n"
        "    (tmp / 'model.safetensors').write_bytes(b'0' * 1000)\n"
        "    print(tmp, scratch, flush=True)\n"
        "    remove_partial()\n"
        "    os._exit(0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True, timeout=60
    )
    tmp, scratch = map(Path, out.stdout.split())
    assert tmp.parent == tmp_path and tmp.name.startswith("converted.tmp-")
    assert not tmp.exists() and not scratch.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_published_folder_is_not_removed_by_a_hurried_exit(tmp_path):
    from chatbot.models.manifest import publish, read_manifest, remove_partial, staging

    target = tmp_path / "cache"
    with staging(target) as tmp:
        (tmp / "config.json").write_text("{}")
        publish(tmp, target)
    remove_partial()
    assert read_manifest(target) is not None and sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_warnings_of_a_background_load_become_notes_above_the_prompt(monkeypatch):
    """A library warning printed by the loading thread would land across the prompt; it is
    shown as a note instead (once), before the load's own notes."""
    import warnings

    from chatbot.cli import app as cli
    from chatbot.terminal.repl import ChatStart

    def make(settings, opt, threads, banner, quiet):
        assert quiet  # no spinner under the prompt
        for _ in range(2):
            warnings.warn("a deprecated\n   option", FutureWarning, stacklevel=1)
        return ChatStart(session=None, loaded=None, notes=["banner"])  # type: ignore[arg-type]

    monkeypatch.setattr(cli, "_make_chat", make)
    monkeypatch.setattr(cli, "gc_ready", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        start = cli._start_chat(None, "auto", None, banner=True, background=True)
    assert start.notes == ["warning: a deprecated option", "banner"]


# `chatbot run` as its console script starts it, writing the names of the modules loaded by
# its end into the file named by its first argument (the CLI leaves after its exit handlers).
MODULES_AT_EXIT = (
    "import atexit, json, sys\n"
    "out = sys.argv[1]\n"
    "def dump():\n"
    "    with open(out, 'w', encoding='utf-8') as f:\n"
    "        json.dump(sorted(sys.modules), f)\n"
    "atexit.register(dump)\n"
    "from chatbot.cli.app import main\n"
    "sys.argv = ['chatbot', *sys.argv[2:]]\n"
    "sys.exit(main())\n"
)
MODEL_STACK = ("transformers.models", "transformers.modeling_utils", "transformers.masking_utils",
               "torch._dynamo", "torch.distributed.tensor", "accelerate")  # fmt: skip
"""transformers' config and model classes and what they import (1.4-2.0 s of a one-shot on
an idle core: docs/benchmarks.md, "Start-up: a one-shot answer")."""


@pytest.mark.slow
def test_a_one_shot_on_the_default_model_imports_no_transformers(tmp_path):
    """The default model runs on the native kernels from its GGUF blocks, as our own model
    (`chatbot.engine.backends.native.skeleton`) from its cached config and tokenizer, with our
    own caches (`chatbot.engine.cache.layers`): no module of transformers is imported at all
    (the config, tokenizer, chat template, logits processors, stop criteria, attention and
    generation config are our own: tests/test_without_transformers.py; the caches:
    tests/test_own_cache.py)."""
    modules = tmp_path / "modules.json"
    one_shot = ["run", "Hi", "--greedy", "--max-new-tokens", "1"]
    for _ in range(2):  # the first load of the file writes its config and tokenizer cache
        proc = subprocess.run(
            [sys.executable, "-c", MODULES_AT_EXIT, str(modules), *one_shot],
            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300, check=False,
            env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()  # the answer
    loaded = json.loads(modules.read_text(encoding="utf-8"))
    assert "chatbot.engine.backends.native.decoder" in loaded  # the native path ran
    assert [m for m in loaded if m in MODEL_STACK] == []
    assert [m for m in loaded if m.split(".")[0] == "transformers"] == []
