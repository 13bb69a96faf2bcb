"""Issue 60: gpt-oss's tool calls. gpt-oss calls a function with a message addressed to it on the
commentary channel (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`,
which `<|call|>` ends); `chatbot serve` answers it as OpenAI's `tool_calls`, and the call and the
tool's result go back through gpt-oss's own template (OpenAI's, in devtools/data).

A tiny random model writes no calls: the answers are scripted (tests/scripted_chat.py's model,
which replays them token by token after its real forward pass), and served by the real app on
loopback to the official `openai` client; the tiny gpt-oss file is served by a real
`chatbot serve` for a forced call.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from helpers import make_harmony_tokenizer, make_model
from scripted_chat import ScriptedModel
from serve_helpers import free_port, running_server

from chatbot.conversation.harmony import HarmonySplitter
from chatbot.conversation.thinking import splitter_for

THOUGHT = "The user wants the weather. I should call get_weather."
ARGS = '{"city": "Paris", "unit": "C"}'
CALL = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"
STREAM = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant{CALL}"
FINAL = (
    "<|channel|>analysis<|message|>It is sunny.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>18 C and sunny."
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    }
]
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def split(pieces: list[str], calls_apart: bool = True) -> tuple[str, str, list[tuple[str, str]]]:
    splitter = splitter_for("<|start|>assistant", calls_apart)
    assert isinstance(splitter, HarmonySplitter)
    parts = [p for piece in pieces for p in splitter.feed(piece)] + splitter.flush()
    thinking = "".join(t for t, th in parts if th)
    return thinking, "".join(t for t, th in parts if not th), splitter.calls


# -- the splitter (no model) ---------------------------------------------------------------------


def test_a_call_is_kept_apart_cut_at_every_point():
    call_first = (
        f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}"  # as the template writes it
    )
    preamble = "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant" + CALL
    for text, expected in [
        (STREAM.removesuffix("<|call|>"), (THOUGHT, "", [("functions.get_weather", ARGS)])),
        (call_first, ("", "", [("functions.get_weather", ARGS)])),
        (preamble, ("", "Let me look.", [("functions.get_weather", ARGS)])),
        (FINAL, ("It is sunny.", "18 C and sunny.", [])),
        ("today it rains", ("", "today it rains", [])),  # plain text that begins as a recipient may
    ]:
        assert split([text]) == expected
        for i in range(len(text) + 1):
            assert split([text[:i], text[i:]]) == expected, (text, i)
        for size in (1, 3):
            assert split([text[i : i + size] for i in range(0, len(text), size)]) == expected


def test_without_calls_apart_a_call_is_answer_text_as_before():
    assert split([STREAM], calls_apart=False) == (THOUGHT, ARGS, [])


# -- the worker's reading of a streamed answer ------------------------------------------------------


def _streamed(text: str, tools: object) -> tuple[str, str, dict]:
    """`text` through the worker's `_stream`, one chunk per token as the engine sends them."""
    from chatbot.engine.chunk import GenerationChunk
    from chatbot.engine.stats import TurnStats
    from chatbot.server.worker import Job, _stream

    tok = make_harmony_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    chunks = [GenerationChunk(tok.decode([i]), (i,)) for i in ids[:-1]]
    stats = TurnStats()
    stats.finish_reason = "stop"
    chunks.append(GenerationChunk(tok.decode(ids[-1:]), (ids[-1],), "stop", stats))
    events: list = []
    job = Job(None, None, events.append, tools=tools)  # type: ignore[arg-type]
    _stream(job, (c for c in chunks), None, 0, opened=lambda: "<|start|>assistant")
    content = "".join(e[1][0] for e in events if e[0] == "text")
    reasoning = "".join(e[1][3] for e in events if e[0] == "text")
    return reasoning, content, job.calls


def test_the_worker_reads_the_call_of_an_answer_with_tools():
    from chatbot.server.tools import ToolCall, Tools

    tools = Tools.of(TOOLS, None)
    # the engine stops at <|call|> and leaves it out of the text
    reasoning, content, calls = _streamed(STREAM.removesuffix("<|call|>"), tools)
    assert (reasoning, content, calls) == (THOUGHT, "", {0: [ToolCall("get_weather", ARGS)]})
    assert _streamed(FINAL, tools) == ("It is sunny.", "18 C and sunny.", {})
    # without tools, as a chat without them: the call's message is answer text
    assert _streamed(STREAM.removesuffix("<|call|>"), None) == (THOUGHT, ARGS, {})


# -- the round trip through gpt-oss's template ---------------------------------------------------------


