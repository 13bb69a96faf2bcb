"""Slash-command parsing and completion: pure functions, no model."""

from __future__ import annotations

import pytest

from chatbot.config import SamplingConfig
from chatbot.errors import ChatbotError, CommandError, ConfigError
from chatbot.terminal.commands import (
    COMMANDS,
    Command,
    complete,
    help_text,
    is_command,
    parse_command,
    settings_text,
)


def test_every_command_parses_and_is_documented():
    for name, spec in COMMANDS.items():
        line = f"/{name} x" if spec.required else f"/{name}"
        assert parse_command(line).name == name
        assert spec.usage.startswith(f"/{name}") and spec.usage in help_text()


@pytest.mark.parametrize(
    "line,name",
    [
        ("/quit", "exit"),
        ("/q", "exit"),
        ("/EXIT", "exit"),
        ("  /help  ", "help"),
        ("/?", "help"),
        ("/clear", "reset"),
        ("/regenerate", "retry"),
        ("/cont", "continue"),
    ],
)
def test_aliases(line, name):
    assert parse_command(line).name == name


def test_is_command():
    assert is_command("/help") and not is_command("//etc/passwd is a path") and not is_command("hi /x")


@pytest.mark.parametrize(
    "line,hint",
    [
        ("/hepl", "did you mean /help?"),
        ("/sytem You are", "did you mean /system?"),
        ("/rety", "did you mean /retry?"),
        ("/xyzzy", "/help lists them"),
        ("/", "/help lists them"),
    ],
)
def test_unknown_command_suggests_the_nearest(line, hint):
    with pytest.raises(CommandError, match="unknown command") as exc:
        parse_command(line)
    assert hint in str(exc.value)


def test_arguments_where_none_or_some_are_expected():
    with pytest.raises(CommandError, match="takes no argument"):
        parse_command("/undo now")
    with pytest.raises(CommandError, match="needs an argument"):
        parse_command("/load")
    assert parse_command("/save").arg == ""
    assert parse_command("/save  ~/my chat.json ").arg == "~/my chat.json"
    assert parse_command("/system   Be brief.  Really. ").arg == "Be brief.  Really."


def test_set_parses_into_values():
    assert parse_command("/set") == Command("set", "", {})
    assert parse_command("/set temperature 0.5").values == {"temperature": 0.5}
    assert parse_command("/set temp 0").values == {"temperature": 0.0}
    assert parse_command("/set top-k 20 max 64").values == {"top_k": 20, "max_new_tokens": 64}
    assert parse_command("/set top_p=0.8 seed=7").values == {"top_p": 0.8, "seed": 7}
    assert parse_command("/set seed none").values == {"seed": None}
    assert parse_command("/set Repetition_Penalty 1.2").values == {"repetition_penalty": 1.2}


def test_set_takes_both_forms_mixed():
    """`/set name value` and `/set name=value` are both documented: one command may mix them."""
    assert parse_command("/set seed none max_new_tokens=120").values == {"seed": None, "max_new_tokens": 120}
    assert parse_command("/set top_p=0.8 temp 0 k=5").values == {"top_p": 0.8, "temperature": 0.0, "top_k": 5}


@pytest.mark.parametrize(
    "line,message",
    [
        ("/set seed 3 top_k=-1", "top_k must be an integer ≥ 0"),
        ("/set seed max=5", "/set seed needs a value"),
    ],
)
def test_a_mixed_set_with_one_bad_word_changes_nothing(line, message):
    """The whole command is parsed before anything is applied: one bad word refuses it all."""
    with pytest.raises(ChatbotError, match=message):
        parse_command(line)


@pytest.mark.parametrize(
    "line,message",
    [
        ("/set temperature", "needs a value"),
        ("/set temperature hot", "temperature must be a number ≥ 0 and ≤ 100, got 'hot'"),
        ("/set temperature -1", "≥ 0"),
        ("/set temperature nan", "temperature must be"),
        ("/set temperature inf", "temperature must be"),
        ("/set top_p 0", "top_p must be a number > 0 and ≤ 1"),
        ("/set top_k 2.5", "top_k must be an integer"),
        ("/set max_new_tokens 0", "max_new_tokens must be an integer ≥ 1"),
        ("/set max_new_tokens 1e99", "max_new_tokens"),
        ("/set tempurature 1", "did you mean temperature?"),
        ("/set colour blue", "settings: temperature, top_p"),
        ("/set \x00\x01 \udcff", "unknown setting"),
        ("/set a=", "expected KEY=VALUE"),
        ("/retry temperature", "expected KEY=VALUE"),
        ("/retry bogus=1", "unknown setting"),
        ("/retry top_k=-3", "top_k must be an integer ≥ 0"),
    ],
)
def test_bad_settings_are_rejected_with_the_allowed_range(line, message):
    with pytest.raises(ChatbotError) as exc:
        parse_command(line)
    assert isinstance(exc.value, (CommandError, ConfigError))
    assert message in str(exc.value)


def test_retry_overrides():
    assert parse_command("/retry").values == {}
    assert parse_command("/retry temperature=1.2 seed=3").values == {"temperature": 1.2, "seed": 3}


def test_completion_of_commands_and_settings():
    names, start, kind = complete("/re")
    assert names == ["/reset", "/retry"] and start == 0 and kind is None
    assert complete("/")[0] == [f"/{n}" for n in COMMANDS]
    assert complete("/set te") == (["temperature"], 5, None)
    assert complete("/set ")[0] == [*SamplingConfig.RANGES, "format"]
    assert complete("/set temperature ")[0] == []
    assert complete("/set seed n") == (["none"], 10, None)
    assert complete("/set temperature 0.5 top")[0] == ["top_p", "top_k"]
    assert complete("/retry top")[0] == ["top_p=", "top_k="]
    assert complete("/retry top_k=")[0] == []
    assert complete("/load ~/ch")[2] == "path" and complete("/load ~/ch")[1] == len("/load ")
    assert complete("/system --c")[0] == ["--clear"]
    assert complete("/undo ")[0] == [] and complete("hello")[0] == [] and complete("/nope x")[0] == []


def test_settings_text_lists_values_and_ranges():
    text = settings_text(SamplingConfig(temperature=0.3, seed=None))
    for key in SamplingConfig.RANGES:
        assert key in text
    assert "0.3" in text and "random" in text and "≤ 100" in text
