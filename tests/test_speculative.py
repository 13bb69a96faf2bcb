"""Speculative decoding by n-gram lookup (`--draft ngram`, `chatbot.engine.speculative`): the
same greedy answer as plain decoding, token for token; sampled answers from the same
distribution (a chi-square test against the exact distribution of a full recompute); stops,
the length limit, a bounded cache and /undo, /retry leave the cache as plain decoding does."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch
from helpers import assert_ids_match_text, full_logits, make_model, needs_kernels

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine import speculative
from chatbot.engine.backends.base import NativeBackend
from chatbot.engine.generate import Engine
from chatbot.engine.sampling import build_logits_processor

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def cheap_passes(monkeypatch):
    """Passes priced by a fixed table (cheap: a draft always pays), not by this machine's
    timings, so the drafts these tests check run whatever the load (the policy itself:
    tests/test_draft_policy.py)."""
    monkeypatch.setattr(speculative, "PRIOR_FIXED", 0.5)
    monkeypatch.setattr(speculative, "PRIOR_ROW", 0.1)
    monkeypatch.setattr(speculative.DraftPolicy, "step_took", lambda self, seconds: None)
    monkeypatch.setattr(speculative.DraftPolicy, "pass_took", lambda self, rows, seconds: None)


GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=48)
# Prompts whose greedy answers repeat them (the tiny model falls into loops the n-gram
# lookup then predicts), and random ones where drafts are mostly rejected.
LOOPING = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42, 43, 44] * 4, list(range(20, 60))]


@pytest.fixture(scope="module")
def varied_model(tiny_tokenizer):
    """A tiny model whose greedy answers wander in and out of loops (the sharp `tiny_model`
    repeats its last token for ever, so every draft would be kept)."""
    model = make_model(len(tiny_tokenizer), sharp=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


@pytest.fixture
def varied_engine(varied_model, tiny_tokenizer):
    return Engine(varied_model, tiny_tokenizer)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    randoms = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (12, 30, 60)]
    # random text whose last tokens occurred before: a draft the model mostly rejects
    echoes = [r + r[:k] for r, k in zip(randoms, (3, 2, 5))]
    return [*LOOPING, *randoms, *echoes]


def _run(engine: Engine, prompt: list[int], sampling: SamplingConfig, kv=None, **kwargs):
    kv = kv if kv is not None else engine.new_cache()
    tokens: list[int] = []
    stats = None
    for chunk in engine.generate(kv, prompt, sampling, **kwargs):
        tokens.extend(chunk.token_ids)
        stats = chunk.stats or stats
    return tokens, stats, kv


def _check_cache(engine: Engine, kv, ids: list[int], plain_kv=None) -> None:
    """The cache holds `ids` (all, or all but the last), as the plain run's cache `plain_kv`
    does, and its logits after one more token equal a full recompute's (the tail a rejected
    draft wrote is gone)."""
    kv.check()
    assert kv.ids == ids[: len(kv.ids)] and len(kv.ids) >= len(ids) - 1
    if plain_kv is not None:
        assert kv.ids == plain_kv.ids
    rest = ids[len(kv.ids) :] or [3]
    got = engine.prefill(kv, rest)
    ref = full_logits(engine.model, [*kv.ids[: -len(rest)], *rest])[-1]
    assert torch.allclose(got, ref, atol=1e-3), (got - ref).abs().max()


def _engines(model, tok, native: bool) -> Engine:
    if not native:
        return Engine(model, tok)
    from chatbot.engine.backends.native.decoder import FastDecoder

    return Engine(model, tok, backend=NativeBackend(model, FastDecoder(model, "f32", threads=1)))


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)], ids=["hf", "native"])
def test_greedy_answer_is_token_for_token_the_plain_one(varied_model, tiny_tokenizer, native):
    engine = _engines(varied_model, tiny_tokenizer, native)
    drafting = dataclasses.replace(GREEDY, draft="ngram")
    drafted = kept = 0
    for prompt in _prompts(varied_model.config.vocab_size):
        plain, plain_stats, plain_kv = _run(engine, prompt, GREEDY)
        tokens, stats, kv = _run(engine, prompt, drafting)
        assert tokens == plain, prompt
        assert plain_stats.draft_tokens == 0 and stats.generated_tokens == len(plain)
        drafted += stats.draft_tokens
        kept += stats.draft_accepted
        _check_cache(engine, kv, prompt + tokens, plain_kv)
    assert drafted > kept > drafted // 3  # drafts ran, many were kept, some were rejected


def test_repetition_penalty_sees_the_draft_tokens_kept_before(varied_engine):
    sampling = dataclasses.replace(GREEDY, repetition_penalty=1.3, repeat_last_n=8)
    drafted = kept = 0
    for prompt in _prompts(varied_engine.model.config.vocab_size):
        plain, _, _ = _run(varied_engine, prompt, sampling)
        tokens, stats, _ = _run(varied_engine, prompt, dataclasses.replace(sampling, draft="ngram"))
        assert tokens == plain
        drafted += stats.draft_tokens
        kept += stats.draft_accepted
    assert drafted > kept > 0


def test_stops_and_the_length_limit_inside_a_kept_draft(varied_engine):
    tiny_engine = varied_engine
    prompt = LOOPING[0]
    plain, _, _ = _run(tiny_engine, prompt, GREEDY)
    drafting = dataclasses.replace(GREEDY, draft="ngram")
    _, stats, _ = _run(tiny_engine, prompt, drafting)
    assert stats.draft_accepted >= 8
    for n in (1, 2, 7, 13):
        limit = dataclasses.replace(GREEDY, max_new_tokens=n)
        tokens, stats, kv = _run(tiny_engine, prompt, dataclasses.replace(limit, draft="ngram"))
        assert tokens == plain[:n] and stats.finish_reason == "length"
        _check_cache(tiny_engine, kv, prompt + tokens, _run(tiny_engine, prompt, limit)[2])
    at = next(i for i in range(3, len(plain)) if plain[i] not in plain[:i])  # a first occurrence
    tokens, stats, kv = _run(tiny_engine, prompt, drafting, stop_ids=[plain[at]])
    assert tokens == plain[:at] and stats.finish_reason == "stop"
    plain_kv = _run(tiny_engine, prompt, GREEDY, stop_ids=[plain[at]])[2]
    _check_cache(tiny_engine, kv, prompt + tokens, plain_kv)  # the stop id is not in the cache

    def after(n):
        calls = []

        def stop(ids, scores):  # a stop string matched at the n-th answer token
            calls.append(1)
            return len(calls) == n

        return stop

    tokens, stats, kv = _run(tiny_engine, prompt, drafting, stopping_criteria=after(10))
    assert tokens == plain[:10] and stats.finish_reason == "stop"
    _check_cache(
        tiny_engine, kv, prompt + tokens, _run(tiny_engine, prompt, GREEDY, stopping_criteria=after(10))[2]
    )


def test_a_bounded_cache_evicts_as_plain_decoding_does(varied_engine):
    engine = varied_engine
    prompt = LOOPING[0]
    sampling = dataclasses.replace(GREEDY, max_new_tokens=120)
    plain, _, plain_kv = _run(engine, prompt, sampling, kv=engine.new_cache(4, 28))
    tokens, stats, kv = _run(engine, prompt, dataclasses.replace(sampling, draft="ngram"),
                             kv=engine.new_cache(4, 28))  # fmt: skip
    assert tokens == plain and stats.draft_accepted > 20
    assert kv.ids == plain_kv.ids and kv.evicted_total == plain_kv.evicted_total > 0
    kv.check()


def _exact_pairs(model, prompt: list[int], sampling: SamplingConfig) -> dict[tuple[int, int], float]:
    """P(first two answer tokens) under `sampling`, from full recomputes."""
    processors = build_logits_processor(sampling)

    def probs(ids: list[int]) -> torch.Tensor:
        scores = processors(torch.tensor([ids]), full_logits(model, ids)[-1][None])
        return torch.softmax(scores[0].double(), -1)

    first = probs(prompt)
    out = {}
    for a in torch.nonzero(first > 0).flatten().tolist():
        second = probs([*prompt, a])
        for b in torch.nonzero(second > 0).flatten().tolist():
            out[(a, b)] = float(first[a] * second[b])
    return out


def _chi_square_limit(df: int, z: float = 3.719) -> float:
    """The chi-square quantile for `df` at the normal quantile `z` (3.719: p = 1e-4),
    Wilson-Hilferty's approximation."""
    k = 2 / (9 * df)
    return df * (1 - k + z * math.sqrt(k)) ** 3


