"""A chat conversation on one persistent cache.

The conversation is a list of segments: spans of text with the token ids that stand for
them. Prompt segments (template text, system and user messages) are tokenized by us; answer
segments keep the ids the model generated. Concatenated, the segments' text is the
conversation as the chat template renders it, and their ids are what the cache has seen.
Each turn prefills only the ids the cache has not seen yet.

Invariant, after every method returns (and after an interrupt), once the conversation has
a turn or a system prompt segment (a new or reset session may have no segments yet):

- ``tokenizer.decode(all_ids) == rendered == render(messages(), add_generation_prompt=False)``;
- the first `n_fed` ids of `all_ids` went through the cache; `cache_ids` is what the cache
  holds now (the same ids unless a bounded cache evicted some), and its length is the
  cache's length.

Per turn the segments are: the prompt (template text and the user's message), the answer,
and the template's closing text after it (e.g. ``<|im_end|>\\n``), which stays pending until
the next turn feeds it. That layout is what lets `undo`, `retry` and `continue_answer` cut
the cache back instead of re-encoding.

Segments are encoded and decoded as they read *in* the conversation, not alone: with a
SentencePiece tokenizer (Llama-2, Mistral, Vicuna) an answer "▁Hello" decodes alone as "Hello"
but reads " Hello" after "[/INST]", and "USER:" encodes alone as "▁USER:" but as "USER", ":"
after "</s>". So the answer's segment holds the space the model wrote before it, the message
keeps the answer as shown, and the template (which writes that space) renders the two alike.

A fallback template's stop strings (e.g. Vicuna's "USER:", several tokens) end an answer
too: the answer ends right before the stop string, the stream never shows it, and the cache
is cut back to the answer's tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatbot.config import ChatConfig, SamplingConfig
from chatbot.engine.generate import Engine, GenerationChunk
from chatbot.engine.stats import TurnStats
from chatbot.errors import ChatbotError, ConfigError
from chatbot.limits import MAX_SAVED_BYTES, expand, finite, loads_json, read_text
from chatbot.models.templates import StopOnStrings, find_stop, held_back, stop_strings_of

SAVE_FORMAT = "chatbot-session"
SAVE_VERSION = 1

# Ids of left context for decoding an answer as it reads in the conversation.
_DECODE_CONTEXT = 8

ProgressCallback = Callable[[int, int], None]  # (tokens done, tokens in all)


@dataclass
class Segment:
    """A span of the rendered conversation and its token ids."""

    kind: str  # "prompt" (tokenized by us) or "answer" (generated)
    text: str
    ids: list[int]


@dataclass
class Turn:
    """One exchange: the user's message, the answer, and what it cost."""

    user: str
    answer: str
    stats: TurnStats
    interrupted: bool = False
    first_segment: int = 0  # index of the turn's prompt segment; -1 when unknown
    evicted_before: int = 0  # the cache's evicted_total when the turn started

    def as_dict(self) -> dict[str, Any]:
        return {
            "user": self.user,
            "answer": self.answer,
            "interrupted": self.interrupted,
            "stats": stats_to_dict(self.stats),
        }


@dataclass
class CacheLayout:
    """What `/cache` shows."""

    length: int
    capacity: int
    pinned: int
    recent: int
    evicted_total: int
    oldest_text: str


def stats_to_dict(stats: TurnStats) -> dict[str, Any]:
    """Every field of a TurnStats (unlike `TurnStats.as_dict`), times to the microsecond."""
    data = dataclasses.asdict(stats)
    for key, value in data.items():
        if isinstance(value, float):
            data[key] = round(value, 6)
        elif isinstance(value, list):
            data[key] = [round(v, 6) for v in value]
    return data


def stats_from_dict(data: Any) -> TurnStats:
    """A TurnStats from `stats_to_dict` output; unknown keys and bad values are ignored."""
    stats = TurnStats()
    if not isinstance(data, dict):
        return stats
    for f in dataclasses.fields(TurnStats):
        value = data.get(f.name)
        if value is None:
            continue
        default = getattr(stats, f.name)
        if isinstance(default, list):
            if isinstance(value, list) and len(value) <= 1_000_000 and all(finite(v) for v in value):
                setattr(stats, f.name, [float(v) for v in value])
        elif isinstance(default, str):
            if isinstance(value, str):
                setattr(stats, f.name, value)
        elif finite(value):  # NaN / infinity in a hand-edited file are left out
            setattr(stats, f.name, type(default)(value) if default is not None else value)
    return stats


def merge_stats(first: TurnStats, more: TurnStats) -> TurnStats:
    """The figures of an answer generated in two parts (`continue_answer`)."""
    return TurnStats(
        context_tokens=first.context_tokens + more.context_tokens,
        context_time_s=first.context_time_s + more.context_time_s,
        ttft_s=first.ttft_s,
        generated_tokens=first.generated_tokens + more.generated_tokens,
        decode_time_s=first.decode_time_s + more.decode_time_s,
        token_latencies_s=[*first.token_latencies_s, *more.token_latencies_s],
        cache_tokens=more.cache_tokens,
        cache_capacity=more.cache_capacity,
        sinks=more.sinks,
        evicted_total=more.evicted_total,
        peak_memory_bytes=max(first.peak_memory_bytes, more.peak_memory_bytes),
        finish_reason=more.finish_reason,
    )


