"""CLI errors: one line, exit code 2, no traceback."""

from __future__ import annotations

import pytest
from helpers import cli


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--temperature", "-1"], "temperature must be"),
        (["run", "--top-p", "1.5"], "top_p must be"),
        (["run", "--top-k", "many"], "Invalid value for '--top-k'"),
        (["run", "--bogus-flag"], "No such option: --bogus-flag"),
        (["run", "--device", "quantum"], "unknown device"),
        (["run", "--opt", "turbo"], "'turbo' is not one of off, f32, auto, exact, fast, int8, int4"),
        (["bench", "turns", "--conversation", "/no/such.json"], "cannot read conversation"),
    ],
)
def test_bad_input_is_one_line(capsys, args, message):
    code, out, err = cli(capsys, *args)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err + out


def test_non_model_file(capsys, tmp_path):
    junk = tmp_path / "notes.txt"
    junk.write_text("not a model")
    code, _, err = cli(capsys, "run", "--model", str(junk))
    assert code == 2 and "is not a model" in err


def test_garbage_gguf(capsys, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    code, _, err = cli(capsys, "run", "--model", str(bad))
    assert code == 2 and "cannot read GGUF file" in err
    assert len(err.strip().splitlines()) == 1


# -- `run` and `config show` declare their shared options once ---------------------------------


def _options(command) -> dict[str, tuple]:
    """Each option of a click command by name: what a user sees and gets."""
    return {
        p.name: (
            tuple(p.opts),
            tuple(p.secondary_opts),
            p.default,
            p.help,
            p.type_descriptor.annotation,
            p.is_flag,
            p.required,
            p.min,
            p.max,
        )
        for p in command.params
        if p.name != "ctx" and p.param_type_name == "option"  # run's PROMPT is an argument
    }


def test_run_and_config_show_declare_their_shared_options_alike():
    from typer.main import get_command

    from chatbot.cli.app import app
    from chatbot.models.presets import PRESET_SETTINGS

    root = get_command(app)
    run = _options(root.commands["run"])
    show = _options(root.commands["config"].commands["show"])
    # Every setting a preset can give is a flag of both commands (config show prints what
    # run would use), plus the preset choice itself and --greedy.
    settings = set(PRESET_SETTINGS) | {"preset", "config", "greedy"}
    assert settings <= set(run), sorted(settings - set(run))
    assert settings <= set(show), sorted(settings - set(show))
    shared = set(run) & set(show)
    assert shared == settings, sorted(shared - settings)
    drifted = {name: (run[name], show[name]) for name in shared if run[name] != show[name]}
    assert not drifted


# Options `serve` shares with `run` by name but not by meaning (a server's defaults for its
# requests, the key it requires): the same flags, their own help.
SERVE_OWN_HELP = {
    "model",
    "preset",
    "temperature",
    "max_new_tokens",
    "enable_streaming",
    "api_key_env",
    "think_budget",
    "draft",
}


def test_run_serve_and_config_show_share_one_declaration_of_each_option():
    """Every option of the three commands is an `Annotated` alias of chatbot.cli.options,
    declared there once, or a setting's, built from its row of chatbot.settings (`**settings`);
    an option two of them share reads the same in both (`serve`'s few own meanings aside, which
    still take the same flags)."""
    import typing

    from typer.main import get_command

    from chatbot.cli import app as cli
    from chatbot.cli import options
    from chatbot.cli.app import app

    aliases = {
        id(meta)
        for value in vars(options).values()
        if typing.get_origin(value) is typing.Annotated
        for meta in value.__metadata__
    }
    for command in (cli.run, cli.serve, cli.config_show):
        hints = typing.get_type_hints(command, include_extras=True)
        inline = [
            name
            for name, hint in hints.items()
            if name not in ("ctx", "return", "settings")
            and not (hint.__metadata__ and id(hint.__metadata__[0]) in aliases)
        ]
        assert not inline, (command.__name__, inline)
    root = get_command(app)
    commands = {
        "run": _options(root.commands["run"]),
        "serve": _options(root.commands["serve"]),
        "config show": _options(root.commands["config"].commands["show"]),
    }
    assert len(set(commands["run"]) & set(commands["serve"])) >= 15
    from chatbot.settings import SETTINGS

    for row in SETTINGS:  # each setting's flag, as its row of the table says
        opts, _, _, help_text, *_ = commands["run"][row.name]
        assert opts == (row.flag,) and help_text == row.help_text(), row.name
    for a, b in (("run", "serve"), ("serve", "config show"), ("run", "config show")):
        for name in set(commands[a]) & set(commands[b]):
            mine, theirs = commands[a][name], commands[b][name]
            if "serve" in (a, b) and name in SERVE_OWN_HELP:
                assert mine[:2] == theirs[:2], (a, b, name)  # the same flags
                assert mine[3] != theirs[3], (a, b, name)  # else it belongs to the shared ones
            else:
                assert mine == theirs, (a, b, name)


# -- settings reach the session: flag or preset -> RunConfig -> engine and cache -------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from helpers import make_model, make_tokenizer

    folder = tmp_path_factory.mktemp("tiny") / "llama"
    tok = make_tokenizer()
    make_model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def chat_lines(capsys, monkeypatch, model_dir, lines: list[str], *args: str) -> tuple[int | str | None, str]:
    """`chatbot run` on the tiny model with `lines` piped in; the exit code and all output."""
    import io

    piped = "".join(line + "\n" for line in lines).encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(piped), encoding="utf-8"))
    code, out, err = cli(
        capsys,
        "run",
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--temperature",
        "0",
        "--max-new-tokens",
        "4",
        "--opt",
        "off",
        *args,
    )
    return code, out + err


