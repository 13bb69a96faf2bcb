"""`FastDecoder.decode_batch`: one pass over the weights for several conversations, each on
its own cache, gives each the logits (bit for bit) and so the greedy answer it gets alone."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, needs_kernels

from chatbot.engine.backends.native.decoder import FastDecoder
from chatbot.engine.generate import Engine


def _prompts(vocab: int, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (5 + 7 * i,), generator=gen).tolist() for i in range(n)]


def _greedy_alone(engine: Engine, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    kv = engine.new_cache()
    logits = engine.prefill(kv, prompt)
    answer, seen = [], []
    for _ in range(steps):
        token = int(logits.argmax())
        answer.append(token)
        assert engine.decoder is not None
        logits = engine.decoder.decode(kv.cache, token)
        seen.append(logits)
    return answer, seen


def _check(model, level: str, steps: int = 6, rows: int = 4) -> None:
    decoder = FastDecoder(model, level, threads=1)
    engine = Engine(model, None, decoder=decoder)
    vocab = model.config.vocab_size
    prompts = _prompts(min(vocab, 400), rows)
    alone = [_greedy_alone(engine, p, steps) for p in prompts]
    # the batch, step by step, against each conversation's logits alone
    kvs = [engine.new_cache() for _ in prompts]
    logits = torch.stack([engine.prefill(kv, p) for kv, p in zip(kvs, prompts)])
    for step in range(steps):
        tokens = [alone[i][0][step] for i in range(rows)]
        assert tokens == [int(t) for t in logits.argmax(-1)]
        logits = decoder.decode_batch([kv.cache for kv in kvs], tokens)
        for i in range(rows):
            assert torch.equal(logits[i], alone[i][1][step]), (level, step, i)


@needs_kernels
@pytest.mark.parametrize("level", ["f32", "int8", "int4"])
def test_decode_batch_equals_decode_alone_tiny(level):
    _check(make_model(400), level)


@needs_kernels
def test_decode_batch_rows_at_different_positions_and_one_row(tiny_model):
    decoder = FastDecoder(tiny_model, "f32", threads=1)
    engine = Engine(tiny_model, None, decoder=decoder)
    kv = engine.new_cache()
    engine.prefill(kv, [5, 6, 7])
    other = engine.new_cache()
    engine.prefill(other, [5, 6, 7])
    assert torch.equal(decoder.decode_batch([kv.cache], [9])[0], decoder.decode(other.cache, 9))
    with pytest.raises(ValueError):
        decoder.decode_batch([kv.cache], [9, 10])


@needs_kernels
@pytest.mark.slow
def test_decode_batch_equals_decode_alone_default_model(default_model):
    """The Q4_1 / Q8_0 products with int16 inputs of `--opt auto` (the batched kernels of
    the default model) equal the one-row ones bit for bit."""
    _check(default_model.model, "auto", steps=4)


def rows_equal_steps(model, level: str, sizes=(2, 3, 5, 8, 9, 16)) -> None:
    """`prefill_rows(every=True)` of k tokens (a speculative draft's verification) gives the
    logits and cache of decoding them one by one, bit for bit, for each k in `sizes`, at 1
    and 2 threads: the batched products for every batch size (grouped ones included)."""
    decoder = FastDecoder(model, level)
    ids = [(i * 7919) % 3000 + 10 for i in range(40)]
    for threads in (1, 2):
        decoder.threads = threads
        for k in sizes:
            rows, steps = decoder.new_cache(), decoder.new_cache()
            for cache in (rows, steps):
                decoder.prefill_rows(cache, ids[:16])
                decoder.prefill_rows(cache, ids[16:20])
            got = decoder.prefill_rows(rows, ids[20 : 20 + k], every=True)
            want = torch.stack([decoder.decode(steps, t) for t in ids[20 : 20 + k]])
            assert torch.equal(got, want), (threads, k)
            after = decoder.decode(rows, 7), decoder.decode(steps, 7)
            assert torch.equal(*after), (threads, k)


@needs_kernels
@pytest.mark.slow
def test_rows_of_every_size_equal_steps_default_model(default_model):
    """The default model at `--opt auto`: Q4_1 layers with int8 inputs (the multi-input
    product for 2..16 rows), the Q8_0 head with int16 ones."""
    rows_equal_steps(default_model.model, "auto")


@needs_kernels
def test_worker_batches_concurrent_requests_with_the_answers_they_get_alone(tiny_model, tiny_tokenizer):
    """Requests sent at once generate together (batched steps) and get, token for token, the
    greedy answers each gets alone; stop strings and logprobs stay per request. A request's
    prefill runs beside the steps of those already decoding."""
    import threading
    import time

    from chatbot.config import EngineConfig, SamplingConfig
    from chatbot.server.pool import Conversation, PrefixCachePool
    from chatbot.server.worker import Job, Worker

    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=60)

    def answers(slots: int) -> tuple[list[str], Worker]:
        decoder = FastDecoder(tiny_model, "f32", threads=1)
        pool = PrefixCachePool(
            Engine(tiny_model, tiny_tokenizer, decoder=decoder), EngineConfig(), sampling, max_entries=0
        )
        worker = Worker(pool, slots=slots)
        engine = pool.engine  # the worker's: on the batched backend where slots > 1
        # The tiny model's times in the real model's proportions: a prefill (0.15 s) lasts a
        # few steps (20 ms each), an answer many.
        prefill, decode_batch = engine.prefill, decoder.decode_batch

        def slow_prefill(*args, **kwargs):
            time.sleep(0.02)
            return prefill(*args, **kwargs)

        def slow_step(*args, **kwargs):
            time.sleep(0.002)
            return decode_batch(*args, **kwargs)

        engine.prefill = slow_prefill  # type: ignore[method-assign]
        decoder.decode_batch = slow_step  # type: ignore[method-assign]
        texts = [""] * 5
        done = [threading.Event() for _ in texts]

        def emit(i: int):
            def put(event):
                if event[0] == "text":
                    texts[i] += event[1][0]
                elif event[0] in ("done", "error"):
                    assert event[0] == "done", event
                    done[i].set()

            return put

        for i in range(len(texts)):
            conv = Conversation(None, [], f"Hello number {i} " * (i + 1)) if i < 4 else None
            worker.submit(Job(conv, sampling, emit(i), prompt="Once upon", stops=("zz",), logprobs=2))
        assert all(d.wait(60) for d in done)
        worker.stop()
        for thread in worker.threads:
            thread.join(10)
        return texts, worker

    alone, _ = answers(1)
    together, worker = answers(8)
    assert together == alone
    batcher = worker.batched.batcher
    assert batcher is not None and batcher.rows > batcher.steps  # some steps held several
    assert batcher.overlapped > 0  # some ran while a later request prefilled


@needs_kernels
def test_prefill_rows_and_decode_batch_at_once_in_two_threads(tiny_model):
    """A server runs a new request's prefill beside the others' batched steps: the two calls,
    each in its own thread (two kernel threads each), give what they give one after the other."""
    import threading

    decoder = FastDecoder(tiny_model, "f32", threads=2)
    engine = Engine(tiny_model, None, decoder=decoder)
    prompts = _prompts(400, 3)

    def batch_run() -> list[torch.Tensor]:
        kvs = [engine.new_cache() for _ in prompts[:2]]
        for kv, p in zip(kvs, prompts):
            engine.prefill(kv, p)
        return [decoder.decode_batch([kv.cache for kv in kvs], [7 + s, 9 + s]) for s in range(40)]

    def prefill_run() -> list[torch.Tensor]:
        out = []
        for s in range(40):
            cache = decoder.new_cache()
            out.append(decoder.prefill_rows(cache, [(s + i) % 300 + 3 for i in range(12)]))
        return out

    alone = (batch_run(), prefill_run())
    together: dict[str, list[torch.Tensor]] = {}
    threads = [
        threading.Thread(target=lambda: together.__setitem__("batch", batch_run())),
        threading.Thread(target=lambda: together.__setitem__("prefill", prefill_run())),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(torch.equal(a, b) for a, b in zip(alone[0], together["batch"]))
    assert all(torch.equal(a, b) for a, b in zip(alone[1], together["prefill"]))


@needs_kernels
def test_a_continue_right_after_a_client_left_takes_its_conversation():
    """A client stops reading mid-answer and at once asks to continue that answer. The new
    request waits for the left generation to end (its next batched step) and takes its
    conversation from the pool: the prompt is not prefilled again. Before, it could take the
    engine between two of that generation's steps, find the pool empty and prefill it all."""
    import threading
    import time

    from serve_helpers import printable_tiny_model

    from chatbot.config import EngineConfig, SamplingConfig
    from chatbot.server.pool import Conversation, PrefixCachePool
    from chatbot.server.worker import Job, Worker

    model, tok = printable_tiny_model()  # text in every step (a newline-only answer waits)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=40)
    decoder = FastDecoder(model, "f32", threads=1)
    pool = PrefixCachePool(Engine(model, tok, decoder=decoder), EngineConfig(), sampling)
    worker = Worker(pool, slots=2)
    assert worker.batched is not None and worker.batched.batcher is not None
    batcher = worker.batched.batcher
    got: list[str] = []
    done: list[dict] = []
    finished = threading.Event()

    def put_second(event):
        if event[0] in ("done", "error"):
            done.append(event[1])
            finished.set()

    def put_first(event):
        if event[0] != "text":
            return
        got.append(event[1][0])
        if len(got) == 3:  # the client's next request comes (it stops reading just after)
            partial = "".join(got)  # as the protocol reads a continue_final_message request
            turns = [("Hello there!", partial)]
            conv = Conversation("Be brief.", turns, "Hello there!", partial_answer=partial)
            worker.submit(Job(conv, sampling, put_second))
            time.sleep(0.5)  # its thread is now waiting for the engine

    step = batcher.step

    def step_after_the_client_left(cache, token):
        # The client's disconnect is seen between two steps: after the generation last
        # looked for it, before the next request takes the engine (the server's race).
        if len(got) >= 3:
            first.cancel.set()
        return step(cache, token)

    batcher.step = step_after_the_client_left  # type: ignore[method-assign]
    first = Job(Conversation("Be brief.", [], "Hello there!"), sampling, put_first)
    worker.submit(first)
    assert finished.wait(60)
    worker.stop(10)
    assert isinstance(done[0], dict), done
    assert done[0]["cached_tokens"] > 0 and done[0]["cached_tokens"] >= done[0]["prompt_tokens"] - 2
    assert pool.stats.hits == 1 and pool.stats.misses == 1
