"""`chatbot serve` against what a client can send that it should not: text that does not decode,
bodies far over any context, and refusals that must cost the server nothing (no time taken from
the requests behind, no memory kept, no kept conversation evicted). Real server processes on
127.0.0.1 and the tiny random Llama, as in test_server.py.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
from serve_helpers import PIDS, health, running_server, save_tiny_model

BIG = 20 * 1000 * 1000  # bytes: the 20 MB body of the issue
SMALL = ("--served-model-name", "tiny", "--opt", "off", "--model")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """Default limits; one conversation kept, so that a refused request taking a slot shows."""
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running_server(
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--opt",
        "off",
        "--cache-conversations",
        "1",
        log=log,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def small_body_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running_server(*SMALL, str(model_dir), "--max-body", "64KiB", log=log) as url:
        yield url


def chat(url: str, content: str, timeout: float = 60, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    return httpx.post(f"{url}/chat/completions", json=body, timeout=timeout)


def post_raw(url: str, raw: bytes, path: str = "chat/completions", timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{url}/{path}", content=raw, headers={"content-type": "application/json"}, timeout=timeout
    )


def big_body(size: int) -> bytes:
    """A chat request of `size` bytes: one user message of "word word ..."."""
    head, tail = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "', b'"}]}'
    words = b"word " * ((size - len(head) - len(tail)) // 5 + 1)
    return head + words[: size - len(head) - len(tail)] + tail


def rss_mb(url: str) -> float:
    """The server process's resident set now (VmRSS), in MB."""
    with open(f"/proc/{PIDS[url]}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    """An OpenAI-style error answer with this status whose message has these words."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    for word in words:
        assert word in error["message"], error
    return error


# -- text that does not decode ---------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, path, field",
    [
        (rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi \ud800"}]}', "chat", "content"),
        (
            (
                rb'{"model": "tiny", "messages": [{"role": "user", "content": '
                rb'[{"type": "text", "text": "\udc00!"}]}]}'
            ),
            "chat",
            "messages.0.content.0.text",
        ),
        (
            (
                rb'{"model": "tiny", "messages": [{"role": "system", "content": "\udfff"}, '
                rb'{"role": "user", "content": "hi"}]}'
            ),
            "chat",
            "messages.0.content",
        ),
        (rb'{"model": "tiny", "prompt": "once upon \ud800 a time"}', "completions", "prompt"),
        (rb'{"model": "tiny", "prompt": ["\ud800"]}', "completions", "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(server, raw, path, field):
    """JSON can carry half a surrogate pair; no tokenizer can take it: a 400 that names the
    field, not the 500 of a tokenizer's TypeError."""
    r = post_raw(server, raw, "chat/completions" if path == "chat" else "completions")
    error = assert_error(r, 400, field, "lone surrogate")
    assert error["type"] == "invalid_request_error"
    assert chat(server, "hi").status_code == 200  # and the server goes on


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \xff\xfe there"}]}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \xed\xa0\x80"}]}',  # a surrogate
    ],
)
def test_a_body_that_is_not_utf8_is_a_400_that_says_so(server, raw):
    assert_error(post_raw(server, raw), 400, "not UTF-8", "offset")


def test_other_odd_text_is_answered_or_refused_never_a_500(server):
    """A NUL is text like any other; a part that is not text is the client's fault (4xx).
    (A guard: the old code got these right too.)"""
    assert chat(server, "a \x00 b").status_code == 200
    odd_parts = [[{"type": "text", "text": 5}], [{"type": "image_url", "image_url": {"url": "x"}}], [5]]
    for parts in odd_parts:
        r = httpx.post(
            f"{server}/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": parts}]},
            timeout=60,
        )
        assert_error(r, 400, "messages.0.content")


# -- bodies far over any context ----------------------------------------------------------------


