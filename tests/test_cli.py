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
        (["run", "--opt", "turbo"], "'turbo' is not one of off, f32, auto, int8, int4"),
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
