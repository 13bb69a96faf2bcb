"""`chatbot serve` through the official `openai` client: real server processes on 127.0.0.1,
a tiny random Llama, no mocks of either side.

References: a ChatSession in this process on the same weights (greedy answers must match),
and the same conversation with the prefix cache bypassed (a fresh `cache_salt` per request):
the answers must match while the prefilled token counts show the cache hit.
"""

from __future__ import annotations

import gc
import itertools
import json
import signal
import threading
import time
import uuid
import weakref

import httpx
import openai
import pytest
import torch
from helpers import assert_ids_match_text, needs_kernels
from serve_helpers import PROCS, health, running_server, save_tiny_model

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    # --opt off: transformers' forward pass, so that answers match the in-process reference.
    with running_server(
        "--model", str(model_dir), "--opt", "off", "--served-model-name", "tiny", log=log
    ) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=60)


def stream_answer(client, messages, **kw):
    """(text, usage, finish_reason, number of content chunks) of one streamed answer."""
    stream = client.chat.completions.create(
        model="tiny", messages=messages, stream=True, stream_options={"include_usage": True}, **kw
    )
    text, usage, finish, n = "", None, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                n += 1
            finish = choice.finish_reason or finish
    return text, usage, finish, n


def reference_answer(model_dir, messages, max_new_tokens):
    """The same greedy answer from a ChatSession in this process."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.generate import Engine

    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=max_new_tokens)
    session = ChatSession(Engine(model, tok), ChatConfig(system=system, sampling=sampling))
    rest = messages[1:] if system else messages
    session.restore(
        {
            "system": system,
            "turns": [
                {"user": u["content"], "answer": a["content"]} for u, a in zip(rest[:-1:2], rest[1::2])
            ],
        }
    )
    return "".join(c.text for c in session.send(rest[-1]["content"]))


def test_models_and_health(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny"]
    h = health(server)
    assert h["status"] == "ok" and h["concurrency"] == 1 and "one generation at a time" in h["note"]
    assert h["context"] == 4096 and h["prefix_cache"]["enabled"]


def test_streamed_and_not_streamed_match_a_local_session(client, model_dir):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, **GREEDY, extra_body={"cache_salt": uuid.uuid4().hex}
    )
    text, usage, finish, n = stream_answer(
        client, messages, max_tokens=12, **GREEDY, extra_body={"cache_salt": uuid.uuid4().hex}
    )
    expected = reference_answer(model_dir, messages, 12)
    assert whole.choices[0].message.content == text == expected
    assert whole.choices[0].finish_reason == finish == "length"
    assert whole.usage.completion_tokens == usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == usage.prompt_tokens > 5
    assert usage.prompt_tokens_details.cached_tokens == 0  # a fresh salt: nothing to reuse
    assert 1 <= n <= 12


def test_multi_turn_prefix_cache_hit(client, server):
    """Each turn prefills only what the conversation gained; the answers equal those of the
    same conversation with the cache bypassed."""
    salt = uuid.uuid4().hex
    messages = [{"role": "system", "content": "Answer briefly."}]
    cached_run = []
    for i, user in enumerate(
        ["Hello there!", "How are you today?", "Tell me about the quick brown fox.", "And the lazy dog?"]
    ):
        messages.append({"role": "user", "content": user})
        text, usage, _, _ = stream_answer(
            client, messages, max_tokens=10, **GREEDY, extra_body={"cache_salt": salt}
        )
        cached = usage.prompt_tokens_details.cached_tokens
        if i == 0:
            assert cached == 0
        else:
            prev = cached_run[-1][1]
            # Everything the previous turn left in the cache: its prompt and answer, less the
            # answer's last token (never fed).
            assert cached == prev.prompt_tokens + prev.completion_tokens - 1
            assert usage.prompt_tokens - cached <= len(user) + 20  # the new message and template text
        cached_run.append((text, usage))
        messages.append({"role": "assistant", "content": text})
    before = health(server)["prefix_cache"]
    # The same conversation, the cache bypassed at every turn (a fresh salt).
    replay = [messages[0]]
    for (text, usage), user in zip(cached_run, messages[1::2]):
        replay.append(user)
        again, usage2, _, _ = stream_answer(
            client, replay, max_tokens=10, **GREEDY, extra_body={"cache_salt": uuid.uuid4().hex}
        )
        assert again == text
        assert usage2.prompt_tokens == usage.prompt_tokens and usage2.prompt_tokens_details.cached_tokens == 0
        replay.append({"role": "assistant", "content": again})
    assert health(server)["prefix_cache"]["misses"] == before["misses"] + len(cached_run)


def test_a_retry_takes_the_conversation_over(client):
    """A request that drops the last answer (a retry) reuses the cache up to that turn."""
    salt = uuid.uuid4().hex
    messages = [{"role": "user", "content": "Hello there!"}]
    first, u1, _, _ = stream_answer(client, messages, max_tokens=8, **GREEDY, extra_body={"cache_salt": salt})
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "How are you?"}]
    _, u2, _, _ = stream_answer(client, messages, max_tokens=8, **GREEDY, extra_body={"cache_salt": salt})
    _, u3, _, _ = stream_answer(
        client, messages, max_tokens=8, temperature=1.0, seed=3, extra_body={"cache_salt": salt}
    )
    assert u3.prompt_tokens == u2.prompt_tokens
    # cut back to the end of turn 1 (its closing tokens included), not re-encoded
    cached = u3.prompt_tokens_details.cached_tokens
    assert u2.prompt_tokens_details.cached_tokens == u1.prompt_tokens + u1.completion_tokens - 1
    assert u2.prompt_tokens_details.cached_tokens <= cached < u2.prompt_tokens
    assert u3.prompt_tokens - cached <= len("How are you?") + 20


def test_continue_final_message(client):
    """An answer cut at 6 tokens and continued for 6 more equals a 12-token answer."""
    messages = [{"role": "user", "content": "Tell me about the quick brown fox."}]
    whole, _, _, _ = stream_answer(client, messages, max_tokens=12, **GREEDY, extra_body={"cache_salt": "a"})
    part, _, finish, _ = stream_answer(
        client, messages, max_tokens=6, **GREEDY, extra_body={"cache_salt": "b"}
    )
    assert finish == "length"
    more, usage, _, _ = stream_answer(
        client,
        [*messages, {"role": "assistant", "content": part}],
        max_tokens=6,
        **GREEDY,
        extra_body={"cache_salt": "b", "continue_final_message": True, "add_generation_prompt": False},
    )
    assert part + more == whole
    assert usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    "body, status, match",
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, "unknown role 'robot'"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "   "}]}, 400, "empty"),
        ({"model": "tiny", "messages": "hello"}, 400, "messages"),
        ({"model": "tiny", "messages": [{"role": "user", "content": 42}]}, 400, "content"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            400,
            "temperature",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12},
            400,
            "max_tokens",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
            400,
            "less than the context",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 2}, 400, "top_p"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 17},
            400,
            "n must be between 1",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            },
            400,
            "alternate",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            },
            400,
            "continue_final_message",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 4},
            400,
            "context",
        ),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, match):
    r = httpx.post(f"{server}/chat/completions", json=body, timeout=120)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert match in error["message"], error
    assert error["type"] in ("invalid_request_error", "not_found_error")
    # ... and the server goes on serving
    ok = httpx.post(
        f"{server}/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert ok.status_code == 200


def test_malformed_json_and_unknown_paths(server, client):
    r = httpx.post(
        f"{server}/chat/completions",
        content=b'{"model": "tiny", messages',
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/nothing-here", timeout=30).status_code == 404
    with pytest.raises(openai.BadRequestError, match="unknown role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])


def test_disconnect_stops_generation_and_health_stays_free(server, client):
    """A long stream: /health answers while it runs; closing it stops the generation (the
    conversation kept holds a partial answer, not thousands of tokens)."""
    before = health(server)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Write a very long story."}],
        stream=True,
        max_tokens=3500,
        temperature=1.0,
        seed=1,
        extra_body={"cache_salt": uuid.uuid4().hex},
    )
    n = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            n += 1
        if n == 3:
            break
    t0 = time.perf_counter()
    during = health(server)
    assert time.perf_counter() - t0 < 5 and during["generating"]
    stream.close()
    deadline = time.monotonic() + 30
    while health(server)["generating"] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = health(server)
    assert not after["generating"] and after["served"] == before["served"] + 1
    grown = after["prefix_cache"]["kept_tokens"] - before["prefix_cache"]["kept_tokens"]
    assert grown < 2000, grown  # stopped well before 3,500 tokens


def test_concurrent_clients_queue_and_all_complete(server):
    """8 streaming clients at once: one generation at a time, every answer whole."""
    results: list[tuple[str, int] | Exception] = []

    def one(i: int) -> None:
        c = openai.OpenAI(base_url=server, api_key="x", max_retries=0, timeout=120)
        try:
            _, usage, finish, _ = stream_answer(
                c, [{"role": "user", "content": f"Hello number {i}"}], max_tokens=16, **GREEDY
            )
            results.append((finish, usage.completion_tokens))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(results) == 8 and all(r == ("length", 16) for r in results), results


@pytest.fixture(scope="module")
def keyed_streaming_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running_server(
        "--model",
        str(model_dir),
        "--api-key-env",
        "TEST_CHATBOT_KEY",
        "--enable-streaming",
        "--recent-size",
        "64",
        "--start-size",
        "4",
        "--served-model-name",
        "tiny",
        env={"TEST_CHATBOT_KEY": "s3cret"},
        log=log,
    ) as url:
        yield url


def test_bearer_key(keyed_streaming_server):
    url = keyed_streaming_server
    messages = [{"role": "user", "content": "hi"}]
    wrong = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    bare = httpx.post(f"{url}/chat/completions", json={"model": "tiny", "messages": messages}, timeout=10)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/models", timeout=10).status_code == 401
    assert health(url)["status"] == "ok"  # /health needs no key
    ok = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
    assert (
        ok.chat.completions.create(model="tiny", messages=messages, max_tokens=2).usage.completion_tokens == 2
    )


def test_streaming_cache_never_runs_out(keyed_streaming_server):
    """With --enable-streaming a conversation outgrows the 68-token window and goes on,
    still continuing its (sink) cache."""
    c = openai.OpenAI(base_url=keyed_streaming_server, api_key="s3cret", max_retries=0, timeout=120)
    messages: list[dict] = []
    usages = []
    for i in range(6):
        messages.append(
            {"role": "user", "content": f"Message {i}: the quick brown fox jumps over the lazy dog."}
        )
        text, usage, _, _ = stream_answer(c, messages, max_tokens=16, **GREEDY)
        messages.append({"role": "assistant", "content": text})
        usages.append(usage)
    assert usages[-1].prompt_tokens > 150  # well past the window
    assert all(u.prompt_tokens_details.cached_tokens > 0 for u in usages[1:])
    prefilled = [u.prompt_tokens - u.prompt_tokens_details.cached_tokens for u in usages[1:]]
    assert all(n <= len(messages[2]["content"]) + 20 for n in prefilled), prefilled
    assert health(keyed_streaming_server)["context"] is None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_streams_under_way_and_the_server_quietly(model_dir, tmp_path, sig):
    """Ctrl-C (SIGINT) shuts down as SIGTERM does: each stream under way ends with an error
    event, and no traceback is printed. (Before, under SIGINT, uvicorn cancelled the streams
    after its grace period and logged "Exception in ASGI application" for each.)"""
    log = tmp_path / "serve.log"
    # a sink cache: the answers never run out of context, so they are all under way at the signal
    args = ["--model", str(model_dir), "--enable-streaming", "--recent-size", "64", "--start-size", "4"]
    with running_server(*args, "--served-model-name", "tiny", log=log) as url:
        proc = PROCS[url]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        clients = 4
        streaming = threading.Barrier(clients + 1, timeout=120)
        errors: list[BaseException | None] = [None] * clients

        def ask(i: int) -> None:
            stream = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=200_000, stream=True
            )
            try:
                for n, _ in enumerate(stream):
                    if n == 2:
                        streaming.wait()
            except BaseException as exc:  # noqa: BLE001 - what the client met is checked below
                errors[i] = exc

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        streaming.wait()
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
        for thread in threads:
            thread.join(timeout=120)
    out = log.read_text()
    assert code == (130 if sig == signal.SIGINT else -signal.SIGTERM), out
    assert "Traceback" not in out and "Exception in ASGI" not in out, out
    for error in errors:
        assert isinstance(error, openai.APIError) and "shutting down" in error.message, errors


def test_serve_bad_flags(capsys, tmp_path, monkeypatch):
    from helpers import assert_one_line_error

    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    assert_one_line_error(capsys, "serve", "--api-key-env", "NO_SUCH_KEY_VAR", match="NO_SUCH_KEY_VAR")
    assert_one_line_error(capsys, "serve", "--cache-memory", "lots", match="cannot read the size")
    assert_one_line_error(capsys, "serve", "--model", str(tmp_path / "none"), match="no such file")


def test_json_usage_shape(server):
    """The non-streamed answer's JSON has the fields OpenAI clients read."""
    r = httpx.post(
        f"{server}/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    data = r.json()
    assert data["object"] == "chat.completion" and data["choices"][0]["message"]["role"] == "assistant"
    assert set(data["usage"]) >= {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    assert json.loads(r.text) == data


# -- the benches through HTTP ------------------------------------------------------------------


def test_bench_turns_through_http(server, capsys, tmp_path):
    """`chatbot bench turns --server`: with the prefix cache every later turn reuses the
    conversation; with it bypassed nothing is reused; the answers are the same."""
    from helpers import cli

    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps({"turns": ["Hello there!", "How are you today?", "And the lazy dog?"]}))
    out_json = tmp_path / "turns.json"
    code, out, err = cli(
        capsys,
        "bench",
        "turns",
        "--server",
        server,
        "--model",
        "tiny",
        "--conversation",
        str(conv),
        "--max-new-tokens",
        "6",
        "--json",
        str(out_json),
    )
    assert code == 0, err
    assert "faster with the prefix cache" in out and "3/3 answers" in out
    data = json.loads(out_json.read_text())
    rows = data["turns"]
    assert rows[0]["prefix_cache"]["cached_tokens"] == 0
    for prev, row in itertools.pairwise(rows):
        c, u = row["prefix_cache"], row["no_cache"]
        assert c["cached_tokens"] == prev["prefix_cache"]["prompt_tokens"] + 6 - 1
        assert u["cached_tokens"] == 0 and u["prompt_tokens"] == c["prompt_tokens"]
    assert data["same_answers"] == 3 and data["ratio_last_turn"] > 0


def _load(server, capsys, tmp_path, duration):
    from helpers import cli

    out_json = tmp_path / "load.json"
    code, out, err = cli(
        capsys,
        "bench",
        "load",
        "--server",
        server,
        "--clients",
        "8",
        "--duration",
        str(duration),
        "--max-new-tokens",
        "8",
        "--json",
        str(out_json),
    )
    assert code == 0, out + err
    data = json.loads(out_json.read_text())
    assert data["errors"] == 0 and data["incomplete"] == 0 and data["complete"] >= 8
    assert data["tokens"] == 8 * data["complete"]
    assert data["ttft_p50_s"] <= data["ttft_p99_s"]
    assert "time to first token p50 / p99" in out
    return data


def test_bench_load_short(server, capsys, tmp_path):
    """8 concurrent streaming clients for a few seconds: every answer complete, no errors."""
    data = _load(server, capsys, tmp_path, 4)
    assert data["rss_start_bytes"] and data["rss_end_bytes"]


def test_bench_load_compares_client_counts_on_a_running_server(server, capsys, tmp_path, monkeypatch):
    """`--clients 1,2 --rounds 2` against a running server: a row per count, the runs of each
    count pooled over the rounds, the tok/s ratio to 1 client computed from them."""
    from helpers import cli

    monkeypatch.setenv("COLUMNS", "120")
    out_json = tmp_path / "load.json"
    code, out, err = cli(capsys, "bench", "load", "--server", server, "--clients", "1,2", "--rounds", "2",
                         "--duration", "2", "--max-new-tokens", "4", "--json", str(out_json))  # fmt: skip
    assert code == 0, out + err
    data = json.loads(out_json.read_text())
    one, two = data["runs"]
    assert [one["clients"], two["clients"]] == [1, 2] and {one["setup"], two["setup"]} == {"server"}
    assert one["rounds"] == two["rounds"] == 2 and data["skipped"] == []
    assert one["errors"] == two["errors"] == 0 and two["complete"] >= 2
    assert one["vs_one_client"] is None
    assert two["vs_one_client"] == pytest.approx(two["tokens_per_s"] / one["tokens_per_s"])
    assert f"server: 2 clients {two['vs_one_client']:.2f}x the tok/s of 1 client (by round: " in out
    assert f"server: {server}" in " ".join(out.split())


@pytest.mark.slow
def test_bench_load_60_s_rss_flat(server, capsys, tmp_path):
    """The issue's load test: 8 clients for 60 s; the server's memory stays flat once the
    prefix cache is full (bounded conversations)."""
    data = _load(server, capsys, tmp_path, 60)
    assert data["rss_end_bytes"] <= data["rss_quarter_bytes"] * 1.10, data


# -- the pool, in this process -------------------------------------------------------------------


def _pool(tiny_model, tiny_tokenizer, **kw):
    from chatbot.config import EngineConfig, SamplingConfig
    from chatbot.engine.generate import Engine
    from chatbot.server.pool import PrefixCachePool

    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=4)
    return PrefixCachePool(Engine(tiny_model, tiny_tokenizer), EngineConfig(), sampling, **kw)


