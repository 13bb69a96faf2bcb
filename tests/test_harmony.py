"""Issue 60: gpt-oss's harmony chat format. The analysis channel is the model's thinking (dimmed
and folded on a terminal, kept off stdout in a pipe or a one-shot run, `reasoning_content` from
`serve`), the final channel the answer; `<|return|>` and `<|call|>` end an answer, `<|end|>`
only its analysis; earlier answers are rendered by gpt-oss's own template (OpenAI's, in
devtools/data), which drops their analysis.

A tiny random model does not write harmony: the answers are scripted (tests/scripted_chat.py's
model, which replays them token by token after its real forward pass), the template and the
tokenizer's control tokens are gpt-oss's. The tiny gpt-oss file is run through the CLI for the
wiring: its template, its stops.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_ids_match_text, make_harmony_tokenizer, make_model
from scripted_chat import ScriptedModel
from serve_helpers import CHATBOT

from chatbot.conversation.harmony import HarmonySplitter, harmony_messages, split_harmony
from chatbot.conversation.thinking import ThinkingMeter, opens_thinking, splitter_for

THOUGHT = "The user greets me. I should greet them back."
ANSWER = "Hello there, how can I help?"
STREAM = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
)
SCRIPTED = Path(__file__).parent / "scripted_chat.py"


def split_all(pieces: list[str]) -> tuple[str, str]:
    splitter = splitter_for(opens_thinking("<|start|>user<|message|>Hi<|end|><|start|>assistant"))
    assert isinstance(splitter, HarmonySplitter)
    parts = [p for piece in pieces for p in splitter.feed(piece)] + splitter.flush()
    return "".join(t for t, th in parts if th), "".join(t for t, th in parts if not th)


def test_the_splitter_reads_the_channels_cut_at_every_point():
    call = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"
    with_call = f"{STREAM}<|end|><|start|>assistant{call}"
    for text, expected in [
        (STREAM, (THOUGHT, ANSWER)),
        (f"<|channel|>final<|message|>{ANSWER}", ("", ANSWER)),  # no analysis at all
        (with_call, (THOUGHT, ANSWER + "{}")),  # a tool call's message is not thinking
        (ANSWER, ("", ANSWER)),  # not harmony: plain answer text
        (f"<|channel|>analysis<|message|>{THOUGHT}", (THOUGHT, "")),  # cut short while thinking
    ]:
        assert split_all([text]) == expected
        for i in range(len(text) + 1):  # in two pieces, cut anywhere
            assert split_all([text[:i], text[i:]]) == expected, (text, i)
        for size in (1, 2, 3, 7):
            assert split_all([text[i : i + size] for i in range(0, len(text), size)]) == expected


def test_the_meter_counts_the_analysis_tokens():
    meter = ThinkingMeter("<|start|>assistant")
    pieces = ["<|channel|>", "analysis", "<|message|>", "a", " b", "<|end|>", "<|start|>", "assistant"]
    for text in pieces + ["<|channel|>", "final", "<|message|>", "An", "swer"]:
        meter.add(text, 1)
    assert meter.tokens == 4  # the <|message|> that opens the analysis, "a", " b", the <|end|>


def test_an_answer_is_given_to_the_template_as_content_and_thinking():
    assert split_harmony(STREAM) == (THOUGHT, ANSWER)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": STREAM}]
    assert harmony_messages(messages)[1] == {"role": "assistant", "content": ANSWER, "thinking": THOUGHT}
    assert harmony_messages(messages)[0] == messages[0]


# -- a chat (the scripted tiny model, gpt-oss's template and control tokens) ---------------------


SECOND = (
    "<|channel|>analysis<|message|>They ask again.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Still here."
)


@pytest.fixture
def harmony_session(one_thread):
    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.generate import Engine

    tok = make_harmony_tokenizer()
    script = [tok.encode(text, add_special_tokens=False) for text in (STREAM, SECOND)]
    model = ScriptedModel(make_model(len(tok)), script, tok.convert_tokens_to_ids("<|return|>"))
    engine = Engine(model, tok)
    session = ChatSession(engine, ChatConfig(sampling=SamplingConfig(temperature=0.0, max_new_tokens=80)))
    return session, tok, model


def test_a_chat_goes_on_past_the_analysis_and_drops_it_from_the_history(harmony_session, monkeypatch):
    session, tok, model = harmony_session
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|end|>", "<|return|>", "<|call|>")}
    assert ids["<|return|>"] in session.stop_ids and ids["<|call|>"] in session.stop_ids
    assert ids["<|end|>"] not in session.stop_ids
    chunks = list(session.send("Hi!"))
    # the answer went on through <|end|> to the final message, and stopped at <|return|>
    assert "".join(c.text for c in chunks) == STREAM
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stats.thinking_tokens == len(
        tok.encode(f"<|message|>{THOUGHT}<|end|>", add_special_tokens=False)
    )
    assert_ids_match_text(session)
    fed = []
    generate = session.engine.generate

    def seen_generate(kv, new_ids, *args, **kwargs):
        fed.append(list(kv.seen) + list(new_ids))
        return generate(kv, new_ids, *args, **kwargs)

    monkeypatch.setattr(session.engine, "generate", seen_generate)
    assert "".join(c.text for c in session.send("Again?")) == SECOND
    # the second prompt is gpt-oss's template's rendering, with the first answer's final
    # message alone: what the model reads is what the template writes
    reference = tok.apply_chat_template(
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": "Again?"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(fed[0]) == reference and THOUGHT not in reference
    assert reference.endswith("<|start|>assistant")
    assert_ids_match_text(session)
    session.undo()  # undo and retry cut the cache back to the turn
    assert_ids_match_text(session)
    model.turn = 0  # the retry answers the second script again
    assert "".join(c.text for c in session.send("Again?")) == SECOND
    assert_ids_match_text(session)


def test_serve_sends_the_analysis_as_reasoning_content():
    import threading

    from chatbot.engine.chunk import GenerationChunk
    from chatbot.server.worker import _stream

    class Job:
        conversation = object()
        tools = None
        cancel = threading.Event()

        def __init__(self) -> None:
            self.events: list = []

        def emit(self, event) -> None:
            self.events.append(event)

    tok = make_harmony_tokenizer()
    ids = tok.encode(STREAM, add_special_tokens=False)
    # one chunk per token, as the engine streams them (its text decoded with the control tokens)
    chunks = [GenerationChunk(tok.decode([i]), (i,)) for i in ids[:-1]]
    from chatbot.engine.stats import TurnStats

    chunks.append(GenerationChunk(tok.decode(ids[-1:]), (ids[-1],), "stop", TurnStats()))
    job = Job()
    _stream(job, (c for c in chunks), None, 0, opened=lambda: opens_thinking("<|start|>assistant"))
    content = "".join(e[1][0] for e in job.events if e[0] == "text")
    reasoning = "".join(e[1][3] for e in job.events if e[0] == "text")
    assert (reasoning, content) == (THOUGHT, ANSWER)


# -- the CLI ------------------------------------------------------------------------------------


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def scripted(tmp_path, env, stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    files = []
    for i, text in enumerate((STREAM, SECOND)):
        files.append(tmp_path / f"answer{i}.md")
        files[-1].write_text(text, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(SCRIPTED), *map(str, files), "--harmony", *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=300,
    )


def test_a_one_shot_and_a_pipe_print_the_final_channel_alone(tmp_path, env):
    once = scripted(tmp_path, env, "", "--prompt", "Hi!")
    assert once.returncode == 0, once.stderr
    assert once.stdout == ANSWER + "\n"
    assert "thought " in once.stderr.splitlines()[-1]
    piped = scripted(tmp_path, env, "Hi!\nAgain?\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == f"{ANSWER}\nStill here.\n"
    assert "<|" not in piped.stderr and THOUGHT not in piped.stderr


def test_the_repl_shows_the_analysis_dimmed_then_folded(tmp_path, terminals):
    pytest.importorskip("pyte")
    from test_screen import send, start
    from test_screen_thinking import folded_lines, is_dim

    thought = "\n".join(f"Pondering step {i} of the greeting." for i in range(1, 9))
    stream = STREAM.replace(THOUGHT, thought)
    term = start(tmp_path, [stream, SECOND], 80, 24, 0.03, "--harmony")
    terminals.append(term)
    term.type("Hi!\r")
    term.wait_text("Pondering step 3")
    assert is_dim(term, "Pondering")
    term.wait_prompt(120)
    lines = term.lines()
    assert not [line for line in lines if "Pondering" in line or "<|" in line], "\n".join(lines)
    assert len(folded_lines(lines)) == 1 and ANSWER in "\n".join(lines), "\n".join(lines)
    send(term, "/thinking")
    assert "Pondering step 8 of the greeting." in "\n".join(term.lines())


def test_the_tiny_gpt_oss_file_chats_in_harmony(tmp_path, env, one_thread):
    from chatbot.models.loader import load_model
    from chatbot.models.templates import answer_stops
    from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf

    path = tmp_path / "gpt-oss.gguf"
    write_synthetic_gguf(path, "gpt-oss", SHAPES["gpt-oss"]["tiny"], "Q8_0", seed=3)
    loaded = load_model(str(path))
    tok = loaded.tokenizer
    stops, _ = answer_stops(tok, loaded.model, loaded.template)
    assert {tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")} <= set(stops)
    assert tok.convert_tokens_to_ids("<|end|>") not in stops
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|start|>system<|message|>")
    assert opens_thinking(prompt) == "<|start|>assistant"
    base = [CHATBOT, "run", "--model", str(path), "--greedy", "--max-new-tokens", "6"]
    run = {"capture_output": True, "text": True, "env": env, "timeout": 300}
    once = subprocess.run([*base, "Hi!"], stdin=subprocess.DEVNULL, check=False, **run)
    assert once.returncode == 0, once.stderr
    piped = subprocess.run(base, input="Hi!\nAgain?\n", check=False, **run)
    assert piped.returncode == 0, piped.stderr
    # the random model writes no harmony: its tokens are plain answer text, no control token
    assert once.stdout.strip() and "<|" not in once.stdout and "<|" not in piped.stdout
    assert len(piped.stderr.strip().splitlines()) == 2  # two answers, one stats line each


def test_a_thinking_budget_ends_the_analysis_and_opens_the_final_message():
    from chatbot.conversation.thinking import CLOSING, ThinkingBudget

    tok = make_harmony_tokenizer()
    budget = ThinkingBudget(
        4,
        "<|start|>assistant",
        lambda text: tok.encode(text, add_special_tokens=False),
        lambda i: tok.decode([i]),
    )
    assert budget(None) == []  # the model opens the analysis itself
    inserted = []
    for token in tok.encode(STREAM, add_special_tokens=False):
        inserted = budget(token)
        if inserted:
            break
    closing = tok.decode(inserted)
    assert closing == CLOSING + "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert split_harmony(STREAM[: STREAM.index(THOUGHT) + 5] + closing + ANSWER)[1] == ANSWER


def test_a_continued_answer_is_read_from_the_channel_it_stopped_in(harmony_session):
    """/continue after the token limit cut the analysis: the rest of the thinking is still
    thinking and the final message the answer (the splitter starts where the answer was)."""
    from chatbot.config import SamplingConfig

    session, tok, _ = harmony_session
    head = "<|channel|>analysis<|message|>The user"
    cut = len(tok.encode(head, add_special_tokens=False))
    first = "".join(c.text for c in session.send("Hi!", SamplingConfig(temperature=0.0, max_new_tokens=cut)))
    assert first == head
    rest = list(session.continue_answer(SamplingConfig(temperature=0.0, max_new_tokens=80)))
    assert first + "".join(c.text for c in rest) == STREAM
    splitter = splitter_for(session.thinking_opened)
    parts = [p for c in rest for p in splitter.feed(c.text)] + splitter.flush()
    assert "".join(p for p, t in parts if t) == THOUGHT[len("The user") :]
    assert "".join(p for p, t in parts if not t) == ANSWER
    assert_ids_match_text(session)
