"""Structured outputs by constrained decoding (issue 39): `response_format` in `chatbot serve`,
`run --json-schema FILE`, `/set format json`.

The grammar engine is llguidance (`chatbot.engine.grammar`); the answers are checked with
`jsonschema`, an independent validator. Engine tests on the tiny random Llama; the HTTP tests
with the official `openai` client against a real `chatbot serve` of the default model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
from serve_helpers import running_server, save_tiny_model

from chatbot.config import FORMAT_KEY, OutputFormat, SamplingConfig
from chatbot.errors import ConfigError
from chatbot.terminal.commands import parse_command, settings_rows

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "colour": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "maxLength": 10},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "colour", "age", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, favourite colour, age and address."}]
UNENFORCEABLE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
# Schemas that pass llguidance's validation but that it cannot hold an answer to. No JSON value
# satisfies these two: it stops at once, allowing only the end of the answer.
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
SELF = {"$ref": "#"}
# Its lexer gives up on this pattern after some tokens (~15-70 on the tiny models); the `x{40}`
# end keeps a model from closing the string first.
GIVES_UP = {"type": "string", "pattern": "^(.{1,1000}){1,1000}$"}
GIVES_UP_LATE = {"type": "string", "pattern": "^(.{1,1000}){1,1000}x{40}$"}

ROOT = Path(__file__).resolve().parents[1]


# -- settings and flags (no model) --------------------------------------------------------------


def test_set_format_json_parses_and_lists():
    command = parse_command("/set format json")
    assert command.values == {FORMAT_KEY: "json"}
    sampling = SamplingConfig().with_value(FORMAT_KEY, "json")
    assert sampling.output_format == OutputFormat.json_object()
    assert sampling.with_value(FORMAT_KEY, "text").output_format is None
    rows = {key: value for key, value, _ in settings_rows(sampling)}
    assert rows[FORMAT_KEY] == "json"
    with pytest.raises(ConfigError, match="format must be text or json"):
        parse_command("/set format yaml")


def test_a_schema_file_becomes_the_response_format(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    fmt = OutputFormat.from_file(path)
    assert fmt.response_format() == {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON},
    }
    for text, match in (("[1, 2]", "not a schema object"), ("{nope", "is not JSON")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=match):
            OutputFormat.from_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        OutputFormat.from_file(tmp_path / "missing.json")


def test_plain_decoding_never_imports_the_grammar_engine(tmp_path):
    """A fresh interpreter generates without a format: llguidance stays unimported (and where it
    cannot be imported at all, asking for a format says how to install it)."""
    code = """
import sys
sys.modules["llguidance"] = None  # any import of it fails
from helpers import make_model, make_tokenizer
from chatbot.config import OutputFormat, SamplingConfig
from chatbot.engine.generate import Engine
tok = make_tokenizer()
engine = Engine(make_model(len(tok)), tok)
ids = tok("hello")["input_ids"]
chunks = list(engine.generate(engine.new_cache(), ids, SamplingConfig(max_new_tokens=4)))
assert chunks[-1].stats.generated_tokens == 4
try:
    list(engine.generate(engine.new_cache(), tok("hello")["input_ids"],
                         SamplingConfig(max_new_tokens=4, output_format=OutputFormat.json_object())))
except Exception as exc:
    print(type(exc).__name__, exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="tests", timeout=300, check=True
    )
    assert out.stdout.strip().startswith("GrammarError structured outputs need llguidance"), out
    # a command that installs it here (pip install 'chatbot[grammar]' took PyPI's unrelated chatbot)
    assert f"{sys.executable} -m pip install 'llguidance>=" in out.stdout, out.stdout


