"""Multi-token stop strings of the fallback templates in the session: the answer, the stream,
the segments and the cache all end right before the stop string.

A logits processor scripts the answers' first tokens (the model, or the fast decoder, still
computes every forward pass and the cache), so that the tiny random model writes Vicuna's
"USER:" as several tokens. The tokenizer gets one more token, " US", as Llama's
SentencePiece vocabulary has "▁US": with it the stop string begins inside a token.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, make_tokenizer, needs_kernels
from test_session import assert_invariant
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine
from chatbot.engine.stops import StopStrings
from chatbot.models.templates import apply_template, stop_strings_of

pytestmark = pytest.mark.usefixtures("one_thread")


class Script(LogitsProcessor):
    """Forces the answer's first tokens to `script`, then leaves the model's scores; keeps
    the model's scores for the first answer token."""

    def __init__(self, script: list[int], start: int) -> None:
        self.script = script
        self.start = start  # ids before the answer
        self.first_scores: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1] - self.start
        if n == 0:
            self.first_scores = scores[0].clone()
        if n >= len(self.script):
            return scores
        forced = torch.full_like(scores, float("-inf"))
        forced[0, self.script[n]] = 0.0
        return forced


class ScriptedEngine(Engine):
    """The engine with each answer's first tokens taken from `script` (greedy after it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.script: list[int] = []
        self.last: Script | None = None

    def generate(self, cache, new_ids, sampling, **kwargs):
        history = kwargs.get("history_ids")
        before = len(cache.ids) if history is None else len(history)  # the engine's default context
        self.last = Script(list(self.script), before + len(new_ids))
        kwargs["logits_processor"] = LogitsProcessorList([self.last])
        return super().generate(cache, new_ids, sampling, **kwargs)


@pytest.fixture(scope="module")
def tok():
    tok = make_tokenizer()
    tok.add_tokens([" US"])
    apply_template(tok, None, "vicuna")
    return tok


@pytest.fixture(scope="module")
def model(tok):
    return make_model(len(tok))


def ids(tok, *pieces: str) -> list[int]:
    """One token per piece (" " is the byte-level space)."""
    out = [tok.convert_tokens_to_ids("Ġ" if p == " " else p) for p in pieces]
    assert tok.unk_token_id not in out, pieces
    return out


def fine(tok) -> list[int]:
    return ids(tok, " ", "F", "in", "e", ".")  # " Fine."


def stop_at_boundary(tok) -> list[int]:
    return ids(tok, " ", "U", "S", "E", "R", ":", " ", "n", "e", "x", "t")  # " USER: next"


def stop_inside_a_token(tok) -> list[int]:
    return ids(tok, " US", "E", "R", ":", " ", "n", "e", "x", "t")  # the space is in " US"


def make_engine(kind: str, model, tok) -> ScriptedEngine:
    if kind == "transformers":
        return ScriptedEngine(model, tok)
    from chatbot.engine.backends.native.decoder import FastDecoder

    return ScriptedEngine(model, tok, decoder=FastDecoder(model, "auto"))  # "fast" cases need kernels


def session(engine, max_new_tokens: int = 16, **engine_cfg) -> ChatSession:
    sampling = SamplingConfig(
        temperature=0.0, repetition_penalty=1.0, max_new_tokens=max_new_tokens, stream_interval=1
    )
    return ChatSession(
        engine, ChatConfig(system="Be brief.", sampling=sampling, engine=EngineConfig(**engine_cfg))
    )


def stream(chunks) -> tuple[list[str], object]:
    texts, stats = [], None
    for c in chunks:
        texts.append(c.text)
        stats = c.stats or stats
    return texts, stats


def assert_cache_holds_the_conversation(s: ChatSession, pending: list[int]) -> None:
    """The cache holds exactly the conversation's ids but `pending` (what is queued for the
    next turn: the template's closing text, and a re-encoded end of the answer)."""
    assert s.pending_ids == pending
    held = len(s.all_ids) - len(pending)
    assert s.cache.get_seq_length() == len(s.cache_ids) == s.n_fed == held
    assert s.cache_ids == s.all_ids[:held]


