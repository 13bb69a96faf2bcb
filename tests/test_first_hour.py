"""What a newcomer reads in the first hour (issue 37's defects 4, 5, 6, 11, 12): the
toolbar's cache meter against the stats line, /model on a GGUF file, /system against the
template's own system prompt, one wording for why an answer ended, a piped answer's edges."""

from __future__ import annotations

import io

import pytest
from helpers import make_tokenizer
from rich.console import Console

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.terminal.live_answer import PlainAnswer
from chatbot.terminal.render import format_stats_line, stats_table

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=12)


def test_toolbar_meter_never_exceeds_a_streaming_window(tiny_engine):
    """Defect 4: `--enable-streaming --recent-size 64`: after turns that evicted, the answer's
    closing text waits to enter the cache; the toolbar said "cache 69/68" where the stats
    line said 66/68. A bounded cache holds its window at most."""
    cfg = EngineConfig(enable_streaming=True, start_size=4, recent_size=64)
    # 38 answer tokens leave the window full after two of the turns (each eviction drops
    # what a pass needs, rounded up to 16 tokens, so where a turn ends depends on its length)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=38)
    s = ChatSession(tiny_engine, ChatConfig(sampling=sampling, engine=cfg))
    full = 0
    for text in ["Hello there! How are you today?", "The quick brown fox.", "Café, naïve, résumé."]:
        for _ in s.send(text):
            pass
        meter, stats = s.meter(), s.turns[-1].stats
        assert meter.capacity == 68 and meter.used <= meter.capacity
        assert stats.cache_tokens <= meter.used  # the toolbar counts what waits to enter, too
        full += len(s.cache_ids) + len(s.pending_ids) > 68  # the case: more than the window
    assert full and s.evicted_total > 0


def test_system_names_the_templates_default(tiny_engine):
    """Defect 6: the test tokenizer's template writes "You are a tiny test model." when the
    conversation has no system prompt, as SmolLM's does: /system must say so."""
    from chatbot.terminal.repl import Repl

    s = ChatSession(tiny_engine, ChatConfig(sampling=GREEDY))
    out = io.StringIO()
    console = Console(file=out, width=80, color_system=None)
    repl = Repl(s, _Named(), console, plain=True, show_stats=False, info=console)
    repl.handle("/system")
    shown = " ".join(out.getvalue().split())
    assert "no system prompt" not in shown
    assert "the template's default): You are a tiny test model." in shown
    repl.handle("/system Be brief.")
    out.truncate(0)
    repl.handle("/system")
    assert "system prompt: Be brief." in out.getvalue()


class _Named:
    name = "tiny"

    def describe(self) -> dict[str, str]:
        return {"model": "tiny"}


def test_default_system_prompt_of_templates_without_one():
    from chatbot.models.templates import apply_template, default_system_prompt

    tok = make_tokenizer()
    apply_template(tok, None, "chatml")
    assert default_system_prompt(tok) is None
    apply_template(tok, None, "vicuna")  # Vicuna writes its own when there is none
    assert default_system_prompt(tok).startswith("A chat between a curious user")


def test_model_on_a_gguf_names_its_block_formats_once(tmp_path, monkeypatch):
    """Defect 5: /model on a GGUF file said "dtype float32 · quantization none" above the
    kernels' "N q4_1 + 1 q8_0 matrices", and "context" beside "context limit"."""
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import load_model
    from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "llama-q8.gguf"
    write_synthetic_gguf(path, "llama", SHAPES["llama"]["tiny"], "Q8_0", seed=2)
    loaded = load_model(str(path), dtype="float32")
    session = ChatSession(Engine(loaded.model, loaded.tokenizer), ChatConfig(sampling=GREEDY))
    _, rows = session.describe_model(loaded)
    assert rows["quantization"].startswith("GGUF ") and "q8_0" in rows["quantization"]
    assert rows["quantization"].endswith(" matrices")
    assert rows["dtype"] == "float32 compute"
    assert "context" not in rows and rows["context limit"].endswith(" tokens")


def test_one_wording_for_an_answer_cut_at_max_tokens():
    """Defect 11: the stats line said "max tokens" where /stats' "end" column said "length"."""
    from types import SimpleNamespace

    from chatbot.engine.stats import TurnStats

    s = TurnStats(context_tokens=10, generated_tokens=60, token_latencies_s=[0.04] * 60,
                  cache_tokens=70, finish_reason="length")  # fmt: skip
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(stats_table([SimpleNamespace(stats=s)], _summary()))
    assert "max tokens" in format_stats_line(s)
    assert "max tokens" in out.getvalue() and "length" not in out.getvalue()


def _summary() -> dict:
    return {"context_tokens": 10, "generated_tokens": 60, "decode_tps": 25.0, "cache_tokens": 70}


@pytest.mark.parametrize(
    "pieces, shown",
    [
        ([" Paris", " is", " the capital.", "\n", "\n"], "Paris is the capital.\n"),  # a base model's
        (["\n\n", "Hello", "\n\n", "world", "  "], "Hello\n\nworld\n"),
        (["  ", " "], "\n"),
    ],
)
def test_a_piped_answer_has_no_space_before_nor_blank_line_after(pieces, shown):
    """Defect 12: on a pipe a base model's answer began with a space, and ended with a blank
    line; the whitespace inside an answer is kept."""
    out = io.StringIO()
    with PlainAnswer(out) as answer:
        for piece in pieces:
            answer.add(piece)
    assert out.getvalue() == shown
    assert answer.text == "".join(pieces)


def test_stats_line_breaks_between_phrases():
    """Defect 7: at 80 columns the stats line wrapped inside "41.0 ms/tok"."""
    from chatbot.engine.stats import TurnStats

    s = TurnStats(context_tokens=1234, context_time_s=1.5, ttft_s=1.6, generated_tokens=60,
                  decode_time_s=2.4, token_latencies_s=[0.041] * 60, cache_tokens=66, cache_capacity=68,
                  sinks=4, evicted_total=32, finish_reason="length")  # fmt: skip
    whole = format_stats_line(s).split(" · ")
    for width in (80, 50):
        lines = format_stats_line(s, width).splitlines()
        assert len(lines) > 1 and all(len(line) <= width for line in lines)
        assert [p for line in lines for p in line.removesuffix(" ·").split(" · ")] == whole