def test_the_grammar_engine_is_a_dependency_not_an_extra():
    """What the README offers (structured outputs, tools) works after its set-up, which
    installs the package's dependencies and no extra."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(req.startswith("llguidance") for req in project["dependencies"]), project["dependencies"]
    assert not any(
        req.startswith("llguidance") for extra in project["optional-dependencies"].values() for req in extra
    )


@pytest.mark.parametrize(
    "engine, said", [("here", "uniqueItems"), ("missing", "-m pip install 'llguidance>=")]
)
def test_json_schema_faults_come_before_the_model_loads(tmp_path, engine, said):
    """A schema the engine refuses, or no engine at all: one line and exit 2 before the model
    is even looked for (it does not exist here)."""
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(UNENFORCEABLE))
    block = "sys.modules['llguidance'] = None; " if engine == "missing" else ""
    code = f"import sys; {block}from chatbot.cli.app import main; main(sys.argv[1:])"
    out = subprocess.run(
        [sys.executable, "-c", code, "run", "--model", str(tmp_path / "no-such-model.gguf"),
         "--json-schema", str(path), "List ids."],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert said in lines[0] and "--json-schema" in lines[0] and "no-such-model" not in lines[0], lines


def test_set_format_json_is_refused_at_once_without_the_grammar_engine(tiny_engine, monkeypatch):
    """`/set format json` in a local chat where llguidance is missing fails when it is set,
    saying how to install it, and leaves the format as it was (not at the next message)."""
    from chatbot.config import ChatConfig
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.grammar import GrammarError

    session = ChatSession(tiny_engine, ChatConfig())
    json_object = session.sampling.with_value(FORMAT_KEY, "json")
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "llguidance", None)  # any import of it fails
        with pytest.raises(GrammarError, match="-m pip install 'llguidance>="):
            session.set_sampling(json_object)
    assert session.sampling.output_format is None
    session.set_sampling(json_object)  # with the engine there, taken
    assert session.sampling.output_format == OutputFormat.json_object()


# -- the engine, on the tiny random model ----------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_answers_in_the_schema_and_stops_when_it_is_complete(
    tiny_engine, tiny_tokenizer, temperature
):
    """A random model held to an enum answers one of its values and ends there ("stop"), with
    max_new_tokens far away; free, it runs to the limit."""
    digit = {"type": "integer", "minimum": 1, "maximum": 9}
    schema = {"type": "object", "properties": {"ok": {"enum": ["yes", "no"]}, "n": digit},
              "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip
    fmt = OutputFormat(json.dumps(schema))
    ids = tiny_tokenizer("hello there")["input_ids"]
    for seed in range(3):
        sampling = SamplingConfig(temperature=temperature, max_new_tokens=60, seed=seed, output_format=fmt)
        chunks = list(tiny_engine.generate(tiny_engine.new_cache(), ids, sampling))
        text = "".join(c.text for c in chunks)
        jsonschema.validate(json.loads(text), schema)
        assert chunks[-1].finish_reason == "stop" and chunks[-1].stats.generated_tokens < 60
    free = list(tiny_engine.generate(tiny_engine.new_cache(), ids, SamplingConfig(max_new_tokens=20)))
    assert free[-1].finish_reason == "length"


def test_an_unenforceable_schema_is_refused_before_any_work(tiny_engine, tiny_tokenizer):
    from chatbot.engine.grammar import GrammarError

    cache = tiny_engine.new_cache()
    sampling = SamplingConfig(output_format=OutputFormat(json.dumps(UNENFORCEABLE)))
    with pytest.raises(GrammarError, match="uniqueItems"):
        next(tiny_engine.generate(cache, tiny_tokenizer("hi")["input_ids"], sampling))
    assert cache.length == 0


@pytest.mark.parametrize("schema", [CYCLE, SELF], ids=["cycle", "self"])
def test_a_schema_no_value_satisfies_is_refused_before_any_work(tiny_engine, tiny_tokenizer, schema):
    """Unchecked, the grammar engine's first step fails, the mask leaves only the end of the
    answer, and an empty answer ends with "stop" as if it were complete."""
    from chatbot.engine.grammar import GrammarError

    cache = tiny_engine.new_cache()
    sampling = SamplingConfig(output_format=OutputFormat(json.dumps(schema)))
    with pytest.raises(GrammarError, match="no JSON value satisfies it"):
        next(tiny_engine.generate(cache, tiny_tokenizer("hi")["input_ids"], sampling, stop_ids=[2]))
    assert cache.length == 0


def test_a_grammar_the_engine_gives_up_on_is_an_error_not_a_stop(tiny_engine, tiny_tokenizer):
    """Part way through the string the lexer gives up: the answer so far is not JSON, so it
    must end in an error, never in "stop"."""
    from chatbot.engine.grammar import GrammarError

    fmt = OutputFormat(json.dumps(GIVES_UP))
    ids = tiny_tokenizer("hello there")["input_ids"]
    for seed in range(3):
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=300, seed=seed, output_format=fmt)
        chunks = tiny_engine.generate(
            tiny_engine.new_cache(), ids, sampling, stop_ids=[tiny_tokenizer.eos_token_id]
        )
        with pytest.raises(GrammarError, match=r"gave up on the schema after \d+ tokens: lexer error"):
            for chunk in chunks:
                assert chunk.finish_reason != "stop", chunk


# -- chatbot serve on the tiny random model: schemas the grammar engine gives up on ---------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_client(tiny_dir):
    with running_server("--model", str(tiny_dir), "--served-model-name", "tiny") as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize("stream", [False, True])
def test_serve_refuses_a_schema_no_value_satisfies(tiny_client, stream):
    for schema in (CYCLE, SELF):
        with pytest.raises(openai.BadRequestError) as caught:
            tiny_client.chat.completions.create(
                model="tiny",
                messages=ASK,
                max_tokens=20,
                stream=stream,
                response_format=_schema_format(schema),
            )
        error = caught.value.body
        assert error["param"] == "response_format" and "no JSON value" in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_serve_ends_in_an_error_when_the_grammar_engine_gives_up(tiny_client, stream):
    """Never a 200 with finish_reason "stop" and text that is not in the schema: a 400 naming
    response_format, or in a stream an error event after the text so far (no clean stop)."""
    for seed in range(2):
        kw = {"model": "tiny", "messages": ASK, "max_tokens": 300, "temperature": 1.0, "seed": seed}
        kw["response_format"] = _schema_format(GIVES_UP_LATE)
        finishes = []
        with pytest.raises(openai.APIError) as caught:
            if stream:
                for chunk in tiny_client.chat.completions.create(stream=True, **kw):
                    finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
            else:
                finishes.append(tiny_client.chat.completions.create(**kw).choices[0].finish_reason)
        assert finishes == []
        if not stream:
            assert isinstance(caught.value, openai.BadRequestError)
        assert "gave up on the schema" in caught.value.message and "\n" not in caught.value.message
    # the server goes on
    r = tiny_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3)
    assert r.choices[0].message.content


def test_run_json_schema_exits_1_when_the_grammar_engine_gives_up(tiny_dir, tmp_path):
    path = tmp_path / "schema.json"
    chatbot = [sys.executable, "-m", "chatbot.cli", "run", "--model", str(tiny_dir), "--no-stats"]
    for schema, match in ((GIVES_UP_LATE, "gave up on the schema"), (CYCLE, "no JSON value")):
        path.write_text(json.dumps(schema))
        out = subprocess.run(
            [*chatbot, "--max-new-tokens", "300", "--json-schema", str(path), "hi"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert len(lines) == 1 and match in lines[0], out.stderr


# -- chatbot serve, with the openai client, on the default model -----------------------------------


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running_server(log=log) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


def _answer(client, stream: bool, **kw) -> tuple[str, str | None]:
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 200, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish


@pytest.mark.slow
def test_json_schema_answers_satisfy_it_8_of_8_at_temperature_0_8(client):
    """Required keys, an enum, an integer range and a nested object: every answer is JSON
    that satisfies the schema, streamed or not, and ends as the grammar completes."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    answers = []
    for i in range(8):
        text, finish = _answer(client, stream=i % 2 == 1, temperature=0.8, response_format=response_format)
        jsonschema.validate(json.loads(text), PERSON)
        assert finish == "stop", text
        answers.append(text)
    assert len(set(answers)) > 1  # sampled, not one fixed answer


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_json_object_answers_parse(client, stream):
    """Any JSON object: greedy, since nothing bounds its strings (sampled at 0.8, the model can
    write one key until max_tokens; the answer then ends with "length", as OpenAI's does)."""
    text, finish = _answer(client, stream, temperature=0, response_format={"type": "json_object"})
    assert finish == "stop"
    assert json.loads(text)["name"]