def test_the_session_takes_the_fallback_templates_stop_strings(tok):
    assert stop_strings_of(tok) == ("<|im_end|>", "USER:")  # "</s>" as this tokenizer writes it
    assert stop_strings_of(make_tokenizer()) == ()  # the tokenizer's own template
    plain = make_tokenizer()
    apply_template(plain, None, "plain")
    assert stop_strings_of(plain) == ("\nUser:",)
    assert StopStrings(("USER:",)).held_back(" Fine. US") == 2
    assert StopStrings(("USER:",)).held_back(" Fine. USA") == 0


@pytest.mark.parametrize("where", ["boundary", "inside"])
@pytest.mark.parametrize(
    "kind, streaming",
    [("transformers", False), pytest.param("fast", False, marks=needs_kernels), ("transformers", True)],
)
def test_stop_string_ends_the_answer(tok, model, kind, streaming, where):
    engine = make_engine(kind, model, tok)
    cfg = {"enable_streaming": True, "start_size": 4, "recent_size": 256} if streaming else {}
    s = session(engine, **cfg)
    stop = stop_at_boundary(tok) if where == "boundary" else stop_inside_a_token(tok)
    engine.script = fine(tok) + stop
    texts, stats = stream(s.send("Hi"))
    assert "".join(texts) == s.turns[-1].answer == " Fine. "
    assert not any("U" in t for t in texts)  # not even the stop string's start was shown
    assert (
        stats.finish_reason == "stop"
        and stats.generated_tokens == 5 + stop.index(tok.convert_tokens_to_ids(":")) + 1
    )
    # The answer's ids decode to the cut text; inside a token, its end is re-encoded.
    space = tok.encode(" ", add_special_tokens=False)
    assert s.segments[-2].kind == "answer" and s.segments[-2].ids == fine(tok) + space
    closing = s.segments[-1].ids
    assert s.decode(closing) == tok.eos_token
    assert_cache_holds_the_conversation(s, closing if where == "boundary" else space + closing)
    # the stats line counts the cache with the closing text that waits to enter it (the toolbar's count)
    assert stats.cache_tokens == s.n_fed + len(s.pending_ids) == s.cache_count()
    assert_invariant(s)

    # The next turn feeds only what is pending and its prompt, and sees the logits of a full
    # recompute of the rendered conversation.
    pending = len(s.pending_ids)
    engine.script = ids(tok, " ")  # Vicuna writes the space itself before an answer without one
    _, stats = stream(s.send("More"))
    prompt = s.segments[s.turns[-1].first_segment]
    assert stats.context_tokens == pending + len(prompt.ids)
    before_answer = s.all_ids[: sum(len(g.ids) for g in s.segments[: s.turns[-1].first_segment + 1])]
    assert s.decode(before_answer) == s.render(s.messages()[:-1], add_generation_prompt=True)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([before_answer])).logits[0, -1].float()
    assert torch.allclose(engine.last.first_scores, ref, atol=1e-3), (
        (engine.last.first_scores - ref).abs().max()
    )
    assert_invariant(s)


def test_undo_and_retry_after_a_stopped_answer(tok, model):
    engine = make_engine("transformers", model, tok)
    s = session(engine)
    engine.script = ids(tok, " ")
    stream(s.send("Hello there!"))
    before = (s.rendered, list(s.all_ids))
    engine.script = fine(tok) + stop_inside_a_token(tok)
    stream(s.send("Hi"))
    cache = s.cache

    texts, stats = stream(s.retry())
    assert "".join(texts) == s.turns[-1].answer == " Fine. " and stats.finish_reason == "stop"
    assert s.cache is cache and stats.context_tokens == 1  # cut back, one token re-fed
    assert_invariant(s)

    engine.script = fine(tok) + stop_at_boundary(tok)
    texts, _ = stream(s.retry())
    assert "".join(texts) == " Fine. "
    assert_cache_holds_the_conversation(s, s.segments[-1].ids)
    assert_invariant(s)

    s.undo()
    assert s.cache is cache and (s.rendered, s.all_ids) == before
    assert_invariant(s)
    engine.script = fine(tok) + stop_at_boundary(tok)
    stream(s.send("Hi"))
    assert s.turns[-1].answer == " Fine. "
    assert_invariant(s)


