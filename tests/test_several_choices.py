"""`n` > 1 (issue 39, part 2): several answers to one prompt, one after another from its cache
(the prompt is prefilled once; each next answer starts from the cache cut back to it).

The official `openai` client against real `chatbot serve` processes: the tiny random Llama
(its answers never end by themselves: they run to max_tokens) and the default model.
"""

from __future__ import annotations

import json

import openai
import pytest
from serve_helpers import running_server, save_tiny_model

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    with running_server("--model", str(folder), "--served-model-name", "tiny") as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def _streamed(client, **kw) -> tuple[dict[int, str], dict[int, str], object]:
    """(text by choice, finish reason by choice, the usage) of a streamed request."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, usage


def test_three_greedy_choices_are_equal(tiny):
    one = tiny.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    r = tiny.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert texts == [one.choices[0].message.content] * 3  # and each is the answer n=1 gives
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == one.usage.prompt_tokens
    streamed, finishes, usage = _streamed(
        tiny, model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, n=3
    )
    assert streamed == dict(enumerate(texts)) and finishes == dict.fromkeys(range(3), "length")
    assert usage.completion_tokens == 36


def test_sampled_choices_differ_and_a_seed_repeats_them(tiny):
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0, "n": 3, "seed": 7}
    first = [c.message.content for c in tiny.chat.completions.create(**kw).choices]
    assert len(set(first)) == 3
    assert [c.message.content for c in tiny.chat.completions.create(**kw).choices] == first


def test_completions_take_n_too(tiny):
    r = tiny.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1 and r.usage.completion_tokens == 24


def test_n_is_refused_where_it_cannot_be_done(tiny):
    for kw, param in (
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        (
            {
                "n": 2,
                "messages": [*MESSAGES, {"role": "assistant", "content": "Hi"}],
                "extra_body": {"continue_final_message": True},
            },
            "n",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            tiny.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kw})
        assert caught.value.body["param"] == param, caught.value.body


@pytest.mark.slow
def test_n_on_the_default_model_with_a_schema(tmp_path_factory):
    """Three greedy answers of the default model are one answer three times; three sampled
    ones under a schema each satisfy it."""
    schema = {
        "type": "object",
        "properties": {
            "animal": {"enum": ["cat", "dog", "owl"]},
            "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        },
        "required": ["animal", "legs"],
        "additionalProperties": False,
    }
    with running_server() as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "Name an animal and its number of legs, as JSON."}]
        kw = {"model": "SmolLM2-135M-Instruct", "messages": ask, "max_tokens": 40}
        r = client.chat.completions.create(**kw, temperature=0, n=3)
        assert len({c.message.content for c in r.choices}) == 1 and len(r.choices) == 3
        response_format = {"type": "json_schema", "json_schema": {"name": "animal", "schema": schema}}
        texts, finishes, _ = _streamed(client, **kw, temperature=1.0, n=3, response_format=response_format)
        for i in range(3):
            value = json.loads(texts[i])
            assert value["animal"] in ("cat", "dog", "owl") and 0 <= value["legs"] <= 8
            assert finishes[i] == "stop"
