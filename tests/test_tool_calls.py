"""Function calling (issue 39, part 3): `tools` rendered through the chat template, calls read
back from the answer (Hermes / Qwen, Llama 3.1, Mistral forms), a call forced by the grammar
with `tool_choice` "required" or a named function, `tool` results accepted back.

The official `openai` client against real `chatbot serve` processes: the tiny random Llama
given a Qwen-style template that renders tools, and the default model, whose template does not.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_helpers import running_server, save_tiny_model

from chatbot.server.tools import CallStream, parse_calls

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
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
# Qwen2.5's way of rendering tools, cut down: the functions in the system turn, calls in
# <tool_call> tags, results as tool turns.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- reading calls (no model) --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        (
            'Let me see.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
            "\n</tool_call>"
        ),
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}',
    ],
)
def test_calls_are_read_in_each_form(text):
    content, calls = parse_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})
    ]
    assert content == ("Let me see." if text.startswith("Let") else None)


def test_text_that_is_no_call_stays_text():
    for text in ("It is sunny.", '{"city": "Paris"}', "<tool_call> not json"):
        assert parse_calls(text) == (text, [])


def test_a_stream_holds_back_what_may_be_a_call():
    stream = CallStream()
    shown = [
        stream.feed(p) for p in ("Sure. ", "<tool", '_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    ]
    assert shown == ["Sure. ", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["add"]
    plain = CallStream()
    assert plain.feed("Hello <") == "Hello " and plain.feed("b") == "<b" and plain.finish() == ("", [])


# -- a template that renders tools (the tiny model) -------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    with running_server("--model", str(folder), "--served-model-name", "tiny") as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def _check_call(call, name=None):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in spec and (name is None or call.function.name == name)
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_call_is_a_valid_call(tiny, choice):
    name = None if choice == "required" else "add"
    for seed in range(3):
        r = tiny.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )
        (call,) = r.choices[0].message.tool_calls
        _check_call(call, name)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


def test_a_forced_call_streams_as_a_tool_calls_delta(tiny):
    calls, finish, text = [], None, ""
    for chunk in tiny.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        stream=True,
        temperature=0,
    ):
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == "" and finish == "tool_calls" and len(calls) == 1
    _check_call(calls[0])


def test_auto_answers_and_tool_results_come_back(tiny):
    r = tiny.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"  # babble, no call
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    back = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]  # fmt: skip
    r = tiny.chat.completions.create(model="tiny", messages=back, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > 40  # the tools, the call and its result were rendered


def test_bad_tools_are_a_400_naming_the_field(tiny):
    for kw, param in (
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            tiny.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **kw)
        assert caught.value.body["param"] == param, caught.value.body


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "function": "add"},
        {"type": "function", "function": None},
        {"type": "function", "function": {"name": ["add"]}},
        {"type": "retrieval", "function": {"name": "add"}},
        "add",
        5,
    ],
)
def test_a_malformed_tool_choice_is_a_400_in_one_line(tiny, choice):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=4, extra_body={"tool_choice": choice}
        )
    error = caught.value.body
    assert error["param"] == "tool_choice" and "\n" not in error["message"], error
    assert error["message"].startswith("tool_choice: must be"), error


def test_a_null_tool_choice_is_the_default(tiny):
    """As OpenAI reads it: auto with tools, none without."""
    for tools in (TOOLS, None):
        kw = {"tools": tools} if tools else {}
        r = tiny.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=4, temperature=0, extra_body={"tool_choice": None}, **kw
        )
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_no_arguments_can_satisfy_is_a_400_naming_tools(tiny, stream):
    """`{"$ref": "#"}` is the parameters schema itself: no value satisfies it, refused before
    decoding as the same schema is under response_format."""
    tools = [{"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}}]
    for choice in ("required", {"type": "function", "function": {"name": "loop"}}):
        with pytest.raises(openai.BadRequestError) as caught:
            tiny.chat.completions.create(
                model="tiny", messages=ASK, tools=tools, tool_choice=choice, max_tokens=40, stream=stream
            )
        error = caught.value.body
        assert error["param"] == "tools" and "no JSON value satisfies it" in error["message"], error


def test_a_forced_call_reads_the_parameters_refs_against_the_parameters(tiny):
    """A `#/$defs/...` ref (as pydantic writes them) means the parameters schema's own `$defs`,
    not the object the call is wrapped in."""
    parameters = {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
        "additionalProperties": False,
        "$defs": {"Unit": {"enum": ["C", "F"]}},
    }
    tools = [{"type": "function", "function": {"name": "unit", "parameters": parameters}}]
    r = tiny.chat.completions.create(
        model="tiny", messages=ASK, tools=tools, tool_choice="required", max_tokens=80, temperature=0
    )
    assert r.choices[0].message.tool_calls, r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "unit"
    jsonschema.validate(json.loads(call.function.arguments), parameters)


# -- a template that does not render tools (the default model) --------------------------------------


@pytest.mark.slow
def test_the_default_model_refuses_auto_tools_but_makes_a_forced_call():
    with running_server() as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        kw = {"model": "SmolLM2-135M-Instruct", "messages": ASK, "tools": TOOLS, "max_tokens": 60}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**kw)
        assert caught.value.body["param"] == "tools" and "required" in caught.value.body["message"]
        r = client.chat.completions.create(
            **kw, tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
        (call,) = r.choices[0].message.tool_calls
        _check_call(call, "get_weather")
