"""Benchmarks through the OpenAI-compatible HTTP API (any server: chatbot serve, vLLM, SGLang,
llama-server): the prefix cache across turns, and a bounded load test.

Times are taken here, on the client: time to first token is from sending the request to
the first chunk with text. Token counts are the server's `usage`.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from chatbot.engine.seq import quantile
from chatbot.errors import ChatbotError
from chatbot.measure.report import conditions, loadavg


def make_client(base_url: str, api_key: str | None, timeout: float = 600.0) -> openai.OpenAI:
    """An OpenAI client of the server at `base_url` that never retries (a failure is a figure)."""
    return openai.OpenAI(
        base_url=base_url,
        api_key=api_key or "none",
        max_retries=0,
        timeout=openai.Timeout(timeout, connect=5.0),
    )


def model_of(client: openai.OpenAI, model: str | None) -> str:
    """`model`, checked against the server's list, or the server's first model when None.

    Raises:
        ChatbotError: the server does not list its models, lists none, or lacks `model`.
    """
    try:
        ids = [m.id for m in client.models.list().data]
    except openai.OpenAIError as exc:
        where = str(client.base_url).rstrip("/")
        raise ChatbotError(f"cannot list the models of the server at {where}: {exc}") from None
    if model is None:
        if not ids:
            raise ChatbotError("the server lists no models; name one with --model")
        return ids[0]
    if model not in ids:
        raise ChatbotError(f"the server has no model {model!r}; it has: {', '.join(ids)}")
    return model


def stream_once(
    client: openai.OpenAI,
    model: str,
    messages: list[ChatCompletionMessageParam],
    max_tokens: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One greedy streamed answer: its text, time to first token, usage and finish reason."""
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []  # one piece per chunk with text
    usage = None
    finish = None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body=extra or None,
    )
    try:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(choice.delta.content)
                finish = choice.finish_reason or finish
    finally:
        stream.close()
    prompt = getattr(usage, "prompt_tokens", None)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return {
        "text": "".join(text),
        "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
        "total_s": time.perf_counter() - t0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": getattr(usage, "completion_tokens", None),
        "chunks": len(text),
        "finish_reason": finish,
        "loadavg": loadavg()[0],
    }


