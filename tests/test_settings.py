"""The table of settings (chatbot.settings): one row per setting, read by every layer."""

import dataclasses
import subprocess
from pathlib import Path

from chatbot.config import EngineConfig, SamplingConfig
from chatbot.settings import SETTINGS, layer

PACKAGE = Path(__file__).resolve().parents[1] / "chatbot"


def test_each_layer_has_a_field_per_row_with_its_default_and_range():
    for name, cls in (("sampling", SamplingConfig), ("engine", EngineConfig)):
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("unset", "output_format")}
        assert list(fields) == [row.name for row in layer(name)]
        for row in layer(name):
            assert fields[row.name].default == row.default, row.name
            assert (cls.RANGES.get(row.name) is row.range) or row.range is None, row.name


def test_a_sampling_setting_is_named_in_few_files():
    """Issue 58's measure: the table, its dataclass field, the samplers and the request schema."""
    out = subprocess.run(
        ["grep", "-rl", "--include=*.py", "repetition_penalty", str(PACKAGE)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = sorted(str(Path(p).relative_to(PACKAGE)) for p in out)
    # gguf/config.py holds transformers' own list of the generation keys a config.json may
    # carry (checked against theirs in test_without_transformers), not a setting of ours.
    files = [f for f in files if not f.startswith(("compat/", "measure/")) and f != "gguf/config.py"]
    assert len(files) <= 5, files


def test_rows_are_well_formed():
    names = [row.name for row in SETTINGS]
    assert len(names) == len(set(names))
    aliases = [alias for row in SETTINGS for alias in row.aliases]
    assert len(aliases) == len(set(aliases)) and not set(aliases) & set(names)
    for row in SETTINGS:
        assert row.layer in ("sampling", "engine")
        assert (row.range is None) == (row.kind is bool), row.name
        if row.extra or row.openai_default is not None:
            assert row.request is not None, row.name
