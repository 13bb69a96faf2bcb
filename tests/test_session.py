"""ChatSession commands on the tiny model: undo, retry, continue, system, save/load, and
random interrupts; after each, the cache invariant holds against an independent reference."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from helpers import assert_ids_match_text, full_logits, needs_kernels

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.saved import read_saved
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine
from chatbot.errors import ChatbotError, ContextFullError

pytestmark = pytest.mark.usefixtures("one_thread")


GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=10)


def assert_invariant(session: ChatSession, check_logits: bool = True) -> None:
    """The rendered text, the ids and the cache agree; prompt spans tokenize as a fresh
    tokenization of the whole text does; the cache's logits equal a full recompute."""
    if not session.turns and not session.segments:
        assert session.cache.get_seq_length() == len(session.cache_ids) == session.n_fed == 0
        return
    assert_ids_match_text(session)
    for turn in session.turns:
        if turn.first_segment >= 0:
            assert session.segments[turn.first_segment].kind == "prompt"
    bounded = session.kv.is_bounded
    session.kv.check()  # the cache's own record
    assert session.cache.get_seq_length() == len(session.cache_ids)
    assert all(layer.get_seq_length() == len(session.cache_ids) for layer in session.cache.layers)
    if not bounded or not session.evicted_total:
        assert len(session.cache_ids) == session.n_fed
        assert session.cache_ids == session.all_ids[: session.n_fed]
    if check_logits and session.cache_ids:
        cache = copy.deepcopy(session.cache)
        ids = list(session.cache_ids)
        pending = session.pending_ids
        if not pending:  # feed the last cached token again for its logits
            for layer in cache.layers:
                layer.crop(-1)
            pending, ids = ids[-1:], ids[:-1]
        model = session.engine.model  # the model itself, not the engine's decode path
        with torch.no_grad():
            got = model(input_ids=torch.tensor([pending]), cache=cache, use_cache=True).logits[0, -1].float()
        ref = full_logits(model, ids + pending)[-1]
        assert torch.allclose(got, ref, atol=1e-3), (got - ref).abs().max()


def answer(chunks) -> tuple[str, object]:
    text, stats = "", None
    for c in chunks:
        text += c.text
        stats = c.stats or stats
    return text, stats


def make(engine, system=None, sampling=GREEDY, **engine_cfg) -> ChatSession:
    return ChatSession(
        engine, ChatConfig(system=system, sampling=sampling, engine=EngineConfig(**engine_cfg))
    )


class Interrupter:
    """Raise KeyboardInterrupt from a forward hook at the n-th call of a decoder layer, or,
    given the fast path's decoder, at the n-th of its native passes too: a Ctrl-C during one
    is raised when the call returns, its tokens in the cache and not yet counted."""

    def __init__(self, model, layer: int, at: int, decoder=None) -> None:
        self.calls = 0
        self.at = at
        self.fired = False
        self.handle = model.model.layers[layer].register_forward_hook(self.hook)
        self.decoder = decoder
        if decoder is not None:
            for name in ("decode", "prefill_rows"):
                setattr(decoder, name, self._after(getattr(decoder, name)))

    def _after(self, call):
        def wrapped(*args, **kwargs):
            out = call(*args, **kwargs)
            self.hook()
            return out

        return wrapped

    def hook(self, *_):
        self.calls += 1
        if self.calls == self.at:
            self.fired = True
            raise KeyboardInterrupt

    def remove(self):
        self.handle.remove()
        if self.decoder is not None:
            for name in ("decode", "prefill_rows"):
                del self.decoder.__dict__[name]