class _FeedLog:
    """Keeps `cache_ids` in step with the cache while the engine feeds it, and checks
    afterwards that nothing was torn by an interrupt.

    Each callback changes `cache_ids` in one statement, so a KeyboardInterrupt between two
    of them leaves a state `settle` can recognise; if it cannot vouch for the cache, the
    caller empties it (the conversation is kept, the next turn re-encodes).
    """

    def __init__(self, session: ChatSession) -> None:
        self.session = session
        self.length_before = len(session.cache_ids)
        self.evicted_before = session.evicted_total
        self.fed: list[int] = []
        self.evicted = 0

    def on_fed(self, ids: Sequence[int]) -> None:
        self.session.cache_ids.extend(ids)
        self.fed.extend(ids)

    def on_evict(self, start: int, end: int) -> None:
        del self.session.cache_ids[start:end]
        self.evicted += end - start

    def settle(self) -> bool:
        """Cut the cache back to the ids we know it holds; True when it is sound."""
        s = self.session
        s.engine.crop(s.cache, len(s.cache_ids))
        lengths = {layer.get_seq_length() for layer in s.cache.layers}
        return (
            lengths <= {len(s.cache_ids)}
            and s.cache.get_seq_length() == len(s.cache_ids)
            and s.evicted_total - self.evicted_before == self.evicted
            and len(s.cache_ids) - self.length_before + self.evicted == len(self.fed)
        )


