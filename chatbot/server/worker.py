"""The engine's worker threads: `Job` (one generation and where its events go) and `Worker`,
which runs jobs on the prefix-cache pool, several at once in batched decode steps where the
native kernels run, and sends their events back.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from chatbot.config import SamplingConfig
from chatbot.conversation.cache import conversation_cache
from chatbot.conversation.harmony import OPENED, HarmonySplitter
from chatbot.conversation.thinking import ThinkingSplitter, opens_thinking, splitter_for
from chatbot.engine.backends.base import BatchedBackend
from chatbot.engine.backends.choose import serving_backend
from chatbot.engine.backends.native.kernels import KernelsUnavailable
from chatbot.engine.grammar import GrammarError
from chatbot.engine.sampling import seeded_generator
from chatbot.engine.stop_criteria import stop_checks
from chatbot.engine.stops import StopStrings
from chatbot.errors import ChatbotError, ContextFullError
from chatbot.gguf.table import ModelFileChanged
from chatbot.models.templates import answer_stops
from chatbot.server.logprobs import LogprobTracker, TokenLogprob, TokenTexts
from chatbot.server.pool import Conversation, PrefixCachePool
from chatbot.server.protocol import APIError
from chatbot.server.tools import ToolCall, harmony_calls

DEFAULT_SLOTS = 8
"""Requests that generate at once (continuous batching), where the native kernels run."""
SETTLE_S = 5.0
"""The longest a request waits for generations whose clients have gone to give their
conversations back to the pool (`Worker._settle`)."""

if TYPE_CHECKING:
    from chatbot.engine.chunk import GenerationChunk


def _error(exc: ChatbotError, job: Job) -> APIError:
    """The answer to a request the engine refused: the server's fault (500) where its native
    kernels do not load, which no request could change; else the request's (400). A schema
    the grammar engine gave up on while decoding names the field it came from."""
    if isinstance(exc, (KernelsUnavailable, ModelFileChanged)):
        return APIError(500, str(exc), "server_error")
    if isinstance(exc, GrammarError):
        param = "tools" if job.tools is not None and job.tools.forced else "response_format"
        return APIError(400, f"{param}: {exc}", param=param)
    return APIError(400, str(exc))


@dataclass
class Job:
    """One generation: what to answer, and where its events go."""

    conversation: Conversation | None  # None: a raw text completion of `prompt`
    sampling: SamplingConfig
    emit: Callable[[tuple[str, Any]], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    prompt: str = ""
    stops: tuple[str, ...] = ()  # the request's stop strings (the template's apply as well)
    logprobs: int | None = None  # report logprobs with this many top tokens; None: none
    n: int = 1  # answers (choices) to the one prompt, one after another from its cache
    templated: bool = False  # `prompt` is a rendered chat: no special tokens added, the template's stops
    tools: Any = None  # the request's `tools.Tools` (its answers are read for calls)
    calls: dict[int, list[ToolCall]] = field(default_factory=dict)  # harmony's, by choice


class Worker:
    """The threads that run the engine, and send events back to the event loop.

    With the native kernels, up to `slots` requests generate at once (continuous batching):
    each in its own thread, their decode steps run together (`chatbot.engine.batch`), a new
    request's prefill between two steps; the threads take turns on one lock, so the engine,
    the pool and the tokenizer are only ever used by one at a time. Without them, jobs run one
    after the other.

    Events: ("text", (str, [TokenLogprob], choice, thinking)) for each piece of an answer (the
    logprobs of the tokens it completes when the job asks for them), ("finish", (choice,
    finish reason)) as each of the job's `n` answers ends, then ("done", usage dict with the
    first answer's finish reason), or ("error", APIError) when nothing could be generated.

    A job's `n` answers come one after another from the one prompt: the first is generated
    after the prompt's prefill, each next one from the same cache cut back to the end of the
    prompt (its last token fed again for the logits), so the prompt is prefilled once.
    """

    def __init__(self, pool: PrefixCachePool, slots: int = DEFAULT_SLOTS) -> None:
        self.pool = pool
        self.token_texts = TokenTexts(pool.engine.tokenizer)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        # Batching wraps the engine's backend; the pool's sessions (none yet) get the wrapped one.
        backend = serving_backend(pool.engine.backend, slots)
        if backend is not pool.engine.backend:
            pool.engine = pool.engine.with_backend(backend)
        self.batched = backend if isinstance(backend, BatchedBackend) else None
        self.lock: threading.Lock | threading.Condition = threading.Lock()
        if self.batched is not None:
            self.lock = self.batched.cond
            slots = min(slots, self.batched.max_batch)
        else:
            slots = 1
        self.slots = slots
        self.active = 0
        self.served = 0
        self.running: list[Job] = []  # the jobs in the engine now (changed with `lock` held)
        self.threads = [
            threading.Thread(target=self._loop, name=f"chatbot-engine-{i}", daemon=True) for i in range(slots)
        ]
        self.thread = self.threads[0]
        for thread in self.threads:
            thread.start()

    def describe(self) -> str:
        """How requests are run, for the banner of `chatbot serve` and /health's note."""
        if self.slots == 1:
            return "one generation at a time; other requests queue"
        return (
            f"up to {self.slots} generations at once (decode steps batched, a new request's "
            "prefill beside them); more queue"
        )

    @property
    def busy(self) -> bool:
        return self.active > 0

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self, wait_s: float = 0.0) -> None:
        """End the threads once the jobs before this are done; wait up to `wait_s` for them
        (a thread still inside the engine when the interpreter exits can abort it)."""
        for _ in self.threads:
            self.jobs.put(None)
        deadline = time.monotonic() + wait_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            batcher = self.batched.batcher if self.batched is not None else None
            if batcher is not None:
                batcher.arriving()
            with self.lock:
                if batcher is not None:
                    batcher.arrived()
                if job.cancel.is_set():  # the client left while it waited
                    continue
                self.active += 1
                self.running.append(job)
                try:
                    self._run(job)
                except Exception as exc:  # noqa: BLE001 - one request must not take the worker down
                    job.emit(
                        (
                            "error",
                            APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                        )
                    )
                finally:
                    self.active -= 1
                    self.served += 1
                    self.running.remove(job)
                    if isinstance(self.lock, threading.Condition):
                        self.lock.notify_all()  # wakes a request waiting in `_settle`

    def _settle(self, job: Job) -> None:
        """Before `job` takes a conversation from the pool: wait (up to SETTLE_S) for the
        generations whose clients have gone to end. Their conversations then go back to the
        pool, so a request that carries one on (a client's /continue or /retry right after it
        stopped reading) takes it over instead of prefilling it again. A batched generation
        sees its cancel at its next step, which runs while this waits (`lock` let go)."""
        if not isinstance(self.lock, threading.Condition):
            return  # one job at a time: none other is running
        deadline = time.monotonic() + SETTLE_S
        while any(j is not job and j.cancel.is_set() for j in self.running):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.lock.wait(min(left, 0.05))

    def _tracker(self, job: Job) -> LogprobTracker | None:
        """A fresh logprob tracker for one answer of the job (None: it asks for none)."""
        return None if job.logprobs is None else LogprobTracker(self.token_texts, job.logprobs)

    def _complete(self, job: Job) -> None:
        """A raw prompt on a fresh cache (no template, no prefix cache); each answer after
        the first from the cache cut back to the prompt."""
        engine = self.pool.engine
        stamp = getattr(engine.model, "chatbot_file_stamp", None)
        if stamp is not None:  # a file changed under the mapping would kill the server (SIGBUS)
            stamp.check()
        ids = list(engine.tokenizer(job.prompt, add_special_tokens=not job.templated)["input_ids"])
        if not ids:
            job.emit(("error", APIError(400, "the prompt is empty", param="prompt")))
            return
        cache = conversation_cache(engine, self.pool.engine_config, engine.max_context)
        eos = engine.tokenizer.eos_token_id
        stop_ids = [] if eos is None else [int(eos)]
        stops = StopStrings(job.stops)
        if job.templated:  # the end of a turn, as a chat's
            stop_ids, template_stops = answer_stops(engine.tokenizer, engine.model, self.pool.template)
            stops = StopStrings((*template_stops.strings, *job.stops))
        generator = seeded_generator(engine.device, job.sampling.seed)
        # a chat in harmony (gpt-oss) is read by its channels: the analysis as thinking, a call
        # apart; other templates' answers go out as written (their calls are read from the text)
        harmony = opens_thinking(job.prompt) if job.templated else None
        opened = (lambda: harmony) if harmony is not None and harmony.startswith(OPENED) else None
        tokens, finishes = 0, []
        for choice in range(job.n):
            new_ids = ids
            if choice:  # the prompt but its last token stays: that one gives the first logits
                new_ids = ids[-1:] if cache.crop_to(len(ids) - 1) else ids
            tracker = self._tracker(job)
            criterion, view = stop_checks(engine.tokenizer, stops)
            chunks = engine.generate(
                cache,
                new_ids,
                job.sampling,
                history_ids=ids[: len(ids) - len(new_ids)],
                stop_ids=stop_ids,
                prefill_chunk=self.pool.engine_config.prefill_chunk,
                generator=generator,
                stopping_criteria=criterion,
                observer=tracker,
            )
            try:
                stats = _stream(job, chunks, tracker, choice, view, opened=opened)
            except ContextFullError as exc:
                message = f"{exc}".split(":")[0] + ": the prompt does not fit the context"
                job.emit(("error", APIError(400, message, param="prompt", code="context_length_exceeded")))
                return
            except ChatbotError as exc:  # a grammar given up on part way, a changed model file
                job.emit(("error", _error(exc, job)))
                return
            if stats is None:
                return
            tokens += stats.generated_tokens
            finishes.append("stop" if stats.finish_reason == "stop" else "length")
            job.emit(("finish", (choice, finishes[-1])))
        job.emit(
            (
                "done",
                {"finish_reason": finishes[0], "prompt_tokens": len(ids), "completion_tokens": tokens,
                 "cached_tokens": 0},
            )
        )  # fmt: skip

    def _run(self, job: Job) -> None:
        conv = job.conversation
        if conv is None:
            self._complete(job)
            return
        self._settle(job)
        try:
            entry = self.pool.checkout(conv)
        except ChatbotError as exc:
            job.emit(("error", _error(exc, job)))
            return
        session = entry.session
        if session.sampling.think != job.sampling.think:
            # the request's thinking switch (reasoning_effort, chat_template_kwargs) renders
            # the template from this answer on; a kept session re-aligns its cache to it
            session.set_sampling(replace(session.sampling, think=job.sampling.think))
        template_stops = session.stops
        # The request's stop strings join the template's for this answer: the session then
        # ends the answer before one, never shows part of one, and cuts it out of the cache.
        session.stops = StopStrings((*template_stops.strings, *job.stops))
        keep = True
        try:
            keep = self._answers(job, entry)
        except BaseException:
            keep = False
            raise
        finally:
            session.stops = template_stops
            session.token_observer = None
            if keep:
                self.pool.checkin(entry)
            else:
                self.pool.discard(entry)

    def _answers(self, job: Job, entry: Any) -> bool:
        """The job's answers on the checked-out `entry`; whether the pool keeps it."""
        session, conv = entry.session, job.conversation
        assert conv is not None
        prompt_tokens, tokens, finishes, cached, prefill_s = 0, 0, [], 0, 0.0
        try:
            for choice in range(job.n):
                tracker = session.token_observer = self._tracker(job)
                if choice:
                    chunks = session.retry(job.sampling)
                elif conv.partial_answer is not None:
                    session.turns[-1].interrupted = True  # lets continue_answer go on from it
                    chunks = session.continue_answer(job.sampling)
                else:
                    chunks = session.send(conv.user, job.sampling)
                if job.sampling.seed is not None and not choice:  # the next answers draw on
                    session.generator.manual_seed(job.sampling.seed)

                def measure() -> None:
                    nonlocal prompt_tokens  # only the prompt is in the cache yet
                    prompt_tokens = len(session.cache_ids) + session.evicted_total

                stats = _stream(
                    job,
                    chunks,
                    tracker,
                    choice,
                    first=measure if not choice else None,
                    opened=lambda: session.thinking_opened,
                )
                if stats is None:  # the client has gone
                    return True
                if not choice:
                    cached = max(0, prompt_tokens - stats.context_tokens)
                    prefill_s = stats.context_time_s
                tokens += stats.generated_tokens
                finishes.append({"length": "length", "context": "length"}.get(stats.finish_reason, "stop"))
                job.emit(("finish", (choice, finishes[-1])))
        except ContextFullError as exc:
            message = (
                str(exc).split(":")[0] + ": the conversation does not fit the "
                f"model's context ({self.pool.engine.max_context:,} tokens)"
            )
            job.emit(("error", APIError(400, message, param="messages", code="context_length_exceeded")))
            return not entry.fresh  # a refused conversation takes no kept one's place
        except GrammarError as exc:  # part of an answer that breaks the schema: not kept
            job.emit(("error", _error(exc, job)))
            return False
        except ChatbotError as exc:
            job.emit(("error", _error(exc, job)))
            return not entry.fresh
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "cached_tokens": cached}
        job.emit(("done", {"finish_reason": finishes[0], **usage, "prefill_s": prefill_s}))
        return True