@pytest.mark.slow
def test_a_schema_the_engine_cannot_take_is_a_400_naming_the_field(client):
    bad = {"type": "json_schema", "json_schema": {"name": "ids", "schema": UNENFORCEABLE}}
    for kw in ({"response_format": bad}, {"response_format": bad, "stream": True}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, **kw)
        error = caught.value.body
        assert error["param"] == "response_format" and "uniqueItems" in error["message"], error
    for shape, param in (
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, response_format=shape)
        assert caught.value.body["param"] == param, caught.value.body
    # and the server goes on
    assert _answer(client, False, max_tokens=3)[0]


# -- the chat ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_json_schema_answers_once_in_the_schema(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    chatbot = [sys.executable, "-m", "chatbot.cli", "run", "--no-stats", "--temperature", "0.8"]
    out = subprocess.run(
        [*chatbot, "--json-schema", str(path), ASK[0]["content"]],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), PERSON)
    path.write_text(json.dumps(UNENFORCEABLE))
    out = subprocess.run(
        [*chatbot, "--json-schema", str(path), "List ids."],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and "Traceback" not in out.stderr  # a bad flag, before the load
    assert len(lines) == 1 and "uniqueItems" in lines[0], out.stderr


@pytest.mark.slow
def test_set_format_json_in_the_piped_chat():
    script = "/set format json\nGive a name for a cat, as JSON.\n/set format text\nSay hi.\n"
    # `--opt exact`: the int16 arithmetic, whose greedy JSON closes within 200 tokens (under
    # `auto`'s int8 inputs this 135M model writes a URL that runs past them)
    out = subprocess.run(
        [sys.executable, "-m", "chatbot.cli", "run", "--no-stats", "--greedy", "--max-new-tokens", "200",
         "--opt", "exact"],
        input=script, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "format = json" in out.stderr
    first, second = out.stdout.splitlines()[:2]  # JSON on one line, then the free answer
    assert isinstance(json.loads(first), dict), out.stdout
    with pytest.raises(ValueError):
        json.loads(second)


def test_run_server_sends_the_format_as_response_format():
    from chatbot.conversation.remote import remote_sampling
    from chatbot.conversation.remote_backend import request_fields

    fmt = OutputFormat(json.dumps(PERSON), "person", True)
    body = request_fields(remote_sampling(output_format=fmt))
    assert body == {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        }
    }
    assert "response_format" not in request_fields(remote_sampling())