def test_a_20_mb_body_is_refused_within_10_s_and_memory_stays(server):
    """Refused from its Content-Length, and a chunked one (no length) as it arrives: 413 in
    OpenAI's error shape, in well under 10 s, the server's RSS no higher than before + 100 MB."""
    chat(server, "hi")  # warm: the first answer's allocations are not the refusals'
    before = rss_mb(server)
    body = big_body(BIG)
    t0 = time.perf_counter()
    r = post_raw(server, body, timeout=10)
    declared_s = time.perf_counter() - t0
    error = assert_error(r, 413, "over this server's limit", "--max-body")
    assert error["code"] == "request_too_large"

    def pieces():
        for i in range(0, len(body), 1 << 16):
            yield body[i : i + (1 << 16)]

    t0 = time.perf_counter()
    r = httpx.post(
        f"{server}/chat/completions",
        content=pieces(),
        headers={"content-type": "application/json"},
        timeout=10,
    )
    chunked_s = time.perf_counter() - t0
    assert_error(r, 413, "over this server's limit")
    assert declared_s < 10 and chunked_s < 10, (declared_s, chunked_s)
    after = rss_mb(server)
    assert after <= before + 100, (before, after)


def test_a_short_request_right_behind_a_big_refused_one_is_answered_promptly(server):
    result: dict[str, object] = {}

    def send_big() -> None:
        try:
            result["status"] = post_raw(server, big_body(BIG), timeout=120).status_code
        except httpx.HTTPError as exc:
            result["status"] = exc

    big = threading.Thread(target=send_big)
    big.start()
    # Right behind it: once it is refused, or (the old code) once the worker has it.
    deadline = time.monotonic() + 10
    while big.is_alive() and time.monotonic() < deadline:
        h = health(server)
        if h["generating"] or h["queued"]:
            break
        time.sleep(0.05)
    t0 = time.perf_counter()
    r = chat(server, "hi", timeout=15)
    waited = time.perf_counter() - t0
    big.join(timeout=120)
    assert r.status_code == 200 and waited < 5, (r.status_code, waited)
    assert result["status"] == 413, result


def test_a_refused_request_evicts_no_kept_conversation(server):
    """One conversation kept (--cache-conversations 1); requests refused by the body cap, by
    the context bound before tokenizing and by the exact context check after it: the kept
    conversation's next turn still continues its cache."""
    salt = uuid.uuid4().hex
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    first = httpx.post(
        f"{server}/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 4, "cache_salt": salt},
        timeout=60,
    ).json()
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    evictions = health(server)["prefix_cache"]["evictions"]

    refused = [
        post_raw(server, big_body(2_000_000)),  # over the 1 MiB cap
        chat(server, "word " * 150_000),  # 750 kB: over the context by its length
        chat(server, "word " * 5_000),  # 25 kB: over the context once tokenized
        post_raw(server, rb'{"model": "tiny", "messages": [{"role": "user", "content": "hi \ud800"}]}'),
    ]
    assert health(server)["prefix_cache"]["evictions"] == evictions

    second = httpx.post(
        f"{server}/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 4, "cache_salt": salt},
        timeout=60,
    ).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"], second["usage"]
    assert [r.status_code for r in refused] == [413, 400, 400, 400], [r.text[:200] for r in refused]


# -- the flag ---------------------------------------------------------------------------------


def test_max_body_flag(small_body_server, capsys):
    """--max-body 64KiB: a body one byte over is a 413 (by Content-Length and chunked); one
    just under is read, and, 60 kB of text being over the 4,096-token context by its length
    alone, refused without reaching the engine's queue."""
    url = small_body_server
    assert health(url)["max_body_bytes"] == 64 * 1024
    over = big_body(64 * 1024 + 1)
    assert_error(post_raw(url, over), 413, "65,536 bytes")
    r = httpx.post(f"{url}/chat/completions", content=iter([over[:1000], over[1000:]]), timeout=30)  # chunked
    assert_error(r, 413)
    served = health(url)["served"]
    assert_error(post_raw(url, big_body(64 * 1024)), 400, "context", "at least")
    assert health(url)["served"] == served  # never queued for the worker
    assert chat(url, "hi").status_code == 200

    from helpers import assert_one_line_error

    assert_one_line_error(capsys, "serve", "--max-body", "lots", match="cannot read the size")
    assert_one_line_error(capsys, "serve", "--max-body", "10", match="too small")