def test_undo_cuts_the_cache_back(tiny_engine):
    s = make(tiny_engine, system="Be brief.")
    answer(s.send("Hello there!"))
    cache = s.cache
    before = (list(s.cache_ids), s.n_fed, s.rendered)
    answer(s.send("How are you today?"))
    removed = s.undo()
    assert removed.user == "How are you today?"
    assert s.cache is cache  # cut back, not re-encoded
    # The same conversation; the cache keeps what the undone turn fed of it (its closing text).
    assert s.rendered == before[2] and s.all_ids[: before[1]] == before[0]
    assert s.n_fed == len(s.all_ids)
    assert_invariant(s)
    # The next turn matches a session that never had the undone one.
    _, stats = answer(s.send("Café 🙂"))
    ref = make(tiny_engine, system="Be brief.")
    answer(ref.send("Hello there!"))
    _, ref_stats = answer(ref.send("Café 🙂"))
    assert s.all_ids == ref.all_ids and s.cache_ids == ref.cache_ids
    prompt_ids = len(s.segments[s.turns[-1].first_segment].ids)
    assert stats.context_tokens == prompt_ids < ref_stats.context_tokens
    assert_invariant(s)
    s.undo()
    s.undo()
    assert s.turns == [] and s.cache.get_seq_length() == len(s.cache_ids) == s.n_fed
    assert_invariant(s)
    with pytest.raises(ChatbotError, match="nothing to undo"):
        s.undo()


def test_retry_refeeds_one_token(tiny_engine):
    s = make(tiny_engine)
    answer(s.send("Hello there!"))
    first, _ = answer(s.send("How are you?"))
    n_turns = len(s.turns)
    text, stats = answer(s.retry())
    assert text == first  # greedy: the same answer again
    assert stats.context_tokens == 1  # only the prompt's last token was fed again
    assert len(s.turns) == n_turns and s.turns[-1].answer == first
    assert_invariant(s)
    hot = SamplingConfig(
        temperature=5.0, top_k=0, top_p=1.0, repetition_penalty=1.0, max_new_tokens=10, seed=3
    )
    other, _ = answer(s.retry(hot))
    assert other != first and s.turns[-1].answer == other
    assert_invariant(s)
    with pytest.raises(ChatbotError):
        make(tiny_engine).retry()


def test_continue_after_max_tokens_equals_one_long_answer(tiny_engine):
    long = make(
        tiny_engine, sampling=SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=16)
    )
    whole, _ = answer(long.send("Hello there!"))
    s = make(tiny_engine, sampling=SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=6))
    part, stats = answer(s.send("Hello there!"))
    assert stats.finish_reason == "length" and whole.startswith(part)
    assert_invariant(s)
    more, _ = answer(
        s.continue_answer(SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=10))
    )
    assert part + more == whole
    assert s.turns[-1].answer == whole and len(s.turns) == 1
    assert s.turns[-1].stats.generated_tokens == 16
    assert s.all_ids == long.all_ids
    assert_invariant(s)


@pytest.mark.parametrize("at", [2, 9, 15])
def test_continue_after_interrupt_equals_uninterrupted(tiny_engine, tiny_model, at):
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=14)
    ref = make(tiny_engine, sampling=sampling, prefill_chunk=8)
    whole, _ = answer(ref.send("The quick brown fox jumps over the lazy dog."))
    s = make(tiny_engine, sampling=sampling, prefill_chunk=8)
    hook = Interrupter(tiny_model, layer=1, at=at)
    shown = ""
    try:
        with pytest.raises(KeyboardInterrupt):
            for c in s.send("The quick brown fox jumps over the lazy dog."):
                shown += c.text
    finally:
        hook.remove()
    assert s.turns[-1].interrupted
    assert_invariant(s)
    kept = s.turns[-1].answer
    assert whole.startswith(kept) and kept.startswith(shown)
    left = 14 - s.turns[-1].stats.generated_tokens
    answer(s.continue_answer(SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=left)))
    assert s.turns[-1].answer == whole
    assert not s.turns[-1].interrupted
    assert_invariant(s)


def test_continue_refuses_a_finished_answer(tiny_engine):
    s = make(tiny_engine)
    with pytest.raises(ChatbotError, match="nothing to continue"):
        s.continue_answer()
    answer(s.send("Hello"))
    s.turns[-1].stats.finish_reason = "stop"
    with pytest.raises(ChatbotError, match="ended by itself"):
        s.continue_answer()


