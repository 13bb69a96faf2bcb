"""The persistent cache with a SentencePiece-style tokenizer (Llama-2, Mistral v0.1, Vicuna).

transformers' own `LlamaTokenizer` (Metaspace "▁" for spaces, prepended only at the start of
the text; its decoder drops the space of a leading "▁") over a vocabulary trained here. Two
things read differently alone and in the conversation: an answer "▁Hello" decodes alone as
"Hello" but reads " Hello" after "[/INST]", and "USER:" encodes alone as "▁USER:" but as
"USER", ":" after "</s>". Each turn must still feed only the tokens the conversation gained:
the previous answer's closing text and the new prompt.

The answers are scripted (test_stop_strings.ScriptedEngine: the model computes every forward
pass, a logits processor picks the tokens) so that they start with "▁" and spell "Hello" as
"▁Hel", "lo", as a model may, not as the tokenizer would ("▁Hello").
"""

from __future__ import annotations

import copy
import json

import pytest
from helpers import CORPUS, make_model
from test_session import assert_invariant
from test_stop_strings import ScriptedEngine

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.saved import read_saved
from chatbot.conversation.session import ChatSession
from chatbot.models.templates import apply_template

MESSAGES = ["Hi there!", "How are you today?", "The quick brown fox.", "Answer briefly."]
ANSWER = ("▁Hel", "lo", "▁thank", "▁you")  # " Hello thank you"


pytestmark = pytest.mark.usefixtures("one_thread")


def make_sp_tokenizer():
    """transformers' LlamaTokenizer (byte-fallback BPE, Metaspace prepend_scheme "first") over
    merges trained on the test corpus, with <s> and </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    bpe = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))],
        show_progress=False,
    )
    extra = ["[INST] <<SYS>> <</SYS>> [/INST] USER: ASSISTANT: User: Assistant:", *MESSAGES]
    bpe.train_from_iterator((CORPUS + extra) * 3, trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    return LlamaTokenizer(vocab=trained["vocab"], merges=merges)


@pytest.fixture(scope="module")
def sp_tok():
    tok = make_sp_tokenizer()
    # The premise: a leading "▁" is dropped when decoded alone, and "▁" is prepended only at
    # the start of the text.
    hello = tok.convert_tokens_to_ids("▁Hello")
    assert tok.decode([hello]) == "Hello" and tok.decode([tok.eos_token_id, hello]) == "</s> Hello"
    assert (
        tok("</s>USER:", add_special_tokens=False)["input_ids"][1:]
        != tok("USER:", add_special_tokens=False)["input_ids"]
    )
    return tok


@pytest.fixture(scope="module")
def sp_model(sp_tok):
    return make_model(len(sp_tok))


def with_template(tok, template: str):
    tok = copy.deepcopy(tok)
    apply_template(tok, None, template)
    return tok


def ids(tok, *pieces: str) -> list[int]:
    out = [tok.convert_tokens_to_ids(p) for p in pieces]
    assert tok.unk_token_id not in out, pieces
    return out


def chat(tok, model, template: str, system: str | None = None, max_new_tokens: int = 8, **engine_cfg):
    tok = with_template(tok, template)
    engine = ScriptedEngine(model, tok)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=max_new_tokens)
    config = ChatConfig(system=system, sampling=sampling, engine=EngineConfig(**engine_cfg))
    return ChatSession(engine, config), engine


def drain(chunks):
    """The streamed text, the stats and the answer's token ids."""
    chunks = list(chunks)
    return "".join(c.text for c in chunks), chunks[-1].stats, [i for c in chunks for i in c.token_ids]


def send(s: ChatSession, text: str):
    return drain(s.send(text))


def send_retry(s: ChatSession):
    return drain(s.retry())


def new_tokens(s: ChatSession, user: str, after: str | None) -> int:
    """Tokens a turn must feed: those of a fresh tokenization of the conversation (with the
    new message and the generation prompt) after the previous answer's text `after`."""
    text = s.render([*s.messages(), {"role": "user", "content": user}], add_generation_prompt=True)
    start = 0 if after is None else text.rindex(after) + len(after)
    fresh = s.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return sum(1 for a, b in fresh["offset_mapping"] if a >= start and b > a)