def _stream(
    job: Job,
    chunks: Any,
    tracker: LogprobTracker | None,
    choice: int,
    view: Any = None,
    first: Callable[[], None] | None = None,
    opened: Callable[[], str | None] | None = None,
) -> Any:
    """Send one answer's chunks as the job's events (through the stop-string `view` where
    there is one); its stats, or None when the client went away (the answer is cut short).
    `first` is called once the first chunk has come; `opened` says which thinking tag the
    prompt left open (a chat's thinking is sent apart; None: no splitting). A harmony answer
    to a request with tools keeps its calls apart: they go to `job.calls` when it stops."""
    stats = None
    splitter: ThinkingSplitter | HarmonySplitter | None = None
    try:
        for chunk in chunks:
            if first is not None:
                first()
                first = None
            if splitter is None and opened is not None:
                # a chat's thinking goes apart, as reasoning_content (known from the first chunk on)
                splitter = splitter_for(opened(), calls_apart=job.tools is not None)
            _emit_text(job, chunk if view is None else view.chunk(chunk), tracker, choice, splitter)
            stats = chunk.stats or stats
            if job.cancel.is_set():
                return None
    finally:
        chunks.close()  # an answer cut short is kept in the session
    assert stats is not None
    if isinstance(splitter, HarmonySplitter) and splitter.calls and stats.finish_reason == "stop":
        job.calls[choice] = harmony_calls(splitter.calls)  # a call cut short is none
    return stats


def _emit_text(
    job: Job,
    chunk: GenerationChunk,
    tracker: LogprobTracker | None,
    choice: int,
    splitter: ThinkingSplitter | HarmonySplitter | None = None,
) -> None:
    """The chunk's text, with the logprobs of the tokens it completes; the thinking in it
    apart (`splitter`: a chat's)."""
    entries: list[TokenLogprob] = []
    final = chunk.finish_reason is not None
    if tracker is not None:
        entries = tracker.take(chunk.text, final=final)
    text, thought = chunk.text, ""
    if splitter is not None:
        parts = splitter.feed(chunk.text) + (splitter.flush() if final else [])
        text = "".join(p for p, thinking in parts if not thinking)
        thought = "".join(p for p, thinking in parts if thinking)
    if text or entries or thought:
        job.emit(("text", (text, entries, choice, thought)))