def _round_trip(thinking: bool) -> list:
    from chatbot.server.protocol import ChatMessage

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    said = {"reasoning_content": THOUGHT} if thinking else {}
    return [
        ChatMessage(**ASK[0]),
        ChatMessage(role="assistant", content=None, tool_calls=[call], **said),
        ChatMessage(role="tool", tool_call_id="call_1", content="18 C, sunny"),
    ]


def test_a_call_and_its_result_go_back_as_the_template_writes_them():
    from chatbot.server.tools import Tools, tool_prompt

    tok = make_harmony_tokenizer()
    prompt = tool_prompt(tok, _round_trip(thinking=True), Tools.of(TOOLS, None))
    assert "namespace functions {\n\n// The weather\ntype get_weather = (_: {" in prompt
    assert prompt.endswith(
        "<|start|>user<|message|>What is the weather in Paris?<|end|>"
        f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"  # kept: no final answer yet
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C, sunny"<|end|>'
        "<|start|>assistant"
    ), prompt[-600:]
    bare = Tools.of([{"type": "function", "function": {"name": "add", "parameters": ADD}}], None)
    assert "// \ntype add = (_: {" in tool_prompt(
        tok, _round_trip(thinking=False)[:1], bare
    )  # no description
    without = tool_prompt(tok, _round_trip(thinking=False), Tools.of(TOOLS, None))
    assert THOUGHT not in without and without.endswith(prompt[prompt.index("<|start|>assistant to=") :])


# -- the openai client against the app on loopback (scripted answers) ----------------------------------