def run_http_turns_bench(
    base_url: str,
    turns: list[str],
    max_new_tokens: int = 64,
    model: str | None = None,
    api_key: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Play the user turns through HTTP with the server's prefix cache (one `cache_salt` for
    the conversation), then replay the same messages (the first play's answers) with the
    cache bypassed (a fresh salt per request, which vLLM and chatbot serve honour)."""
    client = make_client(base_url, api_key)
    model = model_of(client, model)
    salt = uuid.uuid4().hex
    messages: list[ChatCompletionMessageParam] = []
    cached_rows = []
    for i, user in enumerate(turns, 1):
        messages.append({"role": "user", "content": user})
        row = stream_once(client, model, messages, max_new_tokens, {"cache_salt": salt})
        messages.append({"role": "assistant", "content": row["text"]})
        cached_rows.append(row)
        if progress:
            progress(f"prefix cache: turn {i}/{len(turns)}: first token {row['ttft_s']:.3f} s")
    uncached_rows = []
    for i in range(len(turns)):
        row = stream_once(
            client, model, messages[: 2 * i + 1], max_new_tokens, {"cache_salt": uuid.uuid4().hex}
        )
        uncached_rows.append(row)
        if progress:
            progress(f"cache bypassed: turn {i + 1}/{len(turns)}: first token {row['ttft_s']:.3f} s")

    def slim(row: dict[str, Any]) -> dict[str, Any]:
        prompt, cached = row["prompt_tokens"], row["cached_tokens"]
        return {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefill_tokens": None if prompt is None else prompt - (cached or 0),
            "ttft_s": row["ttft_s"],
            "completion_tokens": row["completion_tokens"],
            "loadavg": row.get("loadavg"),
        }

    last_c, last_u = cached_rows[-1], uncached_rows[-1]
    return {
        "server": base_url,
        "model": model,
        "max_new_tokens": max_new_tokens,
        "turns": [
            {"turn": i + 1, "prefix_cache": slim(c), "no_cache": slim(u)}
            for i, (c, u) in enumerate(zip(cached_rows, uncached_rows))
        ],
        "ratio_last_turn": last_u["ttft_s"] / last_c["ttft_s"] if last_c["ttft_s"] else None,
        "same_answers": sum(c["text"] == u["text"] for c, u in zip(cached_rows, uncached_rows)),
        "conditions": conditions(),
    }


def _health(base_url: str, api_key: str | None) -> dict[str, Any]:
    """chatbot serve's /health ({} for other servers, or when it does not answer)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        data = httpx.get(f"{root}/health", timeout=5, headers=headers).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _server_rss(base_url: str, api_key: str | None) -> int | None:
    """The server's resident memory from chatbot serve's /health (None for other servers)."""
    rss = _health(base_url, api_key).get("rss_bytes")
    return rss if isinstance(rss, int) else None


def _batched(base_url: str, api_key: str | None) -> tuple[int, int] | None:
    """(decode steps, rows in them) so far, from chatbot serve's /health; None elsewhere."""
    try:
        steps = _health(base_url, api_key)["batched_steps"]
        return int(steps["steps"]), int(steps["rows"])
    except (KeyError, TypeError, ValueError):
        return None


def ttft_figures(ttfts: list[float]) -> dict[str, float]:
    """Time to first token p50, p90 and p99 (NaN when no request finished)."""
    return {f"ttft_p{q}_s": quantile(ttfts, q / 100) if ttfts else float("nan") for q in (50, 90, 99)}


@dataclass
class _LoadRun:
    """One load run's plan (see `run_load_bench`) and what its clients have counted, shared by
    their threads under `lock`."""

    model: str
    turns: list[str]
    clients: int
    stop_at: float  # time.perf_counter() after which no request is sent
    max_new_tokens: int
    single_turn: bool
    # tokens_counted_as_chunks: answers without usage, their tokens counted as chunks
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("complete", "incomplete", "errors", "tokens", "tokens_counted_as_chunks"), 0
        )
    )
    ttfts: list[float] = field(default_factory=list)
    error_lines: list[str] = field(default_factory=list)
    finished_at: list[float] = field(default_factory=list)  # when each client's last request ended
    lock: threading.Lock = field(default_factory=threading.Lock)

    def chat(self, client: openai.OpenAI, index: int) -> None:
        """Client `index`: send turns until `stop_at`, counting each answer or error."""
        turns = self.turns
        salt = f"load-{index}-{uuid.uuid4().hex}"  # each client its own conversations
        messages: list[ChatCompletionMessageParam] = []
        turn = index % len(turns)
        sent = 0
        while time.perf_counter() < self.stop_at:
            if self.single_turn:
                messages = []
                turn = (index + sent * self.clients) % len(turns)
                salt = f"load-{index}-{uuid.uuid4().hex}"
            sent += 1
            messages.append({"role": "user", "content": turns[turn]})
            try:
                row = stream_once(client, self.model, messages, self.max_new_tokens, {"cache_salt": salt})
            except (openai.OpenAIError, OSError, httpx.HTTPError) as exc:
                self._error(exc)
                messages.pop()
                time.sleep(0.2)
                continue
            self._answer(row)
            if self.single_turn:
                continue
            messages.append({"role": "assistant", "content": row["text"]})
            turn += 1
            if turn % len(turns) == 0 or len(messages) > 2 * len(turns):
                messages, turn = [], 0  # start a new conversation
        with self.lock:
            self.finished_at.append(time.perf_counter())

    def _error(self, exc: BaseException) -> None:
        with self.lock:
            self.counts["errors"] += 1
            self.error_lines.append(f"{type(exc).__name__}: {exc}"[:200])

    def _answer(self, row: dict[str, Any]) -> None:
        with self.lock:
            tokens = row["completion_tokens"]
            if tokens is None:  # a server without streamed usage (llama-cpp-python's)
                tokens = row["chunks"]
                self.counts["tokens_counted_as_chunks"] += 1
            done = row["finish_reason"] in ("stop", "length") and tokens
            self.counts["complete" if done else "incomplete"] += 1
            self.counts["tokens"] += tokens
            self.ttfts.append(row["ttft_s"])