def test_system_prompt_is_replaced_and_reencoded_once(tiny_engine):
    s = make(tiny_engine, system="Be brief.")
    answer(s.send("Hello there!"))
    answer(s.send("How are you?"))
    progress = []
    n = s.set_system("You are a helpful assistant.", on_progress=lambda d, t: progress.append((d, t)))
    assert "You are a helpful assistant." in s.rendered and "Be brief." not in s.rendered
    # Only the shared start ("<|im_start|>system\n") stays; the rest is encoded once.
    assert s.n_fed == len(s.all_ids) and len(s.all_ids) - 10 < n < len(s.all_ids) and progress[-1] == (n, n)
    assert_invariant(s)
    _, stats = answer(s.send("Thanks"))
    assert stats.context_tokens == len(s.segments[s.turns[-1].first_segment].ids)
    assert_invariant(s)
    s.set_system(None)
    assert s.system is None and "helpful" not in s.rendered
    assert_invariant(s)
    s.undo()  # cut points survive the re-encode
    assert_invariant(s)


def test_reset_and_drop_cache(tiny_engine):
    s = make(tiny_engine, system="Be brief.")
    answer(s.send("Hello there!"))
    s.drop_cache()
    assert s.n_fed == 0 and s.cache.get_seq_length() == 0 and s.pending_ids == s.all_ids
    assert_invariant(s)
    _, stats = answer(s.send("Again"))
    assert stats.context_tokens == len(s.all_ids) - len(s.pending_ids) - stats.generated_tokens + (
        1 if stats.finish_reason == "length" else 0
    )
    assert_invariant(s)
    s.reset()
    assert s.turns == [] and s.system == "Be brief."
    assert_invariant(s)
    answer(s.send("Hi"))
    assert_invariant(s)


def test_save_and_load_round_trip(tiny_engine, tmp_path):
    s = make(
        tiny_engine, system="Be brief.", sampling=SamplingConfig(temperature=0.0, max_new_tokens=7, seed=5)
    )
    answer(s.send("Hello there!"))
    answer(s.send("日本語 🙂 and\nnew lines"))
    path = s.save(tmp_path / "chat.json", model="tiny")
    data = json.loads(path.read_text())
    assert data["model"] == "tiny" and data["system"] == "Be brief."
    assert data["messages"] == s.messages()
    assert data["settings"]["max_new_tokens"] == 7 and data["settings"]["seed"] == 5
    assert data["turns"][0]["stats"]["generated_tokens"] == s.turns[0].stats.generated_tokens
    t = make(tiny_engine)
    progress = []
    t.restore(read_saved(path), on_progress=lambda d, n: progress.append(d))
    assert t.messages() == s.messages() and t.system == "Be brief."
    assert t.sampling.max_new_tokens == 7 and t.sampling.seed == 5
    assert [x.stats.token_latencies_s for x in t.turns] == [
        [round(v, 6) for v in x.stats.token_latencies_s] for x in s.turns
    ]
    assert progress == sorted(progress) and progress[-1] == len(t.all_ids) == t.n_fed
    assert_invariant(t)
    answer(t.send("More"))
    assert_invariant(t)
    t.undo()
    t.undo()
    assert_invariant(t)


def test_load_plain_messages_and_bad_files(tiny_engine, tmp_path):
    s = make(tiny_engine)
    answer(s.send("Hello"))
    before = s.messages()
    bad = {
        "missing.json": None,
        "notjson.json": "{nope",
        "list.json": "[1, 2]",
        "empty.json": "{}",
        "badturn.json": json.dumps({"turns": [{"user": 3}]}),
        "order.json": json.dumps({"messages": [{"role": "assistant", "content": "x"}]}),
        "binary.json": b"\xff\xfe\x00garbage",
    }
    for name, content in bad.items():
        p = tmp_path / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        elif content is not None:
            p.write_text(content)
        with pytest.raises(ChatbotError):
            s.restore(read_saved(p))
        assert s.messages() == before
        assert_invariant(s)
    # A bad setting does not refuse the chat: it is named and left as it was.
    warnings: list[str] = []
    other = make(tiny_engine)
    other.restore({"messages": [], "settings": {"temperature": "hot", "top_k": 3}}, warnings=warnings)
    assert other.sampling.top_k == 3 and other.sampling.temperature == GREEDY.temperature
    assert len(warnings) == 1 and "temperature must be" in warnings[0]
    p = tmp_path / "plain.json"
    p.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Sys"},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"},
                ]
            }
        )
    )
    s.restore(read_saved(p))
    assert s.system == "Sys" and [t.answer for t in s.turns] == ["Hello!"]
    assert_invariant(s)


