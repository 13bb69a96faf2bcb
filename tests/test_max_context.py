"""`max_context` (flag, preset, EngineConfig) is the most tokens a conversation may hold."""

from __future__ import annotations

import pytest

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine
from chatbot.errors import ContextFullError

LONG = "Hello there how are you today, the quick brown fox jumps over the lazy dog again and again"
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=4)


def test_the_cli_engine_takes_max_context_from_engine_config(tiny_model, tiny_tokenizer):
    """The CLI builds its Engine from the EngineConfig that flags and presets resolve to."""
    from types import SimpleNamespace

    from chatbot.cli.load import make_engine
    from chatbot.engine.backends.base import HFBackend

    loaded = SimpleNamespace(model=tiny_model, tokenizer=tiny_tokenizer)
    backend = HFBackend(tiny_model)
    limited = make_engine(loaded, EngineConfig(max_context=40), backend)
    assert limited.max_context == 40 and limited.backend is backend
    trained = tiny_model.config.max_position_embeddings
    assert make_engine(loaded, EngineConfig(), backend).max_context == trained
    session = ChatSession(limited, ChatConfig(sampling=GREEDY, engine=EngineConfig(max_context=40)))
    with pytest.raises(ContextFullError, match="> 40"):
        list(session.send(LONG))


def test_chat_config_max_context_limits_a_library_session(tiny_model, tiny_tokenizer):
    """A library user who sets EngineConfig(max_context=40) gets a 40-token conversation."""
    session = ChatSession(
        Engine(tiny_model, tiny_tokenizer), ChatConfig(sampling=GREEDY, engine=EngineConfig(max_context=40))
    )
    with pytest.raises(ContextFullError, match="> 40"):
        list(session.send(LONG))
