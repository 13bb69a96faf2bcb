"""A chat conversation on one persistent cache.

The conversation is a list of segments: spans of text with the token ids that stand for
them. Prompt segments (template text, system and user messages) are tokenized by us; answer
segments keep the ids the model generated. Concatenated, the segments' text is the
conversation as the chat template renders it, and their ids are what the cache has seen.
Each turn prefills only the ids the cache has not seen yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from chatbot.config import ChatConfig, SamplingConfig
from chatbot.engine.generate import Engine, GenerationChunk
from chatbot.engine.stats import TurnStats
from chatbot.errors import ChatbotError


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
    first_segment: int = 0  # index of the turn's first segment


@dataclass
class CacheLayout:
    """What `/cache` shows."""

    length: int
    capacity: int
    pinned: int
    recent: int
    evicted_total: int
    oldest_text: str


class ChatSession:
    """Messages, the token ids in the cache, and `send()` that streams an answer.

    Args:
        engine: the model runner.
        config: system prompt, sampling and engine settings.
        cache: a cache to continue (default: a new one from `make_cache`).
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

    # -- set-up -------------------------------------------------------------------------

    def make_cache(self) -> Any:
        ec = self.config.engine
        if not ec.enable_streaming:
            return self.engine.new_cache()
        from chatbot.engine.sink_cache import SinkCache

        recent = ec.recent_size or default_recent_size(self.engine.max_context)
        cache = SinkCache.for_model(self.engine.model, ec.start_size, recent)
        keep = ec.keep_system if ec.keep_system is not None else bool(self.system)
        if keep:
            cache.pin(self.system_prompt_tokens())
        return cache

    def system_prompt_tokens(self) -> int:
        """How many tokens the rendered system prompt takes at the start of the conversation."""
        if not self.system:
            return 0
        msgs = [{"role": "system", "content": self.system}]
        try:
            sys_text = self.render(msgs, False)
            full = self.render([*msgs, {"role": "user", "content": "x"}], False)
        except Exception:  # a template that cannot render a lone system message
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
        except Exception:
            return []
        if marker not in text:
            return []
        suffix = text.split(marker, 1)[1]
        special = set(self.tokenizer.all_special_ids)
        added = {i for i, tok in self.tokenizer.added_tokens_decoder.items() if tok.special}
        return [i for i in self.encode(suffix) if i in special or i in added][:1]

    # -- text and ids ---------------------------------------------------------------------

    def messages(self) -> list[dict[str, str]]:
        """The conversation as role/content records, system prompt first when set."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns:
            msgs.append({"role": "user", "content": t.user})
            msgs.append({"role": "assistant", "content": t.answer})
        return msgs

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

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

    # -- a turn ---------------------------------------------------------------------------

    def send(self, text: str, sampling: SamplingConfig | None = None) -> Iterator[GenerationChunk]:
        """Add a user message and stream the answer.

        Args:
            text: the user's message.
            sampling: settings for this turn only (default: the session's).

        Yields:
            GenerationChunk; the last one has the finish reason and stats.

        Raises:
            ContextFullError: the message does not fit; nothing is changed.
            KeyboardInterrupt: re-raised after the partial answer has been kept.
        """
        if not text.strip():
            raise ChatbotError("empty message")
        msgs = [*self.messages(), {"role": "user", "content": text}]
        full = self.render(msgs, add_generation_prompt=True)
        prefix = self.rendered
        if not full.startswith(prefix):
            # The template re-renders the past differently (e.g. it drops old reasoning):
            # start over from a fresh tokenization of the whole conversation.
            self._forget_cache()
            self.segments = []
            prefix = ""
        prompt = Segment("prompt", full[len(prefix) :], self.encode(full[len(prefix) :]))
        return self._answer(text, prompt, sampling or self.sampling)

    def _answer(
        self, user: str, prompt: Segment | None, sampling: SamplingConfig, resume: Turn | None = None
    ) -> Iterator[GenerationChunk]:
        segments_before = len(self.segments)
        new_ids = self.pending_ids + (prompt.ids if prompt else [])
        n_new = len(new_ids)
        fed_new = 0
        answer_fed: list[int] = []

        def on_fed(ids: Sequence[int]) -> None:
            nonlocal fed_new
            self.cache_ids.extend(ids)
            for tid in ids:
                if fed_new < n_new:
                    fed_new += 1
                else:
                    answer_fed.append(tid)

        def on_evict(start: int, end: int) -> None:
            del self.cache_ids[start:end]

        chunks = self.engine.generate(
            self.cache,
            new_ids,
            sampling,
            history_ids=self.cache_ids,
            stop_ids=self.stop_ids,
            prefill_chunk=self.config.engine.prefill_chunk,
            on_evict=on_evict,
            on_fed=on_fed,
            generator=self.generator,
        )
        answer_ids: list[int] = []
        stats: TurnStats | None = None
        started = False
        finished = False
        try:
            for chunk in chunks:
                if not started:
                    started = True
                    if prompt is not None:
                        self.segments.append(prompt)
                answer_ids.extend(chunk.token_ids)
                if chunk.stats is not None:
                    stats = chunk.stats
                yield chunk
            finished = True
        except (KeyboardInterrupt, GeneratorExit):
            if not started and prompt is not None and fed_new > 0:
                self.segments.append(prompt)
                started = True
            raise
        finally:
            if started or fed_new > 0:
                self._close_turn(user, prompt, answer_ids if finished else answer_fed, stats,
                                 fed_new, n_new, answer_fed, finished, segments_before, resume)
            else:
                # Interrupted before anything reached the cache: the turn never happened.
                self.engine.crop(self.cache, len(self.cache_ids))

    def _close_turn(
        self,
        user: str,
        prompt: Segment | None,
        answer_ids: list[int],
        stats: TurnStats | None,
        fed_new: int,
        n_new: int,
        answer_fed: list[int],
        finished: bool,
        segments_before: int,
        resume: Turn | None,
    ) -> None:
        """Record the exchange and queue the template's end-of-turn text.

        On an interrupt the cache may be uneven (a forward pass cut short): it is cut back
        to the tokens we know it holds, and the answer is what reached the cache.
        """
        self.engine.crop(self.cache, len(self.cache_ids))
        self.n_fed += fed_new + len(answer_fed)
        # Interrupted during the prefill, the rest of the prompt simply stays pending.
        answer_text = self.tokenizer.decode(answer_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if stats is None:
            stats = TurnStats(context_tokens=fed_new, generated_tokens=len(answer_ids), finish_reason="interrupted")
            stats.cache_tokens = len(self.cache_ids)
            stats.evicted_total = self.evicted_total
        if resume is not None:
            resume.answer += answer_text
            resume.interrupted = not finished
            turn = resume
        else:
            turn = Turn(user, answer_text, stats, interrupted=not finished, first_segment=segments_before)
            self.turns.append(turn)
        if resume is not None:
            turn.stats = stats
        self.segments.append(Segment("answer", answer_text, list(answer_ids)))
        # The template's closing text after the answer (e.g. "<|im_end|>\n").
        expected = self.rendered
        after = self.render(self.messages(), add_generation_prompt=False)
        if after.startswith(expected):
            suffix = after[len(expected) :]
            if suffix:
                self.segments.append(Segment("prompt", suffix, self.encode(suffix)))

    def _forget_cache(self) -> None:
        self.cache.reset() if hasattr(self.cache, "reset") else None
        self.cache = self.make_cache()
        self.cache_ids = []
        self.n_fed = 0

    # -- commands ---------------------------------------------------------------------------

    def drop_cache(self) -> None:
        """Empty the cache but keep the conversation: the next turn re-encodes all of it."""
        self._forget_cache()
        self.segments = []

    def reset(self) -> None:
        """Forget the conversation and empty the cache; keep the system prompt and settings."""
        self._forget_cache()
        self.segments = []
        self.turns = []

    def set_sampling(self, sampling: SamplingConfig) -> None:
        reseed = sampling.seed != self.sampling.seed
        self.sampling = sampling
        if reseed:
            self._seed_generator()

    def cache_layout(self) -> CacheLayout:
        layout = getattr(self.cache, "layout", None)
        oldest = ""
        info = layout() if callable(layout) else None
        pinned = int(getattr(info, "pinned", 0)) if info else 0
        if self.cache_ids:
            tail = self.cache_ids[pinned : pinned + 24]
            oldest = self.tokenizer.decode(tail, skip_special_tokens=True).strip()
        length = len(self.cache_ids)
        capacity = int(getattr(self.cache, "capacity", 0) or self.engine.max_context)
        return CacheLayout(length, capacity, pinned, length - pinned, self.evicted_total, oldest)

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


