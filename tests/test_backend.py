"""The backends behind one interface: the generation loop runs on any of them without asking
which it has, and a server gets batching by wrapping one, not by changing the engine."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_by_recompute, needs_kernels

from chatbot.config import EngineConfig, SamplingConfig
from chatbot.engine.backends.base import Backend, BatchedBackend, HFBackend, NativeBackend
from chatbot.engine.backends.choose import serving_backend
from chatbot.engine.generate import Engine

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=10)


class CountingBackend(HFBackend):
    """transformers' forward pass, counting the calls the loop makes and the contexts it holds."""

    def __init__(self, model):
        super().__init__(model)
        self.calls: list[tuple[str, int]] = []
        self.held: list[str] = []

    def prefill(self, cache, ids):
        self.calls.append(("prefill", len(ids)))
        return super().prefill(cache, ids)

    def step(self, cache, token):
        self.calls.append(("step", 1))
        return super().prefill(cache, (token,))

    def prefilling(self):
        self.held.append("prefilling")
        return super().prefilling()

    def decoding(self):
        self.held.append("decoding")
        return super().decoding()


def test_the_loop_runs_on_any_backend_and_steps_each_fed_token_once(tiny_model, tiny_tokenizer):
    backend = CountingBackend(tiny_model)
    assert isinstance(backend, Backend)
    engine = Engine(tiny_model, tiny_tokenizer, backend=backend)
    prompt = list(range(5, 25))
    kv = engine.new_cache()
    chunks = list(engine.generate(kv, prompt, GREEDY, prefill_chunk=8))
    got = [t for c in chunks for t in c.token_ids]
    assert got == greedy_by_recompute(tiny_model, prompt, GREEDY.max_new_tokens)
    # the prompt in chunks of 8, then one step per answer token but the last (never fed)
    assert backend.calls == [("prefill", 8), ("prefill", 8), ("prefill", 4)] + [("step", 1)] * 9
    assert backend.held == ["prefilling", "decoding"]
    assert kv.length == len(prompt) + GREEDY.max_new_tokens - 1


def test_a_batched_backend_needs_one_that_can_batch(tiny_model):
    with pytest.raises(ValueError, match="cannot step several caches at once"):
        BatchedBackend(HFBackend(tiny_model))
    plain = HFBackend(tiny_model)
    assert serving_backend(plain, 8) is plain  # one generation at a time


@needs_kernels
def test_native_backend_gives_transformers_greedy_tokens(tiny_model, tiny_tokenizer):
    from chatbot.engine.backends.native.decoder import FastDecoder

    decoder = FastDecoder(tiny_model, "f32", threads=1)
    engines = [Engine(tiny_model, tiny_tokenizer), Engine(tiny_model, tiny_tokenizer, decoder=decoder)]
    assert isinstance(engines[1].backend, NativeBackend)
    prompt = list(range(5, 40))
    answers = []
    for engine in engines:
        chunks = engine.generate(
            engine.new_cache(), prompt, SamplingConfig(temperature=0.0, max_new_tokens=32)
        )
        answers.append([t for c in chunks for t in c.token_ids])
    assert answers[0] == answers[1]
    assert "transformers" in engines[0].backend.describe()
    assert engines[1].backend.describe() == decoder.info().label()


@needs_kernels
def test_the_server_wraps_the_backend_and_leaves_the_engine_as_it_was(tiny_model, tiny_tokenizer):
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.server.pool import PrefixCachePool
    from chatbot.server.worker import Worker

    engine = Engine(tiny_model, tiny_tokenizer, decoder=FastDecoder(tiny_model, "f32", threads=1))
    native = engine.backend
    pool = PrefixCachePool(engine, EngineConfig(), GREEDY, max_entries=0)
    worker = Worker(pool, slots=4)
    try:
        assert engine.backend is native  # the caller's engine is untouched
        wrapped = pool.engine.backend
        assert isinstance(wrapped, BatchedBackend) and wrapped.inner is native
        assert worker.slots == 4 and worker.lock is wrapped.cond
        assert pool.engine.model is engine.model and pool.engine.max_context == engine.max_context
        assert "batched steps" in wrapped.describe()
        # a batched backend's one-id prefill equals the native step's (it runs beside others')
        kv_a, kv_b = engine.new_cache(), pool.engine.new_cache()
        engine.prefill(kv_a, [5, 6, 7])
        pool.engine.prefill(kv_b, [5, 6, 7])
        assert torch.equal(engine.prefill(kv_a, [9]), pool.engine.prefill(kv_b, [9]))
    finally:
        worker.stop()