class PromptsSeen(ScriptedModel):
    """The scripted model, keeping the ids of each prompt it was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []

    def __call__(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        ids = args[0] if ids is None else ids
        if ids.shape[-1] > 1:
            self.prompts.append(ids[0].tolist())
        return super().__call__(*args, **kwargs)


@contextlib.contextmanager
def scripted_server(answers: list[str]) -> Iterator[tuple[openai.OpenAI, PromptsSeen, object]]:
    """The app serving a scripted gpt-oss-like model on 127.0.0.1 (uvicorn in a thread): each
    request's prompt starts the next answer."""
    import uvicorn

    from chatbot.config import EngineConfig, SamplingConfig
    from chatbot.engine.generate import Engine
    from chatbot.server.app import create_app
    from chatbot.server.pool import PrefixCachePool

    tok = make_harmony_tokenizer()
    script = [tok.encode(a, add_special_tokens=False) for a in answers]
    model = PromptsSeen(
        make_model(len(tok), max_position_embeddings=4096), script, tok.convert_tokens_to_ids("<|return|>")
    )
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=400)
    pool = PrefixCachePool(Engine(model, tok), EngineConfig(prefill_chunk=4096), sampling)
    app = create_app(pool, "gpt-oss-scripted")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the app did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1"
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120), model, tok
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_call_is_answered_as_tool_calls(one_thread):
    with scripted_server([STREAM]) as (client, _, _):
        r = client.chat.completions.create(model="gpt-oss-scripted", messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", json.loads(ARGS))
    assert choice.message.model_extra["reasoning_content"] == THOUGHT


def test_a_streamed_call_comes_as_a_tool_calls_delta(one_thread):
    with scripted_server([STREAM]) as (client, _, _):
        stream = client.chat.completions.create(
            model="gpt-oss-scripted", messages=ASK, tools=TOOLS, stream=True
        )
        deltas, finish, text, thought = [], None, "", ""
        for chunk in stream:
            for choice in chunk.choices:
                deltas += choice.delta.tool_calls or []
                text += choice.delta.content or ""
                thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                finish = choice.finish_reason or finish
        # the SDK's stream helper puts the call together (the script's answer again)
        with client.chat.completions.stream(model="gpt-oss-scripted", messages=ASK, tools=TOOLS) as events:
            done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
            final = events.get_final_completion().choices[0]
    assert [(e.name, e.arguments) for e in done] == [("get_weather", ARGS)]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls[0].function.arguments == ARGS
    assert (text, thought, finish) == ("", THOUGHT, "tool_calls")
    (delta,) = deltas
    assert delta.index == 0 and delta.id.startswith("call_") and delta.type == "function"
    assert (delta.function.name, delta.function.arguments) == ("get_weather", ARGS)


def test_a_two_step_tool_conversation(one_thread):
    """The call as the client got it, and the tool's result, sent back: the model reads them as
    gpt-oss's template writes them, and answers on the final channel."""
    with scripted_server([STREAM, FINAL]) as (client, model, tok):
        first = client.chat.completions.create(model="gpt-oss-scripted", messages=ASK, tools=TOOLS)
        message = first.choices[0].message
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C, sunny"}
        back = [*ASK, message.model_dump(exclude_none=True), result]
        second = client.chat.completions.create(model="gpt-oss-scripted", messages=back, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert second.choices[0].message.content == "18 C and sunny."
    assert second.choices[0].message.model_extra["reasoning_content"] == "It is sunny."
    call = {"type": "function", "function": {"name": "get_weather", "arguments": json.loads(ARGS)}}
    records = [
        *ASK,
        {"role": "assistant", "content": "", "thinking": THOUGHT, "tool_calls": [call]},
        {"role": "tool", "content": "18 C, sunny"},
    ]
    reference = tok.apply_chat_template(records, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tok.decode(model.prompts[-1]) == reference
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary" in reference


def test_tool_choice_none_answers_in_words(one_thread):
    with scripted_server([FINAL]) as (client, _, _):
        r = client.chat.completions.create(
            model="gpt-oss-scripted", messages=ASK, tools=TOOLS, tool_choice="none"
        )
        assert r.choices[0].message.content == "18 C and sunny." and not r.choices[0].message.tool_calls
        assert r.choices[0].message.model_extra["reasoning_content"] == "It is sunny."


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_to_one_function_is_written_after_its_own_header(one_thread, choice):
    """Held to one function, gpt-oss is given its call's header, as it would write it, and the
    grammar holds what follows to the function's parameters."""
    header = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    with scripted_server([ARGS + "<|call|>"]) as (client, model, tok):
        r = client.chat.completions.create(
            model="gpt-oss-scripted", messages=ASK, tools=TOOLS, tool_choice=choice
        )
        assert tok.decode(model.prompts[-1]).endswith(header)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)


# -- the tiny gpt-oss file, served by `chatbot serve` -----------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss_file(tmp_path_factory):
    from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf

    path = tmp_path_factory.mktemp("gpt-oss") / "gpt-oss.gguf"
    write_synthetic_gguf(path, "gpt-oss", SHAPES["gpt-oss"]["tiny"], "Q8_0", seed=3)
    return path


def test_the_tiny_gpt_oss_file_makes_a_forced_call_and_reads_it_back(gpt_oss_file):
    """A random model calls nothing by itself: "required" and a named function hold it to a call
    (the grammar), which goes back with its result through the file's own template."""
    with running_server("--model", str(gpt_oss_file), "--served-model-name", "gpt-oss") as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        # two functions: "required" is held to the JSON of either (no header to give), a name
        # to its header and its parameters
        tools = [*TOOLS, {"type": "function", "function": {"name": "add", "parameters": ADD}}]
        kw = {"model": "gpt-oss", "messages": ASK, "tools": tools, "max_tokens": 60, "temperature": 0}
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = client.chat.completions.create(**kw, tool_choice=choice)
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
            assert call.function.name in ("get_weather", "add")
            schema = WEATHER if call.function.name == "get_weather" else ADD
            jsonschema.validate(json.loads(call.function.arguments), schema)
        assert call.function.name == "get_weather"
        deltas, finish = [], None
        for chunk in client.chat.completions.create(**kw, tool_choice="required", stream=True):
            for c in chunk.choices:
                deltas += c.delta.tool_calls or []
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and [d.function.name for d in deltas] == ["get_weather"]
        back = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]  # fmt: skip
        again = client.chat.completions.create(**{**kw, "messages": back, "max_tokens": 4})
        assert again.choices[0].finish_reason in ("stop", "length")
        assert again.usage.prompt_tokens > r.usage.prompt_tokens


def test_parallel_calls_go_to_the_template_one_call_each_its_result_after_it():
    """gpt-oss's template renders an assistant message's first call alone: two calls are two
    messages, each followed by its result (matched by `tool_call_id`, whatever their order)."""
    from chatbot.server.protocol import ChatMessage
    from chatbot.server.tools import Tools, tool_prompt

    def call(i: int, city: str) -> dict:
        arguments = json.dumps({"city": city, "unit": "C"})
        return {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }

    messages = [
        ChatMessage(**ASK[0]),
        ChatMessage(role="assistant", tool_calls=[call(1, "Paris"), call(2, "Oslo")]),
        ChatMessage(role="tool", tool_call_id="call_2", content="2 C"),
        ChatMessage(role="tool", tool_call_id="call_1", content="18 C"),
    ]
    prompt = tool_prompt(make_harmony_tokenizer(), messages, Tools.of(TOOLS, None))
    head = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    result = '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{}"<|end|>'
    assert prompt.endswith(
        f'{head}{{"city": "Paris", "unit": "C"}}<|call|>{result.format("18 C")}'
        f'{head}{{"city": "Oslo", "unit": "C"}}<|call|>{result.format("2 C")}<|start|>assistant'
    ), prompt[-500:]