CASES = [
    pytest.param("llama2", None, {}, id="llama2"),
    pytest.param("llama2", "Be brief.", {}, id="llama2-system"),
    pytest.param("llama2", None, {"enable_streaming": True, "recent_size": 400}, id="llama2-streaming"),
    pytest.param("vicuna", None, {}, id="vicuna"),
    pytest.param("mistral", None, {}, id="mistral"),
    pytest.param("plain", None, {}, id="plain"),
]


@pytest.mark.parametrize(("template", "system", "engine_cfg"), CASES)
def test_each_turn_feeds_only_the_new_tokens(sp_tok, sp_model, template, system, engine_cfg):
    s, engine = chat(sp_tok, sp_model, template, system, **engine_cfg)
    engine.script = [*ids(s.tokenizer, *ANSWER), s.tokenizer.eos_token_id]
    fed, previous = 0, None
    for message in MESSAGES:
        expected = new_tokens(s, message, previous)
        text, stats, generated = send(s, message)
        turn = s.turns[-1]
        assert text == turn.answer == "Hello thank you" and stats.finish_reason == "stop"
        assert stats.context_tokens == expected
        # The answer keeps the ids as generated, and nothing that entered the cache was cut
        # out of it to be fed again.
        assert s.segments[turn.first_segment + 1].ids == generated
        fed += stats.context_tokens + stats.generated_tokens
        assert s.cache.get_seq_length() == len(s.cache_ids) == s.n_fed == fed
        assert_invariant(s)
        previous = turn.answer


@pytest.mark.parametrize("template", ["llama2", "vicuna"])
def test_undo_and_retry_cut_the_cache_back(sp_tok, sp_model, template):
    s, engine = chat(sp_tok, sp_model, template)
    engine.script = [*ids(s.tokenizer, *ANSWER), s.tokenizer.eos_token_id]
    for message in MESSAGES[:2]:
        send(s, message)
    before = (s.rendered, list(s.all_ids), s.n_fed)
    send(s, MESSAGES[2])
    cache = s.cache

    text, stats, _ = send_retry(s)
    assert text == s.turns[-1].answer == "Hello thank you"
    assert s.cache is cache and stats.context_tokens == 1  # cut back, one token fed again
    assert_invariant(s)

    s.undo()
    assert s.cache is cache and (s.rendered, s.all_ids) == before[:2]
    assert s.n_fed >= before[2]  # the undone turn fed the closing text before it
    assert_invariant(s)
    # The next turn feeds only its prompt, and matches a chat that never had the undone turn.
    _, stats, _ = send(s, MESSAGES[3])
    assert stats.context_tokens == len(s.segments[s.turns[-1].first_segment].ids)
    ref, ref_engine = chat(sp_tok, sp_model, template)
    ref_engine.script = engine.script
    for message in [*MESSAGES[:2], MESSAGES[3]]:
        send(ref, message)
    assert s.all_ids == ref.all_ids and s.cache_ids == ref.cache_ids
    assert_invariant(s)


@pytest.mark.parametrize("template", ["llama2", "vicuna"])
def test_continue_joins_the_parts_as_one_answer(sp_tok, sp_model, template):
    s, engine = chat(sp_tok, sp_model, template, max_new_tokens=2)
    engine.script = ids(s.tokenizer, *ANSWER[:2])
    text, stats, _ = send(s, MESSAGES[0])
    assert text == "Hello" and stats.finish_reason == "length"
    assert_invariant(s)
    engine.script = [*ids(s.tokenizer, *ANSWER[2:]), s.tokenizer.eos_token_id]
    chunks = list(
        s.continue_answer(SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=8))
    )
    assert "".join(c.text for c in chunks) == " thank you"  # the space of "▁thank" shows
    assert chunks[-1].stats.finish_reason == "stop"
    assert chunks[-1].stats.context_tokens == 1  # the answer's last token, for the next logits
    turn = s.turns[-1]
    assert turn.answer == "Hello thank you"
    assert s.segments[turn.first_segment + 1].ids == ids(s.tokenizer, *ANSWER)
    assert_invariant(s)
    expected = new_tokens(s, MESSAGES[1], turn.answer)
    _, stats, _ = send(s, MESSAGES[1])
    assert stats.context_tokens == expected
    assert_invariant(s)