def _ask(pool, conv):
    entry = pool.checkout(conv)
    answer = "".join(c.text for c in entry.session.send(conv.user))
    pool.checkin(entry)
    return answer, entry


def test_pool_keeps_the_most_recent_conversations(tiny_model, tiny_tokenizer):
    from chatbot.server.pool import Conversation

    pool = _pool(tiny_model, tiny_tokenizer, max_entries=2)
    answers = {}
    for name in ("a", "b", "c"):
        answers[name], _ = _ask(pool, Conversation(None, [], f"Hello {name}"))
    assert pool.stats.evictions == 1 and len(pool.entries) == 2
    # "b" is still kept: its next turn is a hit that prefills only the new message
    _, hit = _ask(pool, Conversation(None, [("Hello b", answers["b"])], "more"))
    assert pool.stats.hits == 1
    # "a" was evicted: a miss, the whole history prefilled but for the start it shares with a
    # kept conversation (the template's opening and "Hello ")
    shared = pool.stats.shared_tokens
    _, miss = _ask(pool, Conversation(None, [("Hello a", answers["a"])], "more"))
    assert pool.stats.misses == 4
    kept = len(hit.session.cache_ids) - hit.session.turns[-1].stats.context_tokens - 3  # less the new answer
    took = pool.stats.shared_tokens - shared
    assert took > 0
    assert (
        miss.session.turns[-1].stats.context_tokens + took
        == hit.session.turns[-1].stats.context_tokens + kept
    )


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)])
def test_a_new_conversation_takes_the_start_it_shares_with_a_kept_one(tiny_model, tiny_tokenizer, fast):
    """A new conversation with a kept one's system prompt copies the keys and values of
    their common start and prefills only the rest: the same answer as without the pool, the
    same cache (within float rounding) as a prefill of its own; never across salts."""
    from chatbot.config import EngineConfig, SamplingConfig
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.generate import Engine
    from chatbot.server.pool import Conversation, PrefixCachePool

    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=6)

    def pool_of(entries):
        decoder = FastDecoder(tiny_model, "f32", threads=1) if fast else None
        engine = Engine(tiny_model, tiny_tokenizer, decoder=decoder)
        return PrefixCachePool(engine, EngineConfig(), sampling, max_entries=entries)

    system = "You answer every question briefly and kindly."
    pool, alone = pool_of(8), pool_of(0)
    _ask(pool, Conversation(system, [], "Hello there!"))
    answer, entry = _ask(pool, Conversation(system, [], "What is up?"))
    reference, ref_entry = _ask(alone, Conversation(system, [], "What is up?"))
    assert answer == reference
    took = pool.stats.shared_tokens
    assert pool.stats.shared == 1 and took >= 20  # the template's opening and the system prompt
    stats, ref_stats = entry.session.turns[-1].stats, ref_entry.session.turns[-1].stats
    assert stats.context_tokens == ref_stats.context_tokens - took
    assert entry.session.cache_ids == ref_entry.session.cache_ids
    for mine, theirs in zip(entry.session.cache.layers, ref_entry.session.cache.layers):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5) and torch.allclose(
            mine.values, theirs.values, atol=1e-5
        )
    assert_ids_match_text(entry.session)
    # another salt keeps to itself
    _ask(pool, Conversation(system, [], "Who are you?", salt="other"))
    assert pool.stats.shared == 1