class _StopView:
    """What the caller of a streamed answer may see when stop strings apply: the text up to
    the first stop string, less an end that may still grow into one (shown once it cannot,
    or when the answer ends).

    Args:
        stop_strings: the texts that end the answer.
        shown: the answer's text the caller has already seen (a continued answer's start).
    """

    def __init__(self, stop_strings: tuple[str, ...], shown: str = "") -> None:
        self.stop_strings = stop_strings
        self.text = shown
        self.shown = len(shown)

    def chunk(self, chunk: GenerationChunk) -> GenerationChunk:
        """The chunk with only the text that may be shown now."""
        self.text += chunk.text
        end = find_stop(self.text, self.stop_strings)
        if end < 0:
            end = len(self.text)
            if not chunk.finish_reason:
                end -= held_back(self.text, self.stop_strings)
        text = self.text[self.shown : end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return dataclasses.replace(chunk, text=text)


class _LeadingText:
    """Puts back the text a continued answer's first tokens have only after the part before
    it (the space of a SentencePiece "▁thank" after "Hello"), which the engine, decoding
    the new tokens alone, leaves out.

    Args:
        session: the session (for its tokenizer).
        before: the conversation's ids up to the end of the answer being continued.
    """

    def __init__(self, session: ChatSession, before: list[int]) -> None:
        self.session = session
        self.before = before
        self.ids: list[int] = []
        self.done = False

    def chunk(self, chunk: GenerationChunk) -> GenerationChunk:
        """The chunk, with the leading text in front of the first one that shows text."""
        if self.done:
            return chunk
        self.ids.extend(chunk.token_ids)
        if not chunk.text:
            return chunk
        self.done = True
        alone = self.session.decode(self.ids)
        in_context = self.session._decode_after(self.before, self.ids)
        if in_context == alone or not in_context.endswith(alone):
            return chunk
        return dataclasses.replace(chunk, text=in_context[: len(in_context) - len(alone)] + chunk.text)


class ChatSession:
    """Messages, the token ids in the cache, and `send()` that streams an answer.

    Args:
        engine: the model runner.
        config: system prompt, sampling and engine settings.
    """

    def __init__(self, engine: Engine, config: ChatConfig | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = config or ChatConfig()
        self.sampling: SamplingConfig = self.config.sampling
        self.system: str | None = self.config.system
        self.cache = self.make_cache()
        self.segments: list[Segment] = []
        self.turns: list[Turn] = []
        self.cache_ids: list[int] = []  # mirror of the cache's contents, after evictions
        self.n_fed = 0  # how many ids of the conversation have passed through the cache
        self.generator = torch.Generator(device=engine.device)
        self._seed_generator()
        self.stop_ids = self._stop_ids()
        # The fallback template's stop strings, matched as text (single-token ones are stop
        # ids too; the text match also catches them spelled out in several tokens).
        self.stop_strings = stop_strings_of(self.tokenizer)

    # -- set-up -------------------------------------------------------------------------

    def make_cache(self) -> Any:
        ec = self.config.engine
        if not ec.enable_streaming:
            return self.engine.new_cache()
        from chatbot.engine.sink_cache import SinkCache

        recent = ec.recent_size or default_recent_size(self.engine.max_context)
        ec.check_window(ec.start_size, recent, self.engine.max_context)
        cache = SinkCache.for_model(self.engine.model, ec.start_size, recent)
        keep = ec.keep_system if ec.keep_system is not None else bool(self.system)
        if keep:
            # A system prompt longer than the context allows is pinned only as far as it fits
            # beside the window; the rest is evicted like any old text.
            room = max(ec.start_size, self.engine.max_context - recent)
            cache.pin(min(self.system_prompt_tokens(), room))
        return cache

    def system_prompt_tokens(self) -> int:
        """How many tokens the rendered system prompt takes at the start of the conversation."""
        if not self.system:
            return 0
        msgs = [{"role": "system", "content": self.system}]
        try:
            sys_text = self.render(msgs, False)
            full = self.render([*msgs, {"role": "user", "content": "x"}], False)
        except Exception:  # noqa: BLE001 - a template (user code) that cannot render a lone system message
            return 0
        return len(self.encode(sys_text)) if full.startswith(sys_text) else 0

    def _seed_generator(self) -> None:
        if self.sampling.seed is not None:
            self.generator.manual_seed(self.sampling.seed)
        else:
            self.generator.seed()

    def _stop_ids(self) -> list[int]:
        ids: set[int] = set()
        eos = self.tokenizer.eos_token_id
        if eos is not None:
            ids.add(int(eos))
        gen_eos = getattr(getattr(self.engine.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            ids.update(int(i) for i in gen_eos)
        ids.update(self._end_of_turn_ids())
        return sorted(ids)

    def _end_of_turn_ids(self) -> list[int]:
        """Special tokens the template puts right after an assistant message."""
        marker = "\u2063answer\u2063"
        try:
            text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}], False)
        except Exception:  # noqa: BLE001 - a template (user code) that cannot render this
            return []
        if marker not in text:
            return []
        suffix = text.split(marker, 1)[1]
        special = set(self.tokenizer.all_special_ids)
        added = {i for i, tok in self.tokenizer.added_tokens_decoder.items() if tok.special}
        return [i for i in self.encode(suffix) if i in special or i in added][:1]

    # -- text and ids ---------------------------------------------------------------------

    def _system_messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def messages(self) -> list[dict[str, str]]:
        """The conversation as role/content records, system prompt first when set."""
        msgs = self._system_messages()
        for t in self.turns:
            msgs.append({"role": "user", "content": t.user})
            msgs.append({"role": "assistant", "content": t.answer})
        return msgs

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if not messages and not add_generation_prompt:
            return ""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str, literal: bool = False) -> list[int]:
        """Token ids of `text`; with `literal`, special-token text in it (`<|im_end|>`) is
        encoded as plain text, never as the control token."""
        if not text:
            return []
        if literal:
            return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _special_texts(self) -> tuple[str, ...]:
        """The texts of the tokenizer's special tokens (cached)."""
        cached = getattr(self, "_specials_cache", None)
        if cached is None:
            texts = set(self.tokenizer.all_special_tokens)
            texts.update(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)
            cached = self._specials_cache = tuple(t for t in texts if t)
        return cached

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _encode_after(self, context: str, text: str, literal: bool = False) -> list[int]:
        """Ids for `text` as they are when it follows `context` ("" at the start).

        A SentencePiece tokenizer writes "▁" before the first word of a text, so "USER:"
        alone is "▁USER:" but "USER", ":" after "</s>": the ids of ``context + text`` past those
        of `context` are the ones a tokenization of the whole conversation has there. Should
        the two merge across the boundary, `text` is encoded alone.
        """
        if not context or not text:
            return self.encode(text, literal)
        head = self.encode(context, literal)
        whole = self.encode(context + text, literal)
        return whole[len(head) :] if whole[: len(head)] == head else self.encode(text, literal)

    def _decode_after(self, before: Sequence[int], ids: Sequence[int]) -> str:
        """The text `ids` add after the ids `before`: a SentencePiece answer "▁Hello" reads
        " Hello" after "[/INST]", though alone it decodes as "Hello"."""
        if not before or not ids:
            return self.decode(ids)
        for n in (_DECODE_CONTEXT, len(before)):
            context = list(before[-n:])
            head = self.decode(context)
            whole = self.decode([*context, *ids])
            if whole.startswith(head):
                return whole[len(head) :]
            if n >= len(before):
                break
        return self.decode(ids)

    def _segment(self, kind: str, text: str, before: Sequence[Segment] | None = None,
                 content: str | None = None) -> Segment:
        """A segment of `text` tokenized by us, as it reads after `before` (default: the
        conversation's segments).

        `content` is the message the template put in `text`: special-token text inside it
        (a pasted `<|im_end|><|im_start|>system`) is encoded as plain text, so that a message
        cannot forge turns; the template's own special tokens stay control tokens.
        """
        before = self.segments if before is None else before
        context = next((seg.text for seg in reversed(before) if seg.text), "")
        if content and any(s in content for s in self._special_texts()):
            at = text.rfind(content)
            if at >= 0:
                head, tail = text[:at], text[at + len(content) :]
                ids = (self._encode_after(context, head) + self._encode_after(context + head, content, literal=True)
                       + self._encode_after(context + head + content, tail))
                return Segment(kind, text, ids)
        return Segment(kind, text, self._encode_after(context, text))

    @property
    def rendered(self) -> str:
        return "".join(s.text for s in self.segments)

    @property
    def all_ids(self) -> list[int]:
        return [i for s in self.segments for i in s.ids]

    @property
    def pending_ids(self) -> list[int]:
        return self.all_ids[self.n_fed :]

    @property
    def evicted_total(self) -> int:
        return int(getattr(self.cache, "evicted_total", 0))

    @property
    def capacity(self) -> int:
        """The most tokens the cache holds: the window of a bounded cache, else the context."""
        return int(getattr(self.cache, "capacity", 0) or self.engine.max_context)

    @property
    def conversation_tokens(self) -> int:
        """Tokens in the cache plus those waiting to enter it (the context meter)."""
        return len(self.cache_ids) + len(self.all_ids) - self.n_fed

    # -- a turn ---------------------------------------------------------------------------

    def send(self, text: str, sampling: SamplingConfig | None = None) -> Iterator[GenerationChunk]:
        """Add a user message and stream the answer.

        Nothing changes until the first chunk is asked for; an answer cut short (Ctrl-C,
        `close()`) is kept as far as it got, closed with the template's end-of-turn text.

        Args:
            text: the user's message.
            sampling: settings for this turn only (default: the session's).

        Yields:
            GenerationChunk; the last one has the finish reason and stats.

        Raises:
            ChatbotError: an empty message.
            ContextFullError: the message does not fit; nothing is changed.
            KeyboardInterrupt: re-raised after the partial answer has been kept.
        """
        if not text.strip():
            raise ChatbotError("empty message")
        return self._send(text, sampling or self.sampling)

    def _send(self, text: str, sampling: SamplingConfig) -> Iterator[GenerationChunk]:
        if self.segments or self.turns:
            self._ensure_consistent()
        msgs = [*self.messages(), {"role": "user", "content": text}]
        full = self.render(msgs, add_generation_prompt=True)
        prefix = self.rendered
        if not full.startswith(prefix):
            # The template re-renders the past differently (e.g. it drops old reasoning):
            # start over from a fresh tokenization of the whole conversation.
            self._forget_cache()
            self.segments = []
            for t in self.turns:
                t.first_segment = -1
            prefix = ""
        prompt = self._segment("prompt", full[len(prefix) :], content=text)
        yield from self._answer(text, prompt, sampling)

    def _answer(
        self,
        user: str,
        prompt: Segment | None,
        sampling: SamplingConfig,
        resume: Turn | None = None,
        extend: bool = False,
    ) -> Iterator[GenerationChunk]:
        """Feed what is pending (plus `prompt`) and stream the answer.

        `resume` regenerates (or, with `extend`, lengthens) the answer of an existing turn.
        With stop strings, the chunks' text stops before the first one and holds back an
        end that may be the start of one; their ids are the tokens as generated.
        """
        # A Ctrl-C while the window is refilled ends the turn like one in the prefill: the
        # finally below closes it.
        interrupted = False
        try:
            self._skip_to_window()
        except KeyboardInterrupt:
            interrupted = True
        first_segment = len(self.segments)
        evicted_before = self.evicted_total
        new_ids = self.pending_ids + (prompt.ids if prompt else [])
        if prompt is not None:
            self.segments.append(prompt)
        stop: StopOnStrings | None = None
        view: _StopView | None = None
        last = self.segments[-1] if self.segments else None
        before = last if extend and last is not None and last.kind == "answer" else None
        lead = _LeadingText(self, self.all_ids) if before is not None else None
        if self.stop_strings:
            stop = StopOnStrings(self.tokenizer, self.stop_strings)
            if before is not None:
                stop.answer_tokens = len(before.ids)  # a stop string may begin in the part before
            view = _StopView(self.stop_strings, before.text if before is not None else "")
        log = _FeedLog(self)
        chunks = self.engine.generate(
            self.cache,
            new_ids,
            sampling,
            history_ids=self.cache_ids,
            stop_ids=self.stop_ids,
            prefill_chunk=self.config.engine.prefill_chunk,
            on_evict=log.on_evict,
            on_fed=log.on_fed,
            generator=self.generator,
            stopping_criteria=stop,
        )
        shown: list[int] = []
        stats: TurnStats | None = None
        finished = False
        # Chunk arrival times: the figures of an answer cut short (the engine's own stats
        # come with the last chunk only).
        t0 = time.perf_counter()
        times: list[tuple[float, int]] = []
        try:
            if interrupted:
                raise KeyboardInterrupt
            for chunk in chunks:
                times.append((time.perf_counter(), len(chunk.token_ids)))
                shown.extend(chunk.token_ids)
                if chunk.stats is not None:
                    stats = chunk.stats
                if lead is not None:
                    chunk = lead.chunk(chunk)
                yield chunk if view is None else view.chunk(chunk)
            finished = True
        finally:
            chunks.close()
            sound = log.settle()
            if not (finished or resume is not None or log.fed):
                # Stopped before anything reached the cache: the turn never happened.
                if prompt is not None:
                    self.segments.pop()
                if not sound:
                    self._forget_cache()
            else:
                if sound:
                    self.n_fed += len(log.fed)
                else:
                    self._forget_cache()
                answer_fed = log.fed[len(new_ids) :] if sound else []
                answer_ids = shown if finished or len(shown) >= len(answer_fed) else answer_fed
                if stats is None:
                    stats = self._interrupted_stats(min(len(log.fed), len(new_ids)), len(answer_ids), t0, times)
                self._close_turn(user, answer_ids, stats, finished, first_segment, evicted_before, resume, extend)

    def _interrupted_stats(self, context: int, generated: int, t0: float, times: list[tuple[float, int]]) -> TurnStats:
        """Approximate figures for an answer cut short, from the chunks' arrival times."""
        latencies: list[float] = []
        for (prev, _), (now, n) in itertools.pairwise(times):
            latencies.extend([(now - prev) / n] * n if n else [])
        first = times[0][0] - t0 if times else 0.0
        return TurnStats(
            context_tokens=context,
            context_time_s=first,
            ttft_s=first,
            generated_tokens=generated,
            decode_time_s=sum(latencies),
            token_latencies_s=latencies,
            cache_tokens=len(self.cache_ids),
            cache_capacity=self.capacity,
            evicted_total=self.evicted_total,
            finish_reason="interrupted",
        )

    def _close_turn(
        self,
        user: str,
        answer_ids: list[int],
        stats: TurnStats,
        finished: bool,
        first_segment: int,
        evicted_before: int,
        resume: Turn | None,
        extend: bool,
    ) -> None:
        """Record the exchange and queue the template's end-of-turn text (not fed yet).

        The answer's segment is its text as it reads in the conversation; the turn keeps it
        as decoded alone (what the stream showed), unless only the text in context renders
        back. An answer with a stop string in it ends right before it; the cache is cut back
        to the ids that stay as generated.
        """
        if extend and self.segments and self.segments[-1].kind == "answer":
            old = self.segments.pop()
            answer_ids = [*old.ids, *answer_ids]
        before = self.all_ids
        prompt_text = self.rendered
        answer_text = self._decode_after(before, answer_ids)
        at = find_stop(answer_text, self.stop_strings)
        if at >= 0:
            answer_text = answer_text[:at]
            answer_ids, kept = self._ids_for_cut_answer(before, answer_ids, answer_text)
            self.segments.append(Segment("answer", answer_text, answer_ids))
            # Cut the stop string's tokens out of the cache (at the end of it, as /continue
            # does); a re-encoded end of the answer is pending, like the closing text.
            self._truncate(len(self.segments), len(before) + kept, self.evicted_total)
            stats.cache_tokens = len(self.cache_ids)
        else:
            self.segments.append(Segment("answer", answer_text, list(answer_ids)))
        shown = self.decode(answer_ids)
        if resume is not None:
            turn = resume
            turn.answer = shown
            turn.interrupted = not finished
            turn.stats = merge_stats(turn.stats, stats) if extend else stats
        else:
            turn = Turn(user, shown, stats, interrupted=not finished, first_segment=first_segment,
                        evicted_before=min(evicted_before, self.evicted_total))
            self.turns.append(turn)
        # The template's closing text after the answer (e.g. "<|im_end|>\n"). A template that
        # writes a space before the answer (Llama-2's "[/INST] ") renders the answer decoded
        # alone ("Hello") as the model wrote it in context (" Hello"); one that does not needs
        # the text in context.
        expected = prompt_text + answer_text
        for content in dict.fromkeys((shown, answer_text)):
            turn.answer = content
            after = self.render(self.messages(), add_generation_prompt=False)
            if after.startswith(expected):
                if len(after) > len(expected):
                    self.segments.append(self._segment("prompt", after[len(expected) :]))
                return
        turn.answer = shown
        self._reencode_answer(prompt_text)

    def _reencode_answer(self, prompt_text: str) -> None:
        """The template renders the last answer otherwise than the model wrote it (e.g. a
        space before an answer that starts without one, or a trimmed end): encode the answer
        as rendered, and keep the cache up to where its ids differ from the generated ones."""
        after = self.render(self.messages(), add_generation_prompt=False)
        split = None
        if after.startswith(prompt_text):
            split = _split_answer(after[len(prompt_text) :], self.turns[-1].answer)
        if split is None:
            self._rebuild_segments()
            return
        old_fed = self.all_ids[: self.n_fed]
        answer_text, suffix = split
        self.segments[-1] = self._segment("answer", answer_text, self.segments[:-1], content=answer_text)
        if suffix:
            self.segments.append(self._segment("prompt", suffix))
        keep = 0
        for a, b in zip(old_fed, self.all_ids):
            if a != b:
                break
            keep += 1
        self._truncate(len(self.segments), keep, self.evicted_total)

    def _ids_for_cut_answer(self, before: list[int], ids: list[int], text: str) -> tuple[list[int], int]:
        """Ids that read `text` after the ids `before`, for an answer cut before a stop
        string, and how many of them lead as generated.

        The generated ids are kept as far as they decode to a prefix of the text; the rest
        of it (a stop string that begins inside a token) is re-encoded. Should that not
        join, the whole text is encoded afresh, keeping the ids it shares with the answer.
        """
        context = next((seg.text for seg in reversed(self.segments) if seg.text), "")
        kept = len(ids)
        while kept and not text.startswith(self._decode_after(before, ids[:kept])):
            kept -= 1
        head = self._decode_after(before, ids[:kept])
        new = ids[:kept] + self._encode_after(context + head, text[len(head) :])
        if self._decode_after(before, new) != text:
            new = self._encode_after(context, text)
            kept = 0
            while kept < min(len(ids), len(new)) and ids[kept] == new[kept]:
                kept += 1
        return new, kept

    # -- the cache --------------------------------------------------------------------------

    def _forget_cache(self) -> None:
        """Empty the cache; every id of the conversation becomes pending."""
        if hasattr(self.cache, "reset"):
            self.cache.reset()
        self.cache = self.make_cache()
        self.cache_ids = []
        self.n_fed = 0
        for turn in self.turns:  # a new cache has evicted nothing yet
            turn.evicted_before = 0

    def _skip_to_window(self) -> None:
        """An emptied streaming cache is refilled with what it would hold had it never been
        emptied: the pinned start (sinks, system prompt) and the last `recent_size` ids. The
        ids between are counted as evicted instead of being encoded only to be evicted (after
        /undo or /retry past an eviction, a /load, a new system prompt), so the cost is the
        window, not the whole conversation.
        """
        cache = self.cache
        if not hasattr(cache, "evict_for_space") or self.cache_ids or self.n_fed:
            return
        ids = self.all_ids
        pinned, recent = int(cache.pinned), int(cache.recent_size)
        if len(ids) <= pinned + recent:
            return
        if pinned:
            log = _FeedLog(self)
            try:
                self.engine.prefill(cache, ids[:pinned], self.config.engine.prefill_chunk, log.on_evict, 0, log.on_fed)
            finally:
                if log.settle():
                    self.n_fed += len(log.fed)
                else:
                    self._forget_cache()
            if self.n_fed != pinned:
                return
        skipped = len(ids) - recent - pinned
        cache.evicted_total += skipped
        self.n_fed += skipped

    def _rebuild_segments(self) -> None:
        """Tokenize the whole conversation afresh, turn by turn; the cache keeps only the
        ids it shares with the new tokenization (a bounded cache is emptied).

        Answers are re-tokenized too, as the template renders them (with the space it
        writes before one). When the template cannot be split turn by turn, the
        conversation is one prompt segment and undo/retry fall back to re-encoding.
        """
        old_fed = self.all_ids[: self.n_fed]
        segments: list[Segment] = []
        text = ""
        msgs = self._system_messages()
        if msgs:
            sys_text = self.render(msgs, False)
            probe = self.render([*msgs, {"role": "user", "content": "x"}], True)
            if sys_text and probe.startswith(sys_text):
                segments.append(self._segment("prompt", sys_text, segments, content=self.system))
                text = sys_text
        pieces = self._turn_pieces_windowed(text) or self._turn_pieces(text)
        ok = pieces is not None
        for turn, (prompt, answer, suffix) in zip(self.turns, pieces or []):
            turn.first_segment = len(segments)
            turn.evicted_before = 0
            segments.append(self._segment("prompt", prompt, segments, content=turn.user))
            segments.append(self._segment("answer", answer, segments, content=answer))
            if suffix:
                segments.append(self._segment("prompt", suffix, segments))
        if not ok:
            whole = self.render(self.messages(), False)
            segments = [Segment("prompt", whole, self.encode(whole))] if whole else []
            for turn in self.turns:
                turn.first_segment = -1
        self.segments = segments
        self._keep_common_prefix(old_fed)

    def _turn_pieces(self, text: str) -> list[tuple[str, str, str]] | None:
        """Each turn's text as (prompt, answer, closing text), found by rendering the
        conversation up to each message: quadratic in the turns, for any template. None
        when the template cannot be split turn by turn.

        Args:
            text: the rendered text before the first turn (the system prompt's segment).
        """
        msgs = self._system_messages()
        pieces = []
        for turn in self.turns:
            msgs = [*msgs, {"role": "user", "content": turn.user}]
            full = self.render(msgs, True)
            msgs = [*msgs, {"role": "assistant", "content": turn.answer}]
            after = self.render(msgs, False)
            split = _split_answer(after[len(full) :], turn.answer) if after.startswith(full) else None
            if not full.startswith(text) or split is None:
                return None
            pieces.append((full[len(text) :], *split))
            text = after
        return pieces

    def _turn_pieces_windowed(self, text: str) -> list[tuple[str, str, str]] | None:
        """As `_turn_pieces`, in time linear in the turns: each turn is rendered after only
        the system prompt and the turn before it, and the pieces are accepted when together
        they are exactly the whole conversation as rendered (else None: the template looks
        further back, and `_turn_pieces` is used).
        """
        if len(self.turns) < 4:
            return None  # short conversations: the exact method costs as little
        sys_msgs = self._system_messages()
        pieces = []
        prev: list[dict[str, str]] = []
        try:
            for i, turn in enumerate(self.turns):
                window = [*sys_msgs, *prev]
                base = text if i == 0 else self.render(window, False)
                user = {"role": "user", "content": turn.user}
                full = self.render([*window, user], True)
                after = self.render([*window, user, {"role": "assistant", "content": turn.answer}], False)
                split = _split_answer(after[len(full) :], turn.answer) if after.startswith(full) else None
                if not full.startswith(base) or split is None:
                    return None
                pieces.append((full[len(base) :], *split))
                prev = [user, {"role": "assistant", "content": turn.answer}]
        except Exception:  # noqa: BLE001 - a template that refuses a window: use the exact method
            return None
        whole = text + "".join(p + a + c for p, a, c in pieces)
        return pieces if whole == self.render(self.messages(), False) else None

    def _keep_common_prefix(self, old_fed: list[int]) -> None:
        """Cut the cache back to the longest prefix of `old_fed` (what it held) that the
        conversation still starts with; empty it when that cannot be done safely."""
        new = self.all_ids
        keep = 0
        for a, b in zip(old_fed, new):
            if a != b:
                break
            keep += 1
        bounded = hasattr(self.cache, "evict_for_space")
        if keep == 0 or bounded or self.evicted_total or self.cache_ids != old_fed:
            self._forget_cache()
            return
        del self.cache_ids[keep:]
        self.engine.crop(self.cache, keep)
        self.n_fed = keep
        for turn in self.turns:
            turn.evicted_before = 0

    def _ensure_consistent(self) -> None:
        if self.rendered != self.render(self.messages(), False):
            self._rebuild_segments()

    def _truncate(self, n_segments: int, keep: int, evicted_before: int) -> None:
        """Keep `segments[:n_segments]` and at most `keep` ids of them in the cache.

        The cache is cut back (no re-encoding) when nothing was evicted since the cut point
        entered it; otherwise it is emptied and the next turn re-encodes.
        """
        self.segments = self.segments[:n_segments]
        target = max(0, min(self.n_fed, keep, len(self.all_ids)))
        cut = self.n_fed - target
        if cut == 0:
            return
        pinned = int(getattr(self.cache, "pinned", 0)) if self.evicted_total else 0
        if self.evicted_total != evicted_before or cut > len(self.cache_ids) - pinned:
            self._forget_cache()
            return
        del self.cache_ids[len(self.cache_ids) - cut :]
        self.engine.crop(self.cache, len(self.cache_ids))
        self.n_fed = target

    def _turn_start(self, turn: Turn) -> int:
        """Index of the turn's prompt segment, rebuilding the segments if it is unknown."""
        fs = turn.first_segment
        valid = 0 <= fs < len(self.segments) and self.segments[fs].kind == "prompt"
        if not valid or self.rendered != self.render(self.messages(), False):
            self._rebuild_segments()
            fs = turn.first_segment
        return fs

    # -- commands ---------------------------------------------------------------------------

    def drop_cache(self) -> None:
        """Empty the cache but keep the conversation: the next turn re-encodes all of it."""
        self._forget_cache()
        self._ensure_consistent()

    def reset(self) -> None:
        """Forget the conversation and empty the cache; keep the system prompt and settings."""
        self.turns = []
        self._forget_cache()
        self.segments = []

    def undo(self) -> Turn:
        """Drop the last exchange; the cache is cut back to where it was before it.

        Returns:
            the turn that was removed.

        Raises:
            ChatbotError: there is nothing to undo.
        """
        if not self.turns:
            raise ChatbotError("nothing to undo")
        turn = self.turns[-1]
        fs = self._turn_start(turn)
        self.turns.pop()
        if fs < 0:
            self._rebuild_segments()
            return turn
        keep = sum(len(s.ids) for s in self.segments[:fs])
        self._truncate(fs, keep, turn.evicted_before)
        self._ensure_consistent()
        return turn

    def retry(self, sampling: SamplingConfig | None = None) -> Iterator[GenerationChunk]:
        """Regenerate the last answer from the end of its prompt (the cache is cut back there).

        Args:
            sampling: settings for this try only (default: the session's).

        Yields:
            GenerationChunk, as `send`.

        Raises:
            ChatbotError: there is no answer to retry.
        """
        if not self.turns:
            raise ChatbotError("nothing to retry")
        return self._retry(sampling or self.sampling)

    def _retry(self, sampling: SamplingConfig) -> Iterator[GenerationChunk]:
        turn = self.turns[-1]
        fs = self._turn_start(turn)
        if fs < 0:
            # No cut point: regenerate from a fresh encoding of the history before it.
            self._forget_cache()
            whole = self.render(self.messages()[:-1], True)
            self.segments = [Segment("prompt", whole, self.encode(whole))]
            for t in self.turns:
                t.first_segment = -1
            turn.first_segment = 0
        else:
            prompt_end = sum(len(s.ids) for s in self.segments[: fs + 1])
            # Keep the prompt in the cache but its last token: re-feeding that one token gives
            # the logits of the first answer token without re-encoding anything else.
            self._truncate(fs + 1, prompt_end - 1, turn.evicted_before)
        turn.answer = ""
        turn.evicted_before = self.evicted_total
        yield from self._answer(turn.user, None, sampling, resume=turn)

    def can_continue(self) -> bool:
        t = self.turns[-1] if self.turns else None
        return t is not None and (t.interrupted or t.stats.finish_reason in ("length", "interrupted"))

    def continue_answer(self, sampling: SamplingConfig | None = None) -> Iterator[GenerationChunk]:
        """Resume the last answer where it stopped (after Ctrl-C or `max_new_tokens`).

        The end-of-turn text that closed the answer has not entered the cache yet: it is
        dropped and generation goes on from the answer's last token.

        Yields:
            GenerationChunk, as `send`; the text is only the new part.

        Raises:
            ChatbotError: there is no answer, or it ended by itself.
        """
        if not self.turns:
            raise ChatbotError("nothing to continue")
        if not self.can_continue():
            raise ChatbotError("the last answer ended by itself; /retry asks for a new one")
        return self._continue(sampling or self.sampling)

    def _continue(self, sampling: SamplingConfig) -> Iterator[GenerationChunk]:
        turn = self.turns[-1]
        fs = self._turn_start(turn)
        if fs < 0 or fs + 1 >= len(self.segments) or self.segments[fs + 1].kind != "answer":
            raise ChatbotError("cannot continue: the template does not keep answers apart")
        answer_end = sum(len(s.ids) for s in self.segments[: fs + 2])
        self._truncate(fs + 2, answer_end, turn.evicted_before)
        if not self.pending_ids:
            # Everything is in the cache: re-feed the last token for the next logits.
            self._truncate(len(self.segments), self.n_fed - 1, self.evicted_total)
        turn.evicted_before = min(turn.evicted_before, self.evicted_total)
        yield from self._answer(turn.user, None, sampling, resume=turn, extend=True)

    def set_system(self, text: str | None, on_progress: ProgressCallback | None = None) -> int:
        """Replace the system prompt (None or "" removes it) and re-encode the conversation once.

        Returns:
            the number of tokens encoded.

        Raises:
            ContextFullError: the conversation no longer fits (it is kept, not encoded).
        """
        self.system = text if text and text.strip() else None
        self._rebuild_segments()
        return self.prefill_pending(on_progress)

    def prefill_pending(self, on_progress: ProgressCallback | None = None) -> int:
        """Feed every pending id into the cache now, in chunks (e.g. after a load).

        Interrupted, it keeps what was fed; the rest stays pending for the next turn.

        Returns:
            the number of tokens fed.

        Raises:
            ContextFullError: the pending ids do not fit in a growing cache.
        """
        self._skip_to_window()
        ids = self.pending_ids
        if not ids:
            return 0
        self.engine.check_room(self.cache, len(ids))
        chunk = self.engine.chunk_size(self.cache, self.config.engine.prefill_chunk)
        log = _FeedLog(self)
        total = len(ids)
        try:
            for start in range(0, total, chunk):
                piece = ids[start : start + chunk]
                self.engine.prefill(self.cache, piece, chunk, log.on_evict, 0, log.on_fed)
                if on_progress is not None:
                    on_progress(min(start + chunk, total), total)
        finally:
            if log.settle():
                self.n_fed += len(log.fed)
            else:
                self._forget_cache()
        return len(log.fed)

    def set_sampling(self, sampling: SamplingConfig) -> None:
        reseed = sampling.seed != self.sampling.seed
        self.sampling = sampling
        if reseed:
            self._seed_generator()

    # -- saving and loading -----------------------------------------------------------------

    def to_dict(self, model: str | None = None) -> dict[str, Any]:
        """The conversation as plain data: messages, system prompt, settings, per-turn stats."""
        return {
            "format": SAVE_FORMAT,
            "version": SAVE_VERSION,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": model,
            "system": self.system,
            "settings": self.sampling.as_dict(),
            "messages": self.messages(),
            "turns": [t.as_dict() for t in self.turns],
        }

    def restore(self, data: Any, on_progress: ProgressCallback | None = None, encode: bool = True,
                warnings: list[str] | None = None) -> int:
        """Replace the conversation with saved data (`to_dict` output, or a bare
        `{"messages": [...]}`) and re-encode it in chunks.

        Args:
            warnings: told what was left out (settings out of range).

        Returns:
            the number of tokens encoded.

        Raises:
            ConfigError: the data is not a conversation (nothing is changed).
            ContextFullError: it does not fit in the context (it is kept, not encoded).
        """
        system, sampling, turns = parse_saved(data, self.sampling, warnings)
        self.system = system
        self.turns = turns
        self.set_sampling(sampling)
        self._rebuild_segments()
        return self.prefill_pending(on_progress) if encode else 0

    def save(self, path: str | os.PathLike[str], model: str | None = None) -> Path:
        """Write `to_dict` as JSON (see `write_saved`).

        Raises:
            ChatbotError: the file cannot be written.
        """
        return write_saved(path, self.to_dict(model))

    def load(self, path: str | os.PathLike[str], on_progress: ProgressCallback | None = None) -> dict[str, Any]:
        """Read a file written by `save` and continue that conversation.

        Returns:
            the file's data (for its model name and stats).

        Raises:
            ChatbotError: the file cannot be read or is not a saved chat.
        """
        data = read_saved(path)
        self.restore(data, on_progress)
        return data

    # -- reports ----------------------------------------------------------------------------

    def cache_layout(self) -> CacheLayout:
        layout = getattr(self.cache, "layout", None)
        oldest = ""
        info = layout() if callable(layout) else None
        # The sinks count as pinned only once the cache holds them (after /undo it may not).
        pinned = min(int(getattr(info, "pinned", 0)) if info else 0, len(self.cache_ids))
        if self.cache_ids:
            tail = self.cache_ids[pinned : pinned + 24]
            oldest = self.tokenizer.decode(tail, skip_special_tokens=True).strip()
        length = len(self.cache_ids)
        return CacheLayout(length, self.capacity, pinned, length - pinned, self.evicted_total, oldest)

    def summary(self) -> dict[str, Any]:
        """Totals over all turns, for /stats."""
        gen = sum(t.stats.generated_tokens for t in self.turns)
        ctx = sum(t.stats.context_tokens for t in self.turns)
        dec = sum(t.stats.decode_time_s for t in self.turns)
        lat = sum(len(t.stats.token_latencies_s) for t in self.turns)
        return {
            "turns": len(self.turns),
            "context_tokens": ctx,
            "generated_tokens": gen,
            "decode_tps": lat / dec if dec else 0.0,
            "cache_tokens": len(self.cache_ids),
        }