def test_stop_string_split_across_chunks_is_held_back(tok, model):
    """Text that may be the start of a stop string is shown once it cannot be ("USA"), and
    never when it is one ("USER:")."""
    engine = make_engine("transformers", model, tok)
    s = session(engine)
    engine.script = ids(tok, " ", "U", "S", "A", ".") + stop_at_boundary(tok)
    texts, _ = stream(s.send("Hi"))
    assert texts == [" ", "", "", "USA", ".", " ", "", "", "", "", "", ""]
    assert s.turns[-1].answer == " USA. "
    assert_invariant(s)


def test_held_text_is_shown_at_the_end_and_continue_can_complete_the_stop_string(tok, model):
    engine = make_engine("transformers", model, tok)
    s = session(engine, max_new_tokens=7)
    engine.script = fine(tok) + ids(tok, " ", "U")  # cut short by max_new_tokens
    texts, stats = stream(s.send("Hi"))
    assert stats.finish_reason == "length"
    assert texts[-2:] == ["", "U"]  # held while it might have become "USER:", then shown
    assert "".join(texts) == s.turns[-1].answer == " Fine. U"
    assert_invariant(s)

    # Continued, the answer goes on "SER:": the stop string spans the two parts.
    engine.script = ids(tok, "S", "E", "R", ":", " ", "n")
    texts, stats = stream(s.continue_answer())
    assert "".join(texts) == ""
    assert stats.generated_tokens == 4 and stats.finish_reason == "stop"
    assert s.turns[-1].answer == " Fine. "
    assert_cache_holds_the_conversation(s, s.segments[-1].ids)
    assert_invariant(s)


def test_stream_closed_at_the_stop_string_still_cuts_it(tok, model):
    """The caller stops reading (Ctrl-C) at the chunk that completes the stop string, before
    the engine has asked whether to stop: the answer is cut all the same."""
    engine = make_engine("transformers", model, tok)
    s = session(engine)
    engine.script = fine(tok) + stop_inside_a_token(tok)
    chunks = s.send("Hi")
    for c in chunks:
        if c.token_ids == (tok.convert_tokens_to_ids(":"),):
            break
    chunks.close()
    assert s.turns[-1].answer == " Fine. " and s.turns[-1].interrupted
    assert_invariant(s)


def test_stop_string_after_eviction_keeps_the_streaming_cache_consistent(tok, model):
    engine = make_engine("transformers", model, tok)
    s = session(engine, max_new_tokens=24, enable_streaming=True, start_size=4, recent_size=64)
    engine.script = ids(tok, " ")
    for text in ["Hello there! How are you today?", "The quick brown fox."]:
        stream(s.send(text))
    engine.script = fine(tok) + stop_inside_a_token(tok)
    evicted = s.evicted_total
    texts, _ = stream(s.send("Hi"))
    assert s.evicted_total > evicted  # the stopped answer itself made room
    assert "".join(texts) == s.turns[-1].answer == " Fine. "
    assert s.cache.get_seq_length() == len(s.cache_ids)
    held = len(s.all_ids) - len(s.pending_ids)
    assert s.cache_ids[-8:] == s.all_ids[held - 8 : held]  # the recent end: up to " Fine."
    assert_invariant(s, check_logits=False)
    engine.script = ids(tok, " ")
    stream(s.send("More"))
    assert_invariant(s, check_logits=False)