def test_pool_memory_cap_and_off(tiny_model, tiny_tokenizer):
    from chatbot.server.pool import Conversation

    pool = _pool(tiny_model, tiny_tokenizer, max_entries=8)
    _ask(pool, Conversation(None, [], "Hello a"))
    one = pool.kept_bytes
    assert one == len(next(iter(pool.entries.values())).session.cache_ids) * pool.bytes_per_token > 0
    pool.max_bytes = int(one * 1.5)
    _ask(pool, Conversation(None, [], "Hello b"))
    assert len(pool.entries) == 1 and pool.kept_bytes <= pool.max_bytes
    off = _pool(tiny_model, tiny_tokenizer, max_entries=0)
    _ask(off, Conversation(None, [], "Hello"))
    assert not off.entries


@needs_kernels
def test_pool_counts_the_fast_paths_buffers_against_its_memory_cap(tiny_model, tiny_tokenizer):
    """On the fast path a conversation's buffers are sized ahead of its tokens (room for the
    answer): the pool counts what they hold, so `--cache-memory` caps real memory."""
    from chatbot.config import EngineConfig, SamplingConfig
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.generate import Engine
    from chatbot.server.pool import Conversation, PrefixCachePool

    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=200)
    engine = Engine(tiny_model, tiny_tokenizer, decoder=FastDecoder(tiny_model, "f32"))
    pool = PrefixCachePool(engine, EngineConfig(), sampling, max_entries=8)
    _, entry = _ask(pool, Conversation(None, [], "Hello a"))
    held = len(entry.session.cache_ids) * pool.bytes_per_token
    buffers = sum(layer.nbytes for layer in entry.session.kv.cache.layers)
    assert buffers > held  # room for a 200-token answer was made
    assert pool.entry_bytes(entry) == buffers == pool.kept_bytes
    pool.max_bytes = int(buffers * 1.5)  # one conversation's tokens would fit three times
    _ask(pool, Conversation(None, [], "Hello b"))
    assert len(pool.entries) == 1 and pool.kept_bytes <= pool.max_bytes