LONG = "Hello there how are you today, the quick brown fox jumps over the lazy dog again and again"


def test_max_context_flag_limits_the_conversation(capsys, monkeypatch, model_dir):
    code, out = chat_lines(capsys, monkeypatch, model_dir, [LONG, "/model"], "--max-context", "40")
    assert code == 1, out  # a piped chat whose message failed says so in its status, after the rest
    assert "context full (0 + " in out and "> 40)" in out
    assert "context limit │ 40 tokens" in out


def test_max_context_past_the_model_is_noted(capsys, monkeypatch, model_dir):
    code, out = chat_lines(capsys, monkeypatch, model_dir, ["Hi", "/model"], "--max-context", "600")
    assert code == 0, out
    assert "note: --max-context 600 is more than the model's context (512 tokens)" in out
    assert "context limit │ 600 tokens" in out
    code, out = chat_lines(capsys, monkeypatch, model_dir, ["Hi"], "--max-context", "512")
    assert code == 0 and "note: --max-context" not in out


def test_preset_settings_reach_the_cache(capsys, monkeypatch, model_dir, tmp_path):
    preset = tmp_path / "small.yaml"
    preset.write_text(
        "max_context: 48\nstreaming: {enable: true, start_size: 4, recent_size: 20}\n"
        "sampling: {stream_interval: 3}\n"
    )
    code, out = chat_lines(
        capsys, monkeypatch, model_dir, ["Hi", "/model"], "--config", str(preset), "--recent-size", "16"
    )
    assert code == 0, out
    assert "context limit │ 48 tokens" in out
    # the flag's window (16), not the preset's (20), plus the 4 sinks
    assert "/ 20 tokens (attention sinks + recent window)" in out


def test_config_show_greedy_and_stream_interval(capsys):
    code, out, _ = cli(capsys, "config", "show", "--greedy", "--temperature", "0.8", "--stream-interval", "4")
    assert code == 0
    assert "  temperature: 0.0  # flag" in out
    assert "  stream_interval: 4  # flag" in out


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--max-context", "64"], "--max-context does not apply with --server: the server runs the model"),
        (["--recent-size", "64"], "--recent-size does not apply with --server"),
        (["--dtype", "float32"], "--dtype does not apply with --server"),
        (["--preset", "vicuna"], "--preset does not apply with --server"),
        (["--opt", "int8"], "--opt does not apply with --server"),
    ],
)
def test_local_model_flags_are_refused_with_server(capsys, flags, match):
    """Refused before any connection (port 9 is never contacted), not silently ignored."""
    from helpers import assert_one_line_error

    assert_one_line_error(capsys, "run", "--server", "http://127.0.0.1:9/v1", *flags, match=match)