def _split_answer(rest: str, answer: str) -> tuple[str, str] | None:
    """Where a template put an answer in `rest` (the conversation rendered after the
    generation prompt): the answer's text there and the closing text after it; None when
    it is not there.

    Whitespace the template writes before the answer (the space after Llama-2's "[/INST]")
    belongs to the answer: the model answers from the end of the generation prompt, and
    writes that space itself (SentencePiece's "▁Hello").
    """
    if rest.startswith(answer):
        return answer, rest[len(answer) :]
    core = answer.strip()
    if not core:
        return "", rest
    at = rest.find(core)
    if at < 0 or rest[:at].strip():
        return None
    return rest[: at + len(core)], rest[at + len(core) :]


def read_saved(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON of a saved chat.

    Raises:
        ChatbotError: the file cannot be read or is not JSON.
    """
    p = expand(path)
    text = read_text(p, MAX_SAVED_BYTES, "saved chat")
    data = loads_json(text, f"{p}")
    if not isinstance(data, dict):
        raise ChatbotError(f"{p} is not a saved chat (expected a JSON object)")
    return data



def write_saved(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write a saved chat as JSON, atomically (a crash never leaves half a file), private to
    the user (0600), refusing targets that are not regular files; returns the path written.

    Raises:
        ChatbotError: the file cannot be written.
    """
    target = expand(path)
    text = json.dumps(data, ensure_ascii=False, indent=1)
    _check_save_target(target)
    tmp: str | None = None
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")  # 0600
        with os.fdopen(fd, "wb") as f:
            f.write((text + "\n").encode("utf-8", errors="surrogatepass"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise ChatbotError(f"cannot save to {target}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None:  # a failed write leaves no copy of the chat behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return target

def parse_saved(data: Any, base: SamplingConfig,
                warnings: list[str] | None = None) -> tuple[str | None, SamplingConfig, list[Turn]]:
    """System prompt, settings and turns from saved data; `base` fills missing settings and
    replaces bad ones (each named in `warnings`).

    Raises:
        ConfigError: the data is not a conversation.
    """
    if not isinstance(data, dict):
        raise ConfigError("a saved chat is a JSON object with messages")
    system = data.get("system")
    turns: list[Turn] = []
    if isinstance(data.get("turns"), list):
        for i, t in enumerate(data["turns"]):
            if not isinstance(t, dict) or not isinstance(t.get("user"), str) or not isinstance(t.get("answer"), str):
                raise ConfigError(f"turn {i + 1}: expected user and answer text")
            turns.append(Turn(t["user"], t["answer"], stats_from_dict(t.get("stats")), bool(t.get("interrupted"))))
    elif isinstance(data.get("messages"), list):
        msgs = data["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            raise ConfigError("messages must be objects with role and content")
        if msgs and msgs[0].get("role") == "system":
            system = msgs[0]["content"]
            msgs = msgs[1:]
        if len(msgs) % 2 or any(
            m.get("role") != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(msgs)
        ):
            raise ConfigError("messages must alternate user and assistant, after an optional system message")
        turns = [Turn(u["content"], a["content"], TurnStats()) for u, a in zip(msgs[::2], msgs[1::2])]
    else:
        raise ConfigError("a saved chat needs a list of turns or messages")
    if system is not None and not isinstance(system, str):
        raise ConfigError("system must be text")
    sampling = base
    settings = data.get("settings")
    if isinstance(settings, dict):
        for key, value in settings.items():
            if key in SamplingConfig.RANGES:
                if value is None and key != "seed":
                    continue
                try:
                    sampling = sampling.with_value(key, "none" if value is None else value)
                except ConfigError as exc:  # one bad value must not refuse the whole chat
                    if warnings is not None:
                        warnings.append(f"setting left as it was: {exc}")
    return (system or None), sampling, turns


def _check_save_target(target: Path) -> None:
    """Refuse to replace anything but a regular file (a FIFO, a device, a folder) and a
    loop of symbolic links, before writing a byte.

    Raises:
        ChatbotError: the target is not a file a chat can be saved to.
    """
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ChatbotError(f"cannot save to {target}: a loop of symbolic links") from None
        raise ChatbotError(f"cannot save to {target}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise ChatbotError(f"cannot save to {target}: it is {kind}")


def default_recent_size(max_context: int) -> int:
    """A sensible window for --enable-streaming: about a quarter of the trained context,
    e.g. 2000 for an 8k model, at least 256."""
    return max(256, min(2000, max_context // 4))


def sampling_from_model(model: Any, **overrides: Any) -> SamplingConfig:
    """Sampling defaults from the model's generation_config, then explicit overrides.

    Raises:
        ConfigError: an override is out of range.
    """
    base = SamplingConfig()
    gc = getattr(model, "generation_config", None)
    values: dict[str, Any] = {}
    if gc is not None:
        if getattr(gc, "do_sample", None) is False and "temperature" in overrides:
            values["temperature"] = 0.0
        for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
            v = getattr(gc, key, None)
            if v is not None and v != getattr(type(gc)(), key, None):
                values[key] = v
    values.update({k: v for k, v in overrides.items() if v is not None})
    return dataclasses.replace(base, **values).validated()