def test_finished_caches_are_freed_at_once(tiny_model, tiny_tokenizer, monkeypatch):
    """With the garbage collector off, the cache of an evicted conversation and that of a
    finished text completion are freed as soon as nothing holds them (a cache and its record
    refer to each other; left to the collector, each stayed until its next full pass)."""
    from chatbot.server.pool import Conversation
    from chatbot.server.worker import Job, Worker

    pool = _pool(tiny_tokenizer=tiny_tokenizer, tiny_model=tiny_model, max_entries=1)
    made = []
    new_cache = pool.engine.new_cache

    def recording(*args, **kwargs):
        kv = new_cache(*args, **kwargs)
        made.append(weakref.ref(kv.cache))
        return kv

    monkeypatch.setattr(pool.engine, "new_cache", recording)
    gc.collect()
    gc.disable()
    try:
        _ask(pool, Conversation(None, [], "Hello a"))
        _ask(pool, Conversation(None, [], "Hello b"))  # evicts "a"
        assert pool.stats.evictions == 1
        assert made[0]() is None  # "a"'s cache
        worker = Worker(pool)
        events = []
        done = threading.Event()
        job = Job(None, pool.sampling, lambda e: (events.append(e), e[0] in ("done", "error") and done.set()),
                  prompt="Once upon a time")  # fmt: skip
        worker.submit(job)
        assert done.wait(30) and events[-1][0] == "done"
        worker.stop()
        worker.thread.join(10)
        assert made[-1]() is None  # the completion's cache
    finally:
        gc.enable()