@pytest.mark.parametrize("template", ["llama2", "vicuna"])
def test_answer_the_template_writes_otherwise_is_encoded_again(sp_tok, sp_model, template):
    """An answer that starts without "▁" reads "[/INST]lo" as generated, but the template
    writes "[/INST] lo": that answer is encoded again (and fed with the next turn), the rest
    of the cache stays, and the turns stay apart for /retry."""
    s, engine = chat(sp_tok, sp_model, template)
    engine.script = [*ids(s.tokenizer, *ANSWER), s.tokenizer.eos_token_id]
    send(s, MESSAGES[0])
    engine.script = [*ids(s.tokenizer, "lo", "▁thank"), s.tokenizer.eos_token_id]
    text, stats, _ = send(s, MESSAGES[1])
    turn = s.turns[-1]
    assert text == turn.answer == "lo thank"
    assert s.segments[turn.first_segment + 1].text == " lo thank"
    assert s.n_fed == sum(len(seg.ids) for seg in s.segments[: turn.first_segment + 1])
    assert_invariant(s)

    _, stats, _ = send_retry(s)
    assert stats.context_tokens == 1
    assert_invariant(s)
    # The next turn feeds the answer as encoded, its closing text and the new prompt.
    expected = new_tokens(s, MESSAGES[2], s.render(s.messages()[:-1], True))
    _, stats, _ = send(s, MESSAGES[2])
    assert stats.context_tokens == expected
    assert_invariant(s)


def test_stop_string_in_an_answer(sp_tok, sp_model):
    """Vicuna's "USER:" ends the answer: the kept "▁Hel", "lo" stay in the cache; the space
    of "▁USER:" is encoded as "▁" and waits with the closing text."""
    s, engine = chat(sp_tok, sp_model, "vicuna")
    engine.script = [*ids(s.tokenizer, *ANSWER), s.tokenizer.eos_token_id]
    send(s, MESSAGES[0])
    engine.script = ids(s.tokenizer, "▁Hel", "lo", "▁USER:", "▁you")
    text, stats, _ = send(s, MESSAGES[1])
    turn = s.turns[-1]
    assert text == turn.answer == "Hello " and stats.finish_reason == "stop"
    answer = s.segments[turn.first_segment + 1]
    assert answer.text == " Hello " and answer.ids == ids(s.tokenizer, "▁Hel", "lo", "▁")
    assert s.pending_ids == ids(s.tokenizer, "▁", "</s>")
    assert_invariant(s)
    _, stats, _ = send(s, MESSAGES[2])
    assert stats.context_tokens == 2 + len(s.segments[s.turns[-1].first_segment].ids)
    assert_invariant(s)


@pytest.mark.parametrize("template", ["llama2", "vicuna"])
def test_restored_chat_keeps_turns_apart(sp_tok, sp_model, template, tmp_path):
    s, engine = chat(sp_tok, sp_model, template)
    engine.script = [*ids(s.tokenizer, *ANSWER), s.tokenizer.eos_token_id]
    for message in MESSAGES[:2]:
        send(s, message)
    path = s.save(tmp_path / "chat.json")
    loaded, loaded_engine = chat(sp_tok, sp_model, template)
    loaded_engine.script = engine.script
    loaded.restore(read_saved(path))
    assert loaded.messages() == s.messages() and loaded.rendered == s.rendered
    assert all(t.first_segment >= 0 for t in loaded.turns)
    assert_invariant(loaded)
    _, stats, _ = send_retry(loaded)
    assert stats.context_tokens == 1
    assert_invariant(loaded)
    expected = new_tokens(loaded, MESSAGES[2], "Hello thank you")
    _, stats, _ = send(loaded, MESSAGES[2])
    assert stats.context_tokens == expected
    assert_invariant(loaded)