def _rss_figures(rss: list[tuple[float, int]], duration_s: float) -> dict[str, int | None]:
    """The RSS samples `(seconds in, bytes)` at the start, after a quarter of `duration_s`,
    at the end, and the highest (None each without samples)."""
    quarter = [v for t, v in rss if t >= 0.25 * duration_s]
    return {
        "rss_start_bytes": rss[0][1] if rss else None,
        "rss_quarter_bytes": quarter[0] if quarter else (rss[-1][1] if rss else None),
        "rss_end_bytes": rss[-1][1] if rss else None,
        "rss_max_bytes": max(v for _, v in rss) if rss else None,
    }


def run_load_bench(
    base_url: str,
    turns: list[str],
    clients: int = 8,
    duration_s: float = 60.0,
    max_new_tokens: int = 32,
    model: str | None = None,
    api_key: str | None = None,
    progress: Callable[[str], None] | None = None,
    single_turn: bool = False,
    rss_of: Callable[[], int | None] | None = None,
) -> dict[str, Any]:
    """`clients` threads, each chatting through the conversation turn by turn (streamed,
    greedy), until `duration_s` has passed; requests already sent are finished. The server's
    RSS is sampled once a second (chatbot serve's /health).

    Args:
        single_turn: each request is one of `turns` alone, a new conversation with a cache
            salt of its own (nothing reused from a kept conversation), the clients taking
            the turns in rotation; else each client chats through them.
        rss_of: reads the server's RSS (e.g. from /proc for a server started here), in
            place of /health.

    Returns figures: answers complete and not, errors, time to first token p50/p90/p99,
    tokens generated (the server's `usage`, else one a streamed chunk with text), RSS at the
    start, after a quarter of the time, and at the end; with chatbot serve, the mean rows of
    its batched decode steps during the run.
    """
    timeout = max(120.0, duration_s * 2)
    model = model_of(make_client(base_url, api_key, timeout=timeout), model)
    read_rss = rss_of or (lambda: _server_rss(base_url, api_key))
    batched_before = _batched(base_url, api_key)
    start = time.perf_counter()
    run = _LoadRun(model, turns, clients, start + duration_s, max_new_tokens, single_turn)
    threads = [
        threading.Thread(
            target=run.chat, args=(make_client(base_url, api_key, timeout=timeout), i), daemon=True
        )
        for i in range(clients)
    ]
    rss: list[tuple[float, int]] = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        now = time.perf_counter()
        sample = read_rss()
        if sample is not None:
            rss.append((now - start, sample))
        if progress and int(now - start) % 10 == 0:
            progress(f"{now - start:.0f} s: {run.counts['complete']} answers, {run.counts['errors']} errors")
        time.sleep(1.0)
    # the clients' last answers, not the poll after them
    elapsed = (max(run.finished_at) if run.finished_at else time.perf_counter()) - start
    batched_after = _batched(base_url, api_key)
    steps = rows = None
    if batched_before is not None and batched_after is not None:
        steps, rows = (after - before for after, before in zip(batched_after, batched_before))
    ttfts = run.ttfts
    return {
        "server": base_url,
        "model": model,
        "clients": clients,
        "duration_s": duration_s,
        "elapsed_s": elapsed,
        "max_new_tokens": max_new_tokens,
        **run.counts,
        **ttft_figures(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
        "tokens_per_s": run.counts["tokens"] / elapsed if elapsed else 0.0,
        **_rss_figures(rss, duration_s),
        "batch_steps": steps,
        "batch_rows": rows,
        "batch_rows_per_step": rows / steps if rows is not None and steps else None,
        "ttfts_s": ttfts,
        "single_turn": single_turn,
        "error_samples": run.error_lines[:5],
        "conditions": conditions(),
    }