def test_sampled_answers_follow_the_plain_distribution(tiny_engine, tiny_model, monkeypatch):
    """The first two tokens of many sampled answers, each seed drafting a fixed token after
    the first (kept with its probability, else replaced from the rest): their frequencies
    fit the exact distribution (chi-square), so the accept/reject rule is exact."""
    prompt = [7, 30, 31, 9, 12]
    sampling = SamplingConfig(temperature=1.5, top_k=4, top_p=1.0, repetition_penalty=1.5,
                              max_new_tokens=3, draft="ngram")  # fmt: skip
    exact = _exact_pairs(tiny_model, prompt, sampling)
    likely = max(exact, key=exact.__getitem__)
    guess = likely[1]  # drafted after whatever came first: kept often, rejected often
    monkeypatch.setattr(speculative.NgramDrafter, "propose", lambda self, limit: [guess][:limit])
    n = 3000
    seen = Counter()
    drafted = kept = 0
    for seed in range(n):
        generator = torch.Generator().manual_seed(seed)
        tokens, stats, _ = _run(tiny_engine, prompt, sampling, generator=generator)
        seen[tuple(tokens[:2])] += 1
        drafted += stats.draft_tokens
        kept += stats.draft_accepted
    assert drafted == n and 0.1 * n < kept < 0.9 * n  # both branches of the rule ran
    assert set(seen) <= set(exact)
    # bins of at least 5 expected draws; the rare pairs pooled into one
    common = [pair for pair, p in exact.items() if p * n >= 5]
    observed = [seen[pair] for pair in common]
    expected = [exact[pair] * n for pair in common]
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    assert stat < _chi_square_limit(len(observed) - 1), (stat, observed, expected)


