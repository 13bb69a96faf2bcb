"""What a session is told rather than rediscovers: the loader's template facts, and the
model's own sampling settings."""

from __future__ import annotations

from helpers import make_model, make_tokenizer
from transformers import GenerationConfig

from chatbot.config import ChatConfig
from chatbot.conversation.session import ChatSession, sampling_from_model
from chatbot.engine.generate import Engine
from chatbot.models.templates import apply_template


def test_template_info_from_the_loader_gives_the_stop_strings():
    """Vicuna's "USER:" ends answers because the loader said so, even when the tokenizer's
    template text no longer matches the fallback's Jinja letter for letter."""
    tok = make_tokenizer()
    info = apply_template(tok, None, "vicuna")
    tok.chat_template += "{# edited by the user #}"  # renders the same, reads differently
    engine = Engine(make_model(len(tok)), tok)
    told = ChatSession(engine, ChatConfig(), info)
    guessed = ChatSession(engine, ChatConfig())
    assert "USER:" in told.stops.strings
    assert guessed.stops.strings == ()  # what rediscovery by Jinja comparison finds
    assert tok.eos_token_id in told.stop_ids


def test_model_that_ships_greedy_decoding_is_greedy():
    model = make_model(64)
    model.generation_config = GenerationConfig(do_sample=False, temperature=0.6, top_p=0.8)
    assert sampling_from_model(model).greedy
    assert sampling_from_model(model, temperature=None).greedy  # an unset flag is no override
    assert sampling_from_model(model, temperature=0.9).temperature == 0.9  # --temperature wins
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.6)
    assert sampling_from_model(model).temperature == 0.6
