"""Issue 62: a thinking model's thinking kept apart from its answer. Into a pipe or a one-shot
run, stdout carries the answer alone (the thinking goes to stderr with --show-thinking), for
thinking in `<think>` tags and for a server's `reasoning_content`; the stats count it apart.

The servers are the loopback stand-in of test_remote_clients.py; the local model is the tiny
random one under a template that opens `<think>` in its generation prompt.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from serve_helpers import CHATBOT
from test_remote_clients import FakeServer

from chatbot.conversation.thinking import ThinkingMeter, ThinkingSplitter, opens_thinking

THOUGHT = "The user greets me. I should greet them back."
ANSWER = "Hello there, how can I help?"


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "COLUMNS": "200"}


@pytest.fixture
def tagged():
    """A server whose model thinks in tags, inside `content`."""
    server = FakeServer()
    server.story = f"<think>{THOUGHT}</think>\n\n{ANSWER}"
    yield server
    server.close()


@pytest.fixture
def reasoning():
    """A server that sends the thinking apart, in `reasoning_content` deltas (vLLM, SGLang)."""
    server = FakeServer()
    server.story = ANSWER
    server.reasoning = THOUGHT
    yield server
    server.close()


def one_shot(url: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CHATBOT, "run", "--server", url, *flags, "Hi!"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("kind", ["tagged", "reasoning"])
def test_a_one_shot_from_a_thinking_server_prints_the_answer_alone(kind, env, request):
    server = request.getfixturevalue(kind)
    proc = one_shot(server.url, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ANSWER + "\n"
    assert "greets" not in proc.stderr  # not asked for
    # the stats line counts the thinking apart: 9 chunks of thinking, 6 of answer
    stats = proc.stderr.splitlines()[-1]
    assert "thought 9 tok · " in stats and " · 6 tok (estimated)" in stats, stats

    shown = one_shot(server.url, env, "--show-thinking")
    assert shown.returncode == 0 and shown.stdout == ANSWER + "\n", shown.stderr
    assert THOUGHT in shown.stderr and "<think>" not in shown.stderr


def test_a_piped_chat_with_a_thinking_server_prints_the_answers_alone(tagged, env):
    proc = subprocess.run(
        [CHATBOT, "run", "--server", tagged.url],
        input="Hi!\nAnd again?\n",
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{ANSWER}\n{ANSWER}\n"


# -- the splitter, alone ----------------------------------------------------------------------


def split_all(pieces: list[str], opened: str | None = None) -> tuple[str, str]:
    splitter = ThinkingSplitter(opened)
    parts = [p for piece in pieces for p in splitter.feed(piece)] + splitter.flush()
    return "".join(t for t, th in parts if th), "".join(t for t, th in parts if not th)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_the_splitter_finds_tags_cut_anywhere(size):
    text = f"\n<think>{THOUGHT}</think>\n\n{ANSWER} <think>is text here</think>"
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    assert split_all(pieces) == (THOUGHT, f"\n\n{ANSWER} <think>is text here</think>")
    # the template opened the tag: the answer starts inside it
    opened = f"{THOUGHT}</think>{ANSWER}"
    assert split_all([opened[i : i + size] for i in range(0, len(opened), size)], "<think>") == (
        THOUGHT,
        ANSWER,
    )
    # no thinking at all; a tag after the answer began is text
    assert split_all([ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]) == ("", ANSWER)


def test_opens_thinking_reads_the_prompts_end():
    assert opens_thinking("<|im_start|>assistant\n<think>\n") == "<think>"
    assert opens_thinking("<think>\n\n</think>\n\n") is None
    assert opens_thinking("<|im_start|>assistant\n") is None


def test_the_meter_counts_the_thinking_tokens():
    meter = ThinkingMeter()
    for text in ["<think>", "a", " b", "</think>", "\n\nAn", "swer"]:
        meter.add(text, 1)
    assert meter.tokens == 4


# -- a local model under a template that opens <think> ------------------------------------------

THINK_TEMPLATE = (  # ChatML whose generation prompt opens <think> (DeepSeek-R1's distills do so)
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


MODEL = "thinking-tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from serve_helpers import save_tiny_model

    # served by the folder's name: one of its own, not a counter shared with other modules
    return str(save_tiny_model(tmp_path_factory.mktemp(MODEL, numbered=False)))


@pytest.fixture
def think_template(tmp_path) -> str:
    path = tmp_path / "think.jinja"
    path.write_text(THINK_TEMPLATE)
    return str(path)


def local(env, tiny, template, *flags):
    return subprocess.run(
        [CHATBOT, "run", "--model", tiny, "--template", template, "--greedy", *flags, "Hi!"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=300,
    )


def test_a_one_shot_on_a_model_that_thinks_keeps_the_thinking_off_stdout(env, tiny, think_template):
    # the random model never closes its thinking: all 12 tokens are thought, none answer
    proc = local(env, tiny, think_template, "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
    stats = proc.stderr.splitlines()[-1]
    assert "thought 12 tok · " in stats and " · 0 tok · " in stats, stats
    shown = local(env, tiny, think_template, "--max-new-tokens", "12", "--show-thinking")
    assert shown.returncode == 0 and shown.stdout.strip() == ""
    thought = shown.stderr.splitlines()[0]
    assert len(thought) > 12 and "thought 12 tok" in shown.stderr, shown.stderr


SWITCH_TEMPLATE = (  # Qwen3-style: enable_thinking (on by default) opens <think>, off closes it at once
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture
def switch_template(tmp_path) -> str:
    path = tmp_path / "switch.jinja"
    path.write_text(SWITCH_TEMPLATE)
    return str(path)


def test_think_off_renders_the_template_with_enable_thinking_false(env, tiny, switch_template):
    on = local(env, tiny, switch_template, "--max-new-tokens", "6")
    assert on.returncode == 0 and on.stdout.strip() == "", on.stderr
    assert "thought 6 tok" in on.stderr
    off = local(env, tiny, switch_template, "--max-new-tokens", "6", "--think", "off")
    assert off.returncode == 0 and off.stdout.strip(), off.stderr
    assert "thought" not in off.stderr


def test_think_on_a_template_without_a_switch_says_so_in_one_line(env, tiny, think_template):
    proc = local(env, tiny, think_template, "--max-new-tokens", "2", "--think", "off")
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "no thinking switch" in line]
    assert len(notes) == 1 and notes[0].startswith("think off: "), proc.stderr
    bad = local(env, tiny, think_template, "--think", "maybe")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "chatbot: error: think must be one of on, off, low, medium, high, got 'maybe'"
    ], bad.stderr


def test_the_template_kwargs_of_each_switch():
    from chatbot.models.templates import thinking_kwargs, thinking_switch

    assert thinking_switch(SWITCH_TEMPLATE) == "enable_thinking"
    assert thinking_switch(THINK_TEMPLATE) is None
    assert thinking_switch("{{ reasoning_effort | default('medium') }}") == "reasoning_effort"
    assert thinking_kwargs("off", "enable_thinking") == {"enable_thinking": False}
    assert thinking_kwargs("high", "enable_thinking") == {"enable_thinking": True}
    assert thinking_kwargs("high", "reasoning_effort") == {"reasoning_effort": "high"}
    assert thinking_kwargs(None, "enable_thinking") == {}


# -- a thinking budget ------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, 8])
def test_a_thinking_budget_closes_the_thinking_and_the_model_answers(env, tiny, think_template, budget):
    # the random model never closes its thinking itself: without a budget nothing is answered
    proc = local(env, tiny, think_template, "--max-new-tokens", "60", "--think-budget", str(budget))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "<think>" not in proc.stdout and "</think>" not in proc.stdout
    stats = proc.stderr.splitlines()[-1]
    thought = int(stats.split("thought ")[1].split(" tok")[0])
    answered = int(stats.split(" · ")[5].split(" tok")[0])
    assert thought + answered == 60 and answered > 0, stats
    # its 8 tokens, then the closing sentence and the tag (about 40 of this tiny vocabulary's
    # tokens); with 0, only the tag that closes what the template opened
    assert 8 < thought < 60 if budget else thought <= 8, stats


def test_a_thinking_budget_in_the_session(tiny_engine, tmp_path, monkeypatch):
    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession

    # the tokenizer is the session's (a fixture shared by every test): set back after this one
    monkeypatch.setattr(tiny_engine.tokenizer, "chat_template", THINK_TEMPLATE)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=80, think_budget=5)
    session = ChatSession(tiny_engine, ChatConfig(sampling=sampling))
    text = "".join(c.text for c in session.send("Hi!"))
    head, sep, _ = text.partition("</think>")
    assert sep and "time to answer." in head, text
    assert session.turns[-1].stats.thinking_tokens > 5
    # the closing text went through the cache as answer tokens: the conversation renders back
    assert session.decode(session.all_ids) == session.rendered


DROPPING_TEMPLATES = {
    # Qwen3's way: the thinking of answers before the last user message is left out
    "qwen3": (
        "{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
        "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
        "{%- for m in messages -%}{%- set c = m['content'] -%}"
        "{%- if m['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in c -%}"
        "{%- set c = c.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
        "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n<think>\n{%- endif -%}"
    ),
    # DeepSeek-R1's distills: every answer in the history without its thinking
    "r1": (
        "{%- for m in messages -%}{%- set c = m['content'] -%}"
        "{%- if m['role'] == 'assistant' and '</think>' in c -%}"
        "{%- set c = c.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
        "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n<think>\n{%- endif -%}"
    ),
}


@pytest.mark.parametrize("style", sorted(DROPPING_TEMPLATES))
def test_a_template_that_drops_earlier_thinking_re_encodes_only_what_changed(
    tiny_engine, tiny_model, monkeypatch, style
):
    """The next turn's rendering leaves the last answer's thinking out: the cache is cut
    where the rendered history changes and only the rest is encoded again (before, the
    whole conversation was); the next answer is the one a full recompute gives."""
    from helpers import assert_ids_match_text, greedy_by_recompute

    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession

    monkeypatch.setattr(tiny_engine.tokenizer, "chat_template", DROPPING_TEMPLATES[style])
    thinking = SamplingConfig(temperature=0.0, max_new_tokens=60, think_budget=4)
    session = ChatSession(tiny_engine, ChatConfig(sampling=thinking))
    first = "Hello there! How are you today? " * 3
    assert "</think>" in "".join(c.text for c in session.send(first))
    before = session.all_ids
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=6)
    generate, fed = tiny_engine.generate, []

    def seen_generate(kv, new_ids, *args, **kwargs):
        fed.append((list(kv.seen), list(new_ids)))  # what the cache holds, what is fed
        return generate(kv, new_ids, *args, **kwargs)

    monkeypatch.setattr(tiny_engine, "generate", seen_generate)
    answer = [i for c in session.send("And the quick brown fox?", sampling) for i in c.token_ids]
    assert "</think>" not in session.render(session.messages(), False).split("And the quick")[0]
    # the prompt reads as the template renders the conversation now
    ((kept, new),) = fed
    prompt = kept + new
    assert session.decode(prompt) == session.render(session.messages()[:-1], True)
    # the first message stayed in the cache; only what follows the change is encoded again
    assert kept == before[: len(kept)] and len(kept) > len(session.encode(first))
    assert session.turns[-1].stats.context_tokens == len(new) < len(prompt) // 2
    assert answer == greedy_by_recompute(tiny_model, prompt, len(answer))
    assert_ids_match_text(session)
    # undo and retry still cut the cache back to the new turn
    session.undo()
    assert_ids_match_text(session)


# -- serve ------------------------------------------------------------------------------------


def test_serve_sends_the_thinking_apart_as_reasoning_content(tiny, think_template, tmp_path):
    from openai import OpenAI
    from serve_helpers import running_server

    args = ("--model", tiny, "--template", think_template, "--think-budget", "8")
    with running_server(*args, log=tmp_path / "serve.log") as url:
        client = OpenAI(base_url=url, api_key="none")
        messages = [{"role": "user", "content": "Hi!"}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0)
        message = reply.choices[0].message
        thought = getattr(message, "reasoning_content", None)
        assert thought and "time to answer." in thought, message
        assert message.content and "<think>" not in message.content and "</think>" not in message.content
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=60, temperature=0, stream=True
        )
        parts: dict[str, str] = {"content": "", "reasoning_content": ""}
        for chunk in stream:
            for choice in chunk.choices:
                parts["content"] += choice.delta.content or ""
                parts["reasoning_content"] += getattr(choice.delta, "reasoning_content", None) or ""
        assert parts == {"content": message.content, "reasoning_content": thought}
        card = client.models.retrieve(MODEL).model_extra
        assert card["thinking"] == {"switch": None, "think_budget": 8}


def _ask(client, **kwargs) -> tuple[str, str]:
    """(reasoning_content, content) of a greedy answer to "Hi!"."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], temperature=0, **kwargs
    )
    message = reply.choices[0].message
    return getattr(message, "reasoning_content", None) or "", message.content or ""