def _session(engine: Engine, sampling: SamplingConfig) -> ChatSession:
    return ChatSession(engine, ChatConfig(sampling=sampling, engine=EngineConfig()))


def _answer(chunks) -> str:
    return "".join(chunk.text for chunk in chunks)


def test_undo_and_retry_after_a_drafted_turn_keep_the_cache_consistent(varied_engine):
    tiny_engine = varied_engine
    sampling = dataclasses.replace(GREEDY, max_new_tokens=30)
    drafting = dataclasses.replace(sampling, draft="ngram")
    s, ref = _session(tiny_engine, drafting), _session(tiny_engine, sampling)
    text = "abc abc abc abc abc abc abc abc"
    for session in (s, ref):
        _answer(session.send(text))
        _answer(session.send("Say it again: " + text))
    assert s.all_ids == ref.all_ids and s.cache_ids == ref.cache_ids
    assert any(t.stats.draft_tokens for t in s.turns)
    assert_ids_match_text(s)
    s.undo()
    ref.undo()
    assert s.cache_ids == ref.cache_ids
    assert _answer(s.retry()) == _answer(ref.retry())
    assert s.all_ids == ref.all_ids and s.cache_ids == ref.cache_ids
    s.kv.check()
    assert_ids_match_text(s)
    _check_cache(tiny_engine, s.kv, list(s.all_ids[: len(s.cache_ids) + 1]))


@pytest.mark.slow
@needs_kernels
def test_default_model_repeats_a_text_with_most_drafts_kept(default_model):
    from importlib import resources

    from chatbot.engine.backends.choose import backend_for

    backend, reason = backend_for(default_model.model, "auto", 2)
    assert reason is None
    engine = Engine(default_model.model, default_model.tokenizer, backend=backend)
    text = resources.files("chatbot").joinpath("data/long_text.txt").read_text()[:1200]
    messages = [{"role": "user", "content": "Repeat this text word for word:\n\n" + text}]
    prompt = default_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = default_model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    sampling = dataclasses.replace(GREEDY, max_new_tokens=96)
    plain, _, _ = _run(engine, list(prompt), sampling)
    tokens, stats, _ = _run(engine, list(prompt), dataclasses.replace(sampling, draft="ngram"))
    assert tokens == plain
    assert stats.draft_accepted > 0.5 * stats.draft_tokens > 0


def test_the_setting_and_the_stats_line():
    from chatbot.engine.stats import TurnStats
    from chatbot.errors import ConfigError
    from chatbot.terminal.render import format_stats_line

    assert SamplingConfig().draft == "off"
    assert SamplingConfig().with_value("draft", "NGRAM").draft == "ngram"
    assert SamplingConfig().with_value("draft", "model").draft == "model"  # --draft FILE's
    with pytest.raises(ConfigError, match="draft must be one of ngram, model, off"):
        SamplingConfig().with_value("draft", "a.gguf")
    with pytest.raises(ConfigError, match="draft_tokens"):
        SamplingConfig().with_value("draft_tokens", 16)
    stats = TurnStats(generated_tokens=20, draft_tokens=10, draft_accepted=7, token_latencies_s=[0.01] * 19)
    assert "draft 70%" in format_stats_line(stats)
    assert "draft" not in format_stats_line(TurnStats(generated_tokens=20, token_latencies_s=[0.01] * 19))
