"""A transformers folder whose weights do not fill the model its config describes is refused
in one line (before: transformers initialised the missing layers at random and the chat
answered nonsense with nothing on stderr)."""

from __future__ import annotations

import json
import time

import pytest
from helpers import cli, make_model, make_tokenizer


@pytest.fixture
def folder(tmp_path):
    tok = make_tokenizer()
    path = tmp_path / "tiny"
    make_model(len(tok), layers=2).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _set_layers(folder, n: int) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = n
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("layers,words", [(4, "missing model.layers.2."), (1, "unexpected model.layers.1.")])
def test_config_and_weights_that_disagree_refuse_the_load(capsys, folder, layers, words):
    _set_layers(folder, layers)
    start = time.perf_counter()
    code, out, err = cli(capsys, "run", "--model", str(folder), "--plain")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and time.perf_counter() - start < 60
    assert len(lines) == 1 and lines[0].startswith(f"chatbot: error: {folder} "), err
    assert words in lines[0] and "more" in lines[0]
    assert out.strip() == ""


def test_a_whole_folder_with_tied_weights_loads(capsys, folder):
    """Tied embeddings (no lm_head in the file) are no missing weight."""
    config = json.loads((folder / "config.json").read_text())
    assert config.get("tie_word_embeddings") is not False
    from chatbot.models.loader import load_model

    loaded = load_model(str(folder))
    assert loaded.model.config.num_hidden_layers == 2