def test_load_too_long_keeps_conversation_pending(tiny_model, tiny_tokenizer, tmp_path):
    engine = Engine(tiny_model, tiny_tokenizer, max_context=60)
    s = make(engine)
    p = tmp_path / "long.json"
    p.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "Hello there! " * 20},
                    {"role": "assistant", "content": "ok"},
                ]
            }
        )
    )
    with pytest.raises(ContextFullError):
        s.restore(read_saved(p))
    assert len(s.turns) == 1 and s.n_fed == 0
    assert_invariant(s)
    s.reset()
    answer(s.send("Hi"))
    assert_invariant(s)


@pytest.fixture(params=["transformers", pytest.param("fast", marks=needs_kernels)])
def any_engine(request, tiny_model, tiny_tokenizer):
    """The engine with transformers' forward pass for decoding, and with the native fast path."""
    if request.param == "transformers":
        return Engine(tiny_model, tiny_tokenizer)
    from chatbot.engine.backends.native.decoder import FastDecoder

    return Engine(tiny_model, tiny_tokenizer, decoder=FastDecoder(tiny_model, "auto"))


def test_random_interrupts_keep_the_invariant(any_engine, tiny_model):
    """Ctrl-C at random forward passes (prefill chunks and decode steps, either layer),
    during send, retry and continue: the session always goes on, consistent."""
    rng = random.Random(1234)
    s = make(
        any_engine,
        system="Be brief.",
        prefill_chunk=8,
        sampling=SamplingConfig(temperature=1.0, top_k=40, repetition_penalty=1.1, max_new_tokens=12, seed=1),
    )
    texts = ["Hello there!", "How are you today? " * 3, "Café 🙂 日本語", "def add(a, b):\n    return a + b"]
    interrupted = 0
    for i in range(120):
        action = rng.choice(["send", "send", "retry", "continue", "undo"])
        hook = Interrupter(
            tiny_model, layer=rng.randrange(2), at=rng.randint(1, 20), decoder=any_engine.decoder
        )
        try:
            if action == "send":
                answer(s.send(rng.choice(texts)))
            elif action == "retry" and s.turns:
                answer(s.retry())
            elif action == "continue" and s.can_continue():
                answer(s.continue_answer())
            elif action == "undo" and s.turns:
                s.undo()
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            hook.remove()
        assert_invariant(s)
        if len(s.all_ids) > 400:
            s.reset()
    assert interrupted >= (40 if any_engine.decoder is None else 8)  # the fast path decodes natively
    answer(s.send("Still there?"))
    assert_invariant(s)


def test_interrupt_in_consumer_keeps_shown_text(tiny_engine):
    """A Ctrl-C that lands while the caller renders (the generator is closed at a yield)."""
    s = make(
        tiny_engine,
        sampling=SamplingConfig(
            temperature=0.0, repetition_penalty=1.0, max_new_tokens=12, stream_interval=2
        ),
    )
    chunks = s.send("Hello there!")
    shown = ""
    for c in chunks:
        shown += c.text
        if len(shown) > 3:
            break
    chunks.close()
    assert s.turns[-1].interrupted and s.turns[-1].answer.startswith(shown)
    assert_invariant(s)


def test_interrupt_before_anything_is_fed_leaves_no_turn(tiny_engine, tiny_model):
    s = make(tiny_engine)
    answer(s.send("Hello"))
    state = (s.rendered, list(s.cache_ids), len(s.turns))
    hook = Interrupter(tiny_model, layer=0, at=1)
    try:
        with pytest.raises(KeyboardInterrupt):
            answer(s.send("Another"))
    finally:
        hook.remove()
    assert (s.rendered, list(s.cache_ids), len(s.turns)) == state
    assert_invariant(s)