def test_text_completions(client, model_dir):
    """/v1/completions: a raw prompt (no template), streamed and not, equal to the engine's
    own greedy continuation in this process."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from chatbot.config import SamplingConfig
    from chatbot.engine.generate import Engine

    prompt = "The quick brown fox"
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
        if c.choices
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(LlamaForCausalLM.from_pretrained(model_dir).eval(), tok)
    ids = tok(prompt)["input_ids"]
    expected = "".join(
        c.text
        for c in engine.generate(
            engine.new_cache(),
            ids,
            SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=10),
        )
    )
    assert whole.choices[0].text == streamed == expected
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError, match="one prompt"):
        client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2)


def test_a_client_leaving_a_non_streamed_request_stops_it(server):
    """Not streamed: the server notices the closed connection while it generates."""
    before = health(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server}/chat/completions",
            timeout=httpx.Timeout(0.3, connect=5.0),
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "A long story, please."}],
                "max_tokens": 3500,
                "temperature": 1.0,
                "seed": 2,
                "cache_salt": uuid.uuid4().hex,
            },
        )
    deadline = time.monotonic() + 30
    while health(server)["generating"] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = health(server)
    assert not after["generating"] and after["served"] == before["served"] + 1
    grown = after["prefix_cache"]["kept_tokens"] - before["prefix_cache"]["kept_tokens"]
    assert grown < 3000, grown  # 3,500 new tokens, had it run on


def test_a_shared_start_is_given_back_when_the_message_does_not_fit(tiny_model, tiny_tokenizer):
    """A new conversation took a kept one's start, then its message did not fit the context:
    the turn never happened, and the cache holds no ids the conversation does not have."""
    from chatbot.errors import ContextFullError
    from chatbot.server.pool import Conversation

    pool = _pool(tiny_model, tiny_tokenizer, max_entries=4)
    system = "You answer every question briefly and kindly."
    _ask(pool, Conversation(system, [], "Hello there!"))
    entry = pool.checkout(Conversation(system, [], "word " * 600))
    with pytest.raises(ContextFullError):
        list(entry.session.send("word " * 600))
    assert pool.stats.shared == 1
    s = entry.session
    assert not s.turns and s.n_fed == len(s.cache_ids) <= len(s.all_ids)
    assert s.cache_ids == s.all_ids[: s.n_fed]
    # and it chats on
    assert "".join(c.text for c in s.send("Hello there!"))
    assert_ids_match_text(s)
