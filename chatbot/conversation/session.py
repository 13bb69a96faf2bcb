"""A chat conversation on one persistent cache.

The conversation is a list of segments: spans of text with the token ids that stand for
them. Prompt segments (template text, system and user messages) are tokenized by us; answer
segments keep the ids the model generated. Concatenated, the segments' text is the
conversation as the chat template renders it, and their ids are what the cache has seen.
Each turn prefills only the ids the cache has not seen yet.

Invariant, after every method returns (and after an interrupt), once the conversation has
a turn or a system prompt segment (a new or reset session may have no segments yet):

- ``tokenizer.decode(all_ids) == rendered == render(messages(), add_generation_prompt=False)``;
- the first `n_fed` ids of `all_ids` went through the cache (`kv.seen`); `cache_ids` is
  what the cache holds now (the same ids unless a bounded cache evicted some). The cache's
  own bookkeeping (`TrackedCache`) checks the rest.

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

import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from chatbot.config import ChatConfig, SamplingConfig
from chatbot.conversation.alignment import (
    LeadingText,
    Segment,
    TextCodec,
    conversation,
    conversation_segments,
    segment_after,
    split_answer,
)
from chatbot.conversation.cache import ConversationCache
from chatbot.conversation.chat import Chat, Meter, ModelInfo
from chatbot.conversation.kvstore import KVStore
from chatbot.conversation.saved import Turn
from chatbot.conversation.settings import run_record
from chatbot.conversation.thinking import ThinkingBudget, ThinkingMeter, opens_thinking
from chatbot.engine.cache.tracked import TrackedCache
from chatbot.engine.chunk import GenerationChunk
from chatbot.engine.detokenize import IncrementalDetokenizer
from chatbot.engine.generate import Engine, TokenObserver
from chatbot.engine.sampling import (
    sampling_from_model,  # noqa: F401 - re-exported
    seeded_generator,
)
from chatbot.engine.stats import TurnStats, merge_stats, stats_from_arrivals, summarize
from chatbot.engine.stop_criteria import stop_checks
from chatbot.errors import ChatbotError, ConfigError
from chatbot.models.templates import TemplateInfo, answer_stops, thinking_kwargs, thinking_switch

ProgressCallback = Callable[[int, int], None]  # (tokens done, tokens in all)


class ChatSession(ConversationCache, Chat[GenerationChunk]):
    """Messages, the token ids in the cache, and `send()` that streams an answer (the
    `Chat` interface; `retry`, `undo` and `continue_answer` cut the cache back).

    Args:
        engine: the model runner.
        config: system prompt, sampling and engine settings.
        template: what the loader set the chat template to (`apply_template`): its stop
            strings and ids end answers. Without it they are found from the tokenizer.
    """

    def __init__(
        self, engine: Engine, config: ChatConfig | None = None, template: TemplateInfo | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.text = TextCodec(self.tokenizer)
        self.config = config or ChatConfig()
        self.sampling: SamplingConfig = self.config.sampling
        self.system: str | None = self.config.system
        self.kv = self.make_cache()
        self.segments: list[Segment] = []
        self.turns: list[Turn] = []
        self.notes: list[str] = []
        self.generator = seeded_generator(engine.device, self.sampling.seed)
        self._set_thinking(self.sampling.think)
        # Told of each answer token with its logits (the server's logprobs); None: nobody.
        self.token_observer: TokenObserver | None = None
        # What ends an answer: stop ids, and the fallback template's stop strings matched as
        # text (single-token ones are stop ids too; the text match also catches them spelled
        # out in several tokens).
        self.stop_ids, self.stops = answer_stops(self.tokenizer, engine.model, template)
        # Where an empty cache may take the keys and values of its first ids from (a
        # server's other conversations with the same start): given the cache and the ids it
        # is about to take in, it fills the cache with a leading part and says how many.
        self.prefix_donor: Callable[[TrackedCache, list[int]], int] | None = None
        # Where the cache is kept on disk after each turn (a logged chat; `keep_cache_in`),
        # and what the last restore took from it: (tokens reused, of the history's tokens),
        # or why it took nothing; the first turn after it shows the reuse.
        self.kv_store: KVStore | None = None
        self._model_identity: str | None = None
        self._reused: tuple[int, int] | None = None
        self._store_note: str | None = None
        self._resuming = False

    # -- set-up -------------------------------------------------------------------------

    # -- text and ids ---------------------------------------------------------------------

    def _system_messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def messages(self) -> list[dict[str, str]]:
        """The conversation as role/content records, system prompt first when set."""
        return conversation(self._system_messages(), self.turns)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.text.render(messages, add_generation_prompt)

    def encode(self, text: str, literal: bool = False) -> list[int]:
        return self.text.encode(text, literal)

    def decode(self, ids: Sequence[int]) -> str:
        return self.text.decode(ids)

    def _segment(
        self, kind: str, text: str, before: Sequence[Segment] | None = None, content: str | None = None
    ) -> Segment:
        """A segment of `text` as it reads after `before` (default: the conversation's
        segments); see `TextCodec.segment`."""
        return segment_after(self.text, self.segments if before is None else before, kind, text, content)

    @property
    def rendered(self) -> str:
        return "".join(s.text for s in self.segments)

    @property
    def conversation_tokens(self) -> int:
        """Tokens in the cache plus those waiting to enter it (the context meter)."""
        return len(self.cache_ids) + len(self.all_ids) - self.n_fed

    # -- a turn ---------------------------------------------------------------------------

    def _check_model_file(self) -> None:
        """Refuse a turn, before anything changes, when the file the model's weights are
        mapped from changed on disk since the load (a GGUF run as stored): a rewritten file
        answers garbage and a truncated one kills the process with SIGBUS at the next read.
        One `stat`; a change while an answer is being generated is not seen.

        Raises:
            ChatbotError: the file changed, saying to restart.
        """
        stamp = getattr(self.engine.model, "chatbot_file_stamp", None)
        if stamp is not None:
            stamp.check()

    def _check_usable(self) -> None:
        self._check_model_file()

    def _send(self, text: str, sampling: SamplingConfig) -> Generator[GenerationChunk, None, None]:
        if self.segments or self.turns:
            self._ensure_consistent()
        msgs = [*self.messages(), {"role": "user", "content": text}]
        full = self.render(msgs, add_generation_prompt=True)
        if full.startswith(self.rendered):
            prompt = self._segment("prompt", full[len(self.rendered) :], content=text)
        else:  # the template renders the past otherwise now (it drops earlier thinking)
            prompt = self._realign(full, text)
        yield from self._answer(text, prompt, sampling)

    def _answer(
        self,
        user: str,
        prompt: Segment | None,
        sampling: SamplingConfig,
        resume: Turn | None = None,
        extend: bool = False,
    ) -> Generator[GenerationChunk, None, None]:
        """Feed what is pending (plus `prompt`) and stream the answer.

        `resume` regenerates (or, with `extend`, lengthens) the answer of an existing turn.
        With stop strings, the chunks' text stops before the first one and holds back an
        end that may be the start of one; their ids are the tokens as generated.
        """
        # A Ctrl-C while the window is refilled ends the turn like one in the prefill: the
        # finally below closes it.
        interrupted = False
        self._before_forward()
        try:
            self._skip_to_window()
        except KeyboardInterrupt:
            interrupted = True
        first_segment = len(self.segments)
        evicted_before = self.evicted_total
        new_ids = self.pending_ids + (prompt.ids if prompt else [])
        if prompt is not None:
            self.segments.append(prompt)
        if self.prefix_donor is not None and self.n_fed == 0 and len(new_ids) > 1 and not interrupted:
            # the last id is fed here: its logits start the answer
            new_ids = new_ids[self.prefix_donor(self.kv, new_ids[:-1]) :]
        if self.n_fed == 0 and not interrupted and self._pass_queries is None:
            self._pass_queries = self._queries_to_keep(new_ids, user)
        last = self.segments[-1] if self.segments else None
        before = last if extend and last is not None and last.kind == "answer" else None
        lead = LeadingText(self.text, self.all_ids) if before is not None else None
        stop, view = stop_checks(
            self.tokenizer, self.stops, *((before.text, len(before.ids)) if before is not None else ())
        )
        meter, budget = self._thinking(
            "".join(s.text for s in self.segments[-2 if before else -1 :]), sampling
        )
        seen_before = self.n_fed
        chunks = self._generate(new_ids, sampling, stop, budget)
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
                shown_chunk = chunk if view is None else view.chunk(chunk)
                meter.add(shown_chunk.text, len(chunk.token_ids))
                if stats is not None:
                    stats.thinking_tokens, stats.thinking_time_s = meter.tokens, meter.seconds
                yield shown_chunk
            finished = True
        finally:
            chunks.close()
            sound = self.kv.settle()
            fed = self.kv.seen[seen_before:] if sound else []
            if not sound:
                self._forget_cache()
            if not (finished or resume is not None or fed or shown):
                # Stopped before anything reached the cache: the turn never happened.
                if prompt is not None:
                    self.segments.pop()
                if self.kv.seen != self.all_ids[: self.n_fed]:
                    # a prefix donor's ids that reach into the message taken back
                    self._keep_common_prefix()
            else:
                answer_fed = fed[len(new_ids) :]
                answer_ids = shown if finished or len(shown) >= len(answer_fed) else answer_fed
                if stats is None:
                    stats = stats_from_arrivals(
                        min(len(fed), len(new_ids)), len(answer_ids), t0, times, self.kv.layout()
                    )
                    stats.thinking_tokens, stats.thinking_time_s = (
                        min(meter.tokens, len(answer_ids)),
                        meter.seconds,
                    )
                self._note_reused(stats)
                self._close_turn(
                    user, answer_ids, stats, finished, first_segment, evicted_before, resume, extend
                )
                if self.kv_store is not None:
                    self.kv_store.save(self.kv)
                if resume is None and len(self.turns) == 1:
                    self._keep_start_after(len(new_ids))
            self._pass_queries = None

    def _generate(
        self, new_ids: list[int], sampling: SamplingConfig, stop: Any, budget: ThinkingBudget | None
    ) -> Generator[GenerationChunk, None, None]:
        """The engine's answer after `new_ids`, on the chat's cache, stops and observers."""
        return self.engine.generate(
            self.kv,
            new_ids,
            sampling,
            stop_ids=self.stop_ids,
            prefill_chunk=self.config.engine.prefill_chunk,
            generator=self.generator,
            stopping_criteria=stop,
            observer=self.token_observer,
            on_progress=self.prefill_observer,
            insert=budget,
            queries=self._pass_queries,
        )

    def _thinking(
        self, lead_text: str, sampling: SamplingConfig
    ) -> tuple[ThinkingMeter, ThinkingBudget | None]:
        """Where the template (or the answer so far, `lead_text`) left a thinking tag open, the
        answer starts inside it: the meter of its thinking, and the budget that closes it."""
        self.thinking_opened = opens_thinking(lead_text)
        budget = None
        if sampling.think_budget is not None:
            detok = IncrementalDetokenizer(self.tokenizer).add
            budget = ThinkingBudget(sampling.think_budget, self.thinking_opened, self.encode, detok)
        return ThinkingMeter(self.thinking_opened), budget

    def _note_reused(self, stats: TurnStats) -> None:
        """The first turn after a resume says how much of the history came from the disk cache."""
        if self._reused is not None:
            stats.reused_tokens, stats.reused_of = self._reused
            self._reused = None

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
        answer_text = self.text.decode_after(before, answer_ids)
        at = self.stops.find(answer_text)
        if at >= 0:
            answer_text = answer_text[:at]
            context = next((seg.text for seg in reversed(self.segments) if seg.text), "")
            answer_ids, kept = self.text.ids_for_cut_answer(before, answer_ids, answer_text, context)
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
            turn = Turn(
                user,
                shown,
                stats,
                interrupted=not finished,
                first_segment=first_segment,
                evicted_before=min(evicted_before, self.evicted_total),
            )
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
                break
        else:
            turn.answer = shown
            self._reencode_answer(prompt_text)
        # The stats line counts what the toolbar's meter counts: the cache with the closing
        # text that waits to enter it (the cache alone read 72 beside the toolbar's 74).
        stats.cache_tokens = turn.stats.cache_tokens = self.cache_count()

    def _reencode_answer(self, prompt_text: str) -> None:
        """The template renders the last answer otherwise than the model wrote it (e.g. a
        space before an answer that starts without one, or a trimmed end): encode the answer
        as rendered, and keep the cache up to where its ids differ from the generated ones."""
        after = self.render(self.messages(), add_generation_prompt=False)
        split = None
        if after.startswith(prompt_text):
            split = split_answer(after[len(prompt_text) :], self.turns[-1].answer)
        if split is None:
            self._rebuild_segments()
            return
        answer_text, suffix = split
        self.segments[-1] = self._segment("answer", answer_text, self.segments[:-1], content=answer_text)
        if suffix:
            self.segments.append(self._segment("prompt", suffix))
        self._truncate(len(self.segments), self.kv.common_prefix(self.all_ids), self.evicted_total)

    def _rebuild_segments(self) -> None:
        """Tokenize the whole conversation afresh, turn by turn; the cache keeps only the
        ids it shares with the new tokenization (a bounded cache is emptied).

        Answers are re-tokenized too, as the template renders them (with the space it
        writes before one). When the template cannot be split turn by turn, the
        conversation is one prompt segment and undo/retry fall back to re-encoding.
        """
        self.segments, starts = conversation_segments(self.text, self.system, self.turns)
        for turn, start in zip(self.turns, starts):
            turn.first_segment = start
            turn.evicted_before = 0
        self._keep_common_prefix()

    def _ensure_consistent(self) -> None:
        if self.rendered != self.render(self.messages(), False):
            self._rebuild_segments()

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

    def _clear(self) -> None:
        """`reset`: the cache is emptied too."""
        self._forget_cache()
        self.segments = []

    def _undo(self) -> Turn:
        """Drop the last exchange; the cache is cut back to where it was before it."""
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

    def _retry(self, sampling: SamplingConfig) -> Generator[GenerationChunk, None, None]:
        """Regenerate the last answer from the end of its prompt (the cache is cut back there)."""
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

    def _continue(self, sampling: SamplingConfig) -> Generator[GenerationChunk, None, None]:
        """Go on from the answer's last token: the end-of-turn text that closed the answer has
        not entered the cache yet, so it is dropped."""
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

    def _check_sampling(self, sampling: SamplingConfig) -> None:
        if sampling.draft == "model" and self.engine.draft_model is None:
            raise ConfigError("draft model: none is loaded (start with --draft FILE or hub id)")
        fmt = sampling.output_format
        if fmt is not None and fmt != self.sampling.output_format:
            from chatbot.engine.grammar import compiled  # imported only when a format is asked for

            compiled(self.tokenizer, fmt)  # GrammarError: no grammar engine, or a schema it refuses

    def _use_sampling(self, sampling: SamplingConfig) -> None:
        reseed = sampling.seed != self.sampling.seed
        if sampling.think != self.sampling.think:
            self._set_thinking(sampling.think)
        self.sampling = sampling
        if reseed:
            self.generator = seeded_generator(self.engine.device, sampling.seed)

    def _set_thinking(self, think: str | None) -> None:
        """Render the template with `think`'s switch (`thinking_kwargs`); a template with
        none says so in a note."""
        switch = thinking_switch(getattr(self.tokenizer, "chat_template", None))
        self.text.template_kwargs = thinking_kwargs(think, switch)
        if think is not None and switch is None:
            self.notes.append(
                f"think {think}: this model's chat template has no thinking switch "
                "(enable_thinking, reasoning_effort); it thinks as it always does"
            )

    def _encode_conversation(self, on_progress: ProgressCallback | None, encode: bool = True) -> int:
        """Re-tokenize the whole conversation and (with `encode`) prefill it in chunks, after
        what the chat's disk cache holds of it (`kv_store`)."""
        self._rebuild_segments()
        self._reused, self._store_note = None, None
        resuming, self._resuming = self._resuming, False
        store, self._resume_from = self._resume_from or self.kv_store, None
        if encode and resuming and store is not None and self.kv.ids and store.path.exists():
            self._forget_cache()  # (a /load into a chat) the file's cache replaces it
        if encode and resuming and store is not None and not self.kv.ids and self.all_ids:
            reused, why = store.load(self.kv, self.all_ids, self.engine.device)
            if reused:
                self._reused = (reused, len(self.all_ids))
                if self.kv.is_bounded:  # the rest goes with the next message, in one pass as in
                    return 0  # the chat that never stopped: its evictions are the same
            elif why is not None:
                self._store_note = why
                self._forget_cache()
        return self.prefill_pending(on_progress) if encode else 0

    # -- reports ----------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Totals over all turns, for /stats."""
        return summarize([t.stats for t in self.turns], self.cache_count())

    def describe_model(self, model: ModelInfo) -> tuple[str, dict[str, str]]:
        rows = dict(model.describe())
        # one context row: the limit this chat runs under, and the model's where that differs
        own = rows.pop("context", None)
        rows["context limit"] = f"{self.max_context:,} tokens" + (
            f" (the model's: {int(own):,})" if own and own.isdigit() and int(own) != self.max_context else ""
        )
        rows["cache"] = f"{self.cache_count():,} / {self.capacity:,} tokens" + (
            " (attention sinks + recent window)" if self.kv.is_bounded else ""
        )
        rows["decode"] = self.engine.backend.describe()
        return "model", rows

    def run_record(self) -> dict[str, Any]:
        return run_record(self.config)

    def describe_cache(self) -> tuple[str, dict[str, str]]:
        lay = self.cache_layout()
        return "cache", {
            "tokens": f"{lay.length:,} / {lay.capacity:,}",
            "pending (enter with the next message)": f"{len(self.pending_ids):,}",
            "pinned (sinks, system)": f"{lay.pinned:,}",
            "recent": f"{lay.recent:,}",
            "evicted so far": f"{lay.evicted_total:,}",
            "from the disk cache": self._start_note(),
            "oldest text in window": " ".join(lay.oldest_text.split())[:80] or "-",
        }

    def template_system(self) -> str | None:
        from chatbot.models.templates import default_system_prompt

        return default_system_prompt(self.tokenizer)

    def cache_count(self) -> int:
        """The cache with what waits to enter it (the closing text of the last answer), as the
        toolbar, the stats line and /stats count it; a bounded cache never holds more than
        its window (what enters evicts), so it is shown full, not over."""
        used = self.conversation_tokens
        return min(used, self.capacity) if self.kv.is_bounded else used

    def meter(self) -> Meter:
        """The toolbar's gauge (`cache_count`)."""
        return Meter("cache", self.cache_count(), self.capacity)

    def encoded_note(self, tokens: int, system: bool) -> str:
        if system:
            return f"; re-encoded {tokens:,} tokens"
        if self._reused is not None:
            reused, of = self._reused
            later = f"{of - reused:,} with the next message"
            rest = f"{tokens:,} encoded" if tokens or of == reused else later
            return f" (reused {reused:,} of {of:,} tokens from the disk cache, {rest})"
        why = f"; {self._store_note}, re-encoded" if self._store_note else ""
        return f" ({tokens:,} tokens encoded{why})"