def test_serve_takes_a_requests_budget_and_enable_thinking(tiny, switch_template, tmp_path):
    from openai import BadRequestError, OpenAI
    from serve_helpers import running_server

    with running_server("--model", tiny, "--template", switch_template, log=tmp_path / "serve.log") as url:
        client = OpenAI(base_url=url, api_key="none")
        card = client.models.list().data[0].model_extra
        assert card["thinking"] == {"switch": "enable_thinking", "think_budget": None}
        # the template thinks by default; the random model never closes it: all 6 tokens thought
        thought, content = _ask(client, max_tokens=6)
        assert thought and not content
        # a budget of this request's own closes it, and the model answers
        thought, content = _ask(client, max_tokens=60, extra_body={"think_budget": 8})
        assert "time to answer." in thought and content and "<think>" not in content
        # enable_thinking false: the template closes the thinking at once, all is answer
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        thought, content = _ask(client, max_tokens=6, extra_body=off)
        assert not thought and content and "think>" not in content
        # the next request without it thinks again (the kept session follows the request)
        thought, content = _ask(client, max_tokens=6)
        assert thought and not content
        with pytest.raises(BadRequestError) as bad:
            _ask(client, max_tokens=6, extra_body={"chat_template_kwargs": {"enable_thinking": "no"}})
        assert "chat_template_kwargs.enable_thinking must be true or false" in str(bad.value)


EFFORT_TEMPLATE = (  # harmony-like: reasoning_effort low skips the thinking
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if reasoning_effort is defined and reasoning_effort == 'low' %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def test_serve_takes_a_requests_reasoning_effort(tiny, tmp_path):
    from openai import BadRequestError, OpenAI
    from serve_helpers import running_server

    template = tmp_path / "effort.jinja"
    template.write_text(EFFORT_TEMPLATE)
    with running_server("--model", tiny, "--template", str(template), log=tmp_path / "serve.log") as url:
        client = OpenAI(base_url=url, api_key="none")
        thought, content = _ask(client, max_tokens=6, reasoning_effort="high")
        assert thought and not content
        thought, content = _ask(client, max_tokens=6, reasoning_effort="low")
        assert not thought and content
        thought, content = _ask(client, max_tokens=6, reasoning_effort="minimal")  # OpenAI's: low
        assert not thought and content
        with pytest.raises(BadRequestError) as bad:
            _ask(client, max_tokens=6, extra_body={"reasoning_effort": "extreme"})
        assert "reasoning_effort must be one of none, minimal, low, medium, high" in str(bad.value)
