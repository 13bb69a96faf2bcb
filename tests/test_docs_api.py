"""Every example in docs/api.md runs: on the tiny model, and once on the default model (slow)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chatbot.compat import reset_persistent_cache

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
FENCE = re.compile(r"^```(python[^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, str]]:
    """(info string, code) of every python block, in order."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(DOC.read_text(encoding="utf-8"))]


def examples() -> list[str]:
    return [code for info, code in blocks() if info == "python"]


def run_example(code: str, model, tokenizer) -> None:
    reset_persistent_cache(model)
    try:
        namespace = {"__name__": "docs_api", "model": model, "tokenizer": tokenizer}
        exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the doc examples are the test
    finally:
        reset_persistent_cache(model)


def test_doc_has_one_example_per_api_and_a_setup_block():
    infos = [info for info, _ in blocks()]
    assert infos.count("python setup") == 1
    codes = examples()
    for api in ("streaming_chat", "stream_generate", "StreamGenerator", "enable_streaming_llm"):
        assert any(f"import {api}" in c or f", {api}" in c for c in codes), api
    # The setup block at least compiles (running it loads the default model: the slow test
    # gets that model from its fixture instead).
    setup = next(code for info, code in blocks() if info == "python setup")
    compile(setup, str(DOC), "exec")


@pytest.mark.parametrize("index", range(len(examples())))
def test_example_runs_on_tiny_model(index, tiny_model, tiny_tokenizer):
    run_example(examples()[index], tiny_model, tiny_tokenizer)


@pytest.mark.slow
def test_examples_run_on_default_model(default_model, capsys):
    for code in examples():
        run_example(code, default_model.model, default_model.tokenizer)
    out = capsys.readouterr().out
    assert "->" in out and "TTFT" in out
