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
        (["run", "--opt", "turbo"], "'turbo' is not one of off, f32, auto, fast, int8, int4"),
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
        if p.name != "ctx"
    }


def test_run_and_config_show_declare_their_shared_options_alike():
    from typer.main import get_command

    from chatbot.cli import app
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