def test_streaming_cache_undo_after_eviction_falls_back(tiny_engine):
    s = make(
        tiny_engine,
        system="Be brief.",
        enable_streaming=True,
        start_size=4,
        recent_size=64,
        sampling=SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=16),
    )
    for text in ["Hello there! How are you today?", "The quick brown fox.", "Café, naïve, résumé."]:
        answer(s.send(text))
        assert_invariant(s, check_logits=False)
    assert s.evicted_total > 0
    s.undo()
    assert_invariant(s, check_logits=False)
    answer(s.send("Again"))
    assert_invariant(s, check_logits=False)
    answer(s.retry())
    assert_invariant(s, check_logits=False)


def test_interrupted_load_keeps_the_rest_pending(tiny_engine, tiny_model, tmp_path):
    s = make(tiny_engine, prefill_chunk=8)
    for text in ["Hello there!", "How are you today?", "Café 🙂"]:
        answer(s.send(text))
    path = s.save(tmp_path / "c.json")
    t = make(tiny_engine, prefill_chunk=8)
    hook = Interrupter(tiny_model, layer=1, at=3)
    try:
        with pytest.raises(KeyboardInterrupt):
            t.restore(read_saved(path))
    finally:
        hook.remove()
    assert t.messages() == s.messages() and 0 < t.n_fed < len(t.all_ids)
    assert_invariant(t)
    answer(t.send("Go on"))
    assert_invariant(t)


@pytest.mark.slow
def test_commands_keep_the_invariant_on_the_default_model(default_model, tmp_path):
    """The real tokenizer and template (ChatML, BPE with answers kept as generated)."""
    engine = Engine(default_model.model, default_model.tokenizer)
    s = make(
        engine,
        system="You are a concise assistant. Café ☕.",
        sampling=SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=12),
    )

    def check():
        assert_invariant(s, check_logits=False)
        cache = copy.deepcopy(s.cache)
        ids, pending = list(s.cache_ids), s.pending_ids
        if not pending:
            for layer in cache.layers:
                layer.crop(-1)
            pending, ids = ids[-1:], ids[:-1]
        with torch.no_grad():
            got = (
                engine.model(input_ids=torch.tensor([pending]), cache=cache, use_cache=True)
                .logits[0, -1]
                .float()
            )
        ref = full_logits(engine.model, ids + pending)[-1]
        assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3)

    answer(s.send("Hi! Name a colour."))
    check()
    hook = Interrupter(engine.model, layer=10, at=5)
    try:
        with pytest.raises(KeyboardInterrupt):
            answer(s.send("Count from one to twenty in words."))
    finally:
        hook.remove()
    check()
    answer(s.continue_answer())
    check()
    answer(s.retry(SamplingConfig(temperature=0.8, max_new_tokens=8, seed=2)))
    check()
    s.undo()
    check()
    s.set_system("Réponds en français.")
    check()
    answer(s.send("Merci 🙂 — 日本語で?"))
    check()
    path = s.save(tmp_path / "c.json")
    s.reset()
    s.restore(read_saved(path))
    check()


def test_model_counts_the_cache_as_the_toolbar_and_the_stats_line(tiny_engine):
    """/model said `cache 258 / 8,192` where the toolbar and the stats line said 260: it left
    out the closing text of the last answer that waits to enter the cache."""
    from types import SimpleNamespace

    session = make(tiny_engine)
    chunks = list(session.send("hello there"))
    count = session.cache_count()
    assert session.pending_ids and count == len(session.cache_ids) + len(session.pending_ids)
    model = SimpleNamespace(name="tiny", describe=lambda: {"model": "tiny"})
    _, rows = session.describe_model(model)
    assert rows["cache"].startswith(f"{count:,} / ")
    assert session.meter().used == count == chunks[-1].stats.cache_tokens
