"""Presets in configs/: every shipped file parses, bad files are refused by file and key,
flags override presets, and `chatbot config show` prints a file that reads back the same."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from helpers import assert_one_line_error, cli, make_model, make_tokenizer

from chatbot.errors import ConfigError
from chatbot.models.presets import (
    find_preset,
    list_presets,
    load_preset_file,
    parse_preset,
    resolve_settings,
)
from chatbot.models.templates import TEMPLATES

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = {
    "default",
    "llama-2-chat",
    "llama-3-instruct",
    "mistral-instruct",
    "qwen2.5-instruct",
    "vicuna",
    "colossal-llama",
}


def test_shipped_presets_parse():
    found = {p.name: p for p in list_presets()}
    assert SHIPPED <= set(found)
    for name in SHIPPED:
        preset = found[name]
        assert not preset.description.startswith("(broken"), preset.description
        template = preset.config.load.template
        assert template == "auto" or template in TEMPLATES
    assert found["default"].config.load.model is None
    assert found["vicuna"].config.load.template == "vicuna"
    assert found["colossal-llama"].config.load.template == "colossal"
    assert found["llama-2-chat"].config.load.template == "llama2"


def test_find_preset_any_case_and_unknown():
    assert find_preset("Vicuna").name == "vicuna"
    assert find_preset("qwen2.5-instruct.yaml").config.load.model == "Qwen/Qwen2.5-1.5B-Instruct"
    with pytest.raises(ConfigError, match="no preset named 'nope'; presets: default, "):
        find_preset("nope")


@pytest.mark.parametrize(
    "text, message",
    [
        ("temprature: 0.5\n", "unknown key 'temprature'; keys: description, model"),
        ("sampling:\n  temprature: 0.5\n", "unknown key 'sampling.temprature'; keys: temperature, top_p"),
        ("sampling:\n  temperature: hot\n", "sampling.temperature must be a number ≥ 0 and ≤ 100, got 'hot'"),
        ("sampling:\n  top_k: -1\n", "sampling.top_k must be an integer ≥ 0, got -1"),
        ("dtype: float8\n", "dtype must be one of auto, float32, bfloat16, float16, got 'float8'"),
        ("device: gpu\n", "device must be auto, cpu, cuda, cuda:N or mps, got 'gpu'"),
        ("quantize: 3bit\n", "quantize must be null, 4bit or 8bit, got '3bit'"),
        ("template: alpaca\n", "template must be auto, chatml, llama2"),
        ("streaming:\n  enable: yes please\n", "streaming.enable must be true or false"),
        (
            "streaming:\n  recent_size: 8\n",
            "streaming.recent_size must be an integer ≥ 16 and ≤ 16777216, got 8",
        ),
        ("trust_remote_code: 1\n", "trust_remote_code must be true or false, got 1"),
        ("- a list\n", "a preset is a mapping of keys to values, got list"),
        ("model: [unclosed\n", "(line 2)"),
    ],
)
def test_bad_preset_files_name_file_key_and_allowed_values(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_preset_file(path)
    assert str(exc.value).startswith(str(path))
    assert message in str(exc.value)


def test_relative_paths_are_taken_from_the_preset_folder(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    preset = parse_preset({"model": "./weights", "template": "t.jinja"}, tmp_path / "p.yaml")
    assert preset.config.load.model == str((tmp_path / "weights").resolve())
    assert preset.config.load.template == str((tmp_path / "t.jinja").resolve())
    assert preset.given == {"model", "template"}


def test_flags_override_preset_override_defaults():
    preset = find_preset("vicuna")
    settings = resolve_settings(
        preset, {"temperature": 0.1, "top_k": None, "device": "auto"}, {"temperature"}
    )
    assert settings["temperature"] == 0.1 and settings.origin["temperature"] == "flag"
    assert settings["top_p"] == 0.9 and settings.origin["top_p"] == "preset"
    assert settings["device"] == "auto" and settings.origin["device"] == "default"
    # sampling values nobody set stay None, so the model's generation_config supplies them
    assert settings.config.sampling.top_k is None
    given = settings.config.sampling.given()
    assert given == {"temperature": 0.1, "top_p": 0.9, "max_new_tokens": 512, "stream_interval": 1}


def test_config_show_marks_origins_and_reads_back(capsys, tmp_path):
    code, out, err = cli(
        capsys, "config", "show", "--preset", "colossal-llama", "--temperature", "0.3", "--dtype", "float32"
    )
    assert code in (0, None), err
    assert "# preset: colossal-llama" in out
    assert "template: colossal  # preset colossal-llama" in out
    assert "temperature: 0.3  # flag" in out
    assert "dtype: float32  # flag" in out
    assert "quantize: null  # default" in out
    saved = tmp_path / "mine.yaml"
    saved.write_text(out)
    again = load_preset_file(saved)
    assert again.config.load.template == "colossal"
    assert again.config.sampling.temperature == 0.3
    assert again.config.load.model == "hpcai-tech/Colossal-LLaMA-2-7b-base"
    code, out2, _ = cli(capsys, "config", "show", "--config", str(saved))
    assert code in (0, None)
    assert "temperature: 0.3  # preset mine" in out2


def test_config_show_rejects_bad_values_in_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sampling:\n  top_p: 2\n")
    for args in (
        ("config", "show", "--config", str(bad)),
        ("config", "show", "--preset", "nope"),
        ("config", "show", "--preset", "vicuna", "--config", str(bad)),
        ("config", "show", "--template", "alpaca"),
        ("config", "show", "--top-p", "0"),
    ):
        assert_one_line_error(capsys, *args)


def test_run_refuses_a_bad_preset_before_loading(capsys, tmp_path, monkeypatch):
    from chatbot.models import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("streaming:\n  start_size: -1\n")
    code, _, err = cli(capsys, "run", "--config", str(bad))
    assert code == 2
    assert (
        err.strip()
        == f"chatbot: error: {bad}: streaming.start_size must be an integer ≥ 0 and ≤ 16777216, got -1"
    )


def test_run_uses_the_preset_and_flags_override(capsys, tmp_path, monkeypatch):
    """The settings reach the loader and the session: the preset's model, template and
    sampling, with the flag's temperature on top."""
    tok = make_tokenizer()
    model_dir = tmp_path / "tiny"
    make_model(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    preset = tmp_path / "mine.yaml"
    preset.write_text(
        "model: ./tiny\ntemplate: vicuna\nsystem: Be brief.\ndevice: cpu\n"
        "sampling:\n  temperature: 0.9\n  max_new_tokens: 3\n"
    )
    seen = {}
    import chatbot.terminal.repl as repl_mod

    def fake_run(repl, interactive):
        seen["session"] = repl.session
        seen["loaded"] = repl.loaded if hasattr(repl, "loaded") else None

    monkeypatch.setattr(repl_mod, "run", fake_run)
    code, _, err = cli(capsys, "run", "--config", str(preset), "--temperature", "0")
    assert code in (0, None), err
    session = seen["session"]
    assert session.system == "Be brief."
    assert session.sampling.temperature == 0.0 and session.sampling.max_new_tokens == 3
    assert "ASSISTANT:" in session.render([{"role": "user", "content": "hi"}], True)


def test_model_may_name_a_preset(capsys, tmp_path, monkeypatch):
    code, out, _ = cli(capsys, "config", "show", "--model", "vicuna", "--temperature", "0.2")
    assert code == 0
    assert "# preset: vicuna" in out and "model: lmsys/vicuna-7b-v1.5  # preset vicuna" in out
    # a folder of that name wins over the preset
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vicuna").mkdir()
    code, out, _ = cli(capsys, "config", "show", "--model", "vicuna")
    assert "# preset" not in out and "model: vicuna  # flag" in out


def test_no_model_takes_the_default_models_preset(capsys, tmp_path, monkeypatch):
    """`chatbot run` with no --model chats with the embedded default model at its preset's
    sampling (as `serve` does); a --model of one's own does not get that preset."""
    default = find_preset("default").config.sampling
    code, out, _ = cli(capsys, "config", "show")
    assert code == 0 and "# preset: default" in out
    assert f"temperature: {default.temperature}  # preset default" in out
    code, out, _ = cli(capsys, "config", "show", "--temperature", "0.5")
    assert "temperature: 0.5  # flag" in out and "top_p: 0.9  # preset default" in out
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    code, out, _ = cli(capsys, "config", "show", "--model", "mine")
    assert "# preset" not in out and "temperature: null  # default" in out
    import chatbot.terminal.repl as repl_mod

    seen = {}
    monkeypatch.setattr(repl_mod, "run", lambda repl, interactive: seen.update(session=repl.session))
    code, _, err = cli(capsys, "run")
    assert code in (0, None), err
    session = seen["session"]
    if hasattr(session, "result"):  # a load in the background
        session = session.result()
    assert session.sampling.temperature == default.temperature


def test_a_preset_reads_into_typed_settings(tmp_path):
    """A preset's values land in RunConfig's sections, typed, with the names it gave."""
    from chatbot.config import RunConfig, SamplingChoices, SamplingConfig

    path = tmp_path / "p.yaml"
    path.write_text("dtype: float32\nsampling:\n  top_k: 7\nstreaming:\n  enable: true\n  recent_size: 64\n")
    preset = load_preset_file(path)
    assert preset.given == {"dtype", "top_k", "enable_streaming", "recent_size"}
    assert preset.config.load.dtype == "float32" and preset.config.sampling.top_k == 7
    assert preset.config.engine.enable_streaming and preset.config.engine.recent_size == 64
    assert preset.config.sampling.temperature is None  # not given: the model's generation_config decides
    # the sampling a preset or a flag can give is exactly what a session samples with
    assert [f.name for f in fields(SamplingChoices)] == list(SamplingConfig.RANGES)  # the settings
    assert len(set(RunConfig.setting_names())) == len(RunConfig.setting_names())  # one name, one setting
    with pytest.raises(KeyError):
        RunConfig().replaced({"temprature": 0.5})


def test_recent_window_default_and_given():
    """--recent-size wins; without it the window is the default for the context, fitted into
    a sliding window where the model has one."""
    from chatbot.config import EngineConfig

    assert EngineConfig(recent_size=100).recent_window(8192, 512) == 100
    assert EngineConfig().recent_window(8192) == 2000
    assert EngineConfig().recent_window(1024) == 256
    assert EngineConfig().recent_window(32768, 512) == 384
    with pytest.raises(ConfigError, match="must not be larger than the recent window"):
        EngineConfig(start_size=100, recent_size=50).validated()
