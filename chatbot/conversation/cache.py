"""How a conversation keeps its cache (a part of `ChatSession`): which cache it makes (with
a pinned system prompt under --enable-streaming), what it holds, emptying it, refilling an
emptied window, cutting it back, and feeding what is pending. The ids themselves are kept by
the cache's `TrackedCache`; this is the session's policy on top."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from chatbot.conversation.alignment import Segment
from chatbot.engine.cache.queries import REST_ROWS, PassQueries, exact_rows
from chatbot.engine.cache.sinks import streaming_window
from chatbot.engine.cache.tracked import CacheLayout, TrackedCache
from chatbot.engine.seq import common_prefix
from chatbot.errors import ChatbotError

_MIN_START = 8
"""The fewest ids of a shared start worth a file (a template's opening alone is a few)."""

if TYPE_CHECKING:
    from collections.abc import Callable

    from chatbot.config import ChatConfig, EngineConfig
    from chatbot.conversation.kvstore import KVStore
    from chatbot.conversation.saved import Turn
    from chatbot.engine.generate import Engine


def conversation_cache(
    engine: Engine, ec: EngineConfig, limit: int, pinned_tokens: Callable[[], int] | None = None
) -> TrackedCache:
    """The empty cache of a conversation (a chat's, or a server's raw completion): growing, or
    with `ec.enable_streaming` an attention-sink cache of `ec.start_size` sinks and the recent
    window (its default chosen for `limit` and the model's sliding window).

    Args:
        engine: the model runner.
        ec: the engine settings.
        limit: the most tokens the conversation may hold.
        pinned_tokens: under streaming, the length of the start to pin (a system prompt),
            asked only then; None pins nothing past the sinks.

    Raises:
        ConfigError: the window does not fit `limit`.
        StreamingUnsupportedError: the model cannot take an attention-sink cache.
    """
    if not ec.enable_streaming:
        cache = engine.new_cache()
        cache.max_context = limit
        return cache
    # A model with sliding-window layers (gemma) needs the whole cache inside its window.
    window = streaming_window(engine.model)
    recent = ec.recent_window(limit, window)
    ec.check_window(ec.start_size, recent, limit)
    cache = engine.new_cache(ec.start_size, recent)
    cache.max_context = limit
    if pinned_tokens is not None:
        # A system prompt longer than the context (or the sliding window) allows is pinned
        # only as far as it fits beside the recent window; the rest is evicted like any old text.
        room = max(ec.start_size, min(limit, window or limit) - recent)
        cache.pin(min(pinned_tokens(), room))
    return cache


class ConversationCache:
    """The cache half of `ChatSession` (a mixin: it works on the session's attributes)."""

    engine: Engine
    config: ChatConfig
    system: str | None
    kv: TrackedCache
    segments: list[Segment]
    turns: list[Turn]
    tokenizer: Any
    kv_store: KVStore | None
    text: Any  # the session's TextCodec
    _model_identity: str | None
    _resuming: bool
    _longest: int | None = None  # `_longest_token`
    prefix_donor: Callable[[TrackedCache, list[int]], int] | None
    _keeps_start = False  # `keep_start`
    _start_store: KVStore | None = None  # its file, as last used
    _start_taken = 0  # ids the cache took from it
    _start_refused = False  # its file was there but not used (damaged)
    _pass_queries: PassQueries | None = None  # the first turn's, kept or taken (`keep_start`)
    _reused: tuple[int, int] | None
    _saved_store: KVStore | None = None  # the cache of the last /save, being written
    _resume_from: KVStore | None = None  # the next restore's file where not `kv_store` (/load)

    @property
    def all_ids(self) -> list[int]:
        """Every id of the conversation, in order (the segments' ids)."""
        return [i for s in self.segments for i in s.ids]

    @property
    def pending_ids(self) -> list[int]:
        """The ids of the conversation the cache has not taken in yet."""
        return self.all_ids[self.n_fed :]

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        raise NotImplementedError  # ChatSession's

    def encode(self, text: str, literal: bool = False) -> list[int]:
        raise NotImplementedError  # ChatSession's

    def _rebuild_segments(self) -> None:
        raise NotImplementedError  # ChatSession's

    def _segment(
        self, kind: str, text: str, before: list[Segment] | None = None, content: str | None = None
    ) -> Segment:
        raise NotImplementedError  # ChatSession's

    @property
    def max_context(self) -> int:
        """The most tokens this conversation may hold: the config's, else the engine's."""
        return self.config.engine.max_context or self.engine.max_context

    def make_cache(self) -> TrackedCache:
        ec = self.config.engine
        keep = ec.keep_system if ec.keep_system is not None else bool(self.system)
        return conversation_cache(
            self.engine, ec, self.max_context, self.system_prompt_tokens if keep else None
        )

    def _check_size(self, system: str | None, turns: list[Turn]) -> None:
        """A growing cache refuses a conversation whose characters alone say it holds more
        tokens than the context, before tokenizing it: no token is longer than the vocabulary's
        longest entry, so the text holds at least `characters / longest` tokens. (A 20 MB chat
        took 50 s and 3.6 GB to be found too long.) A bounded cache takes any length.

        Raises:
            ChatbotError: it cannot fit.
        """
        if self.kv.is_bounded:
            return
        chars = len(system or "") + sum(len(t.user) + len(t.answer) for t in turns)
        if chars <= self.max_context:  # (fewer characters than the context: no count can refuse it)
            return
        at_least = chars // self._longest_token()
        if at_least > self.max_context:
            raise ChatbotError(
                f"the conversation is not loaded: its {chars:,} characters are at least "
                f"{at_least:,} tokens, over the context of {self.max_context:,}"
            )

    def _longest_token(self) -> int:
        """Characters in the vocabulary's longest entry (as written in it, which is never
        shorter than the text it stands for); computed once."""
        if self._longest is None:
            try:
                longest = max(map(len, self.tokenizer.get_vocab()), default=0)
            except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary dict: no bound
                longest = 0
            self._longest = longest if longest > 0 else 1 << 30
        return self._longest

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

    @property
    def cache(self) -> Any:
        """The transformers cache the model writes into."""
        return self.kv.cache

    @property
    def cache_ids(self) -> list[int]:
        """The ids the cache holds now (after evictions)."""
        return self.kv.ids

    @property
    def n_fed(self) -> int:
        """How many ids of the conversation have gone through the cache (evicted ones too)."""
        return len(self.kv.seen)

    @property
    def evicted_total(self) -> int:
        return self.kv.evicted_total

    @property
    def capacity(self) -> int:
        """The most tokens the cache holds: the window of a bounded cache, else the context."""
        return self.kv.capacity

    def _forget_cache(self) -> None:
        """Empty the cache; every id of the conversation becomes pending."""
        self.kv.reset()
        self.kv = self.make_cache()  # re-pinned for the current system prompt
        for turn in self.turns:  # a new cache has evicted nothing yet
            turn.evicted_before = 0

    def _before_forward(self) -> None:
        """Wait for the cache's write to disk (if one is under way) before a forward pass
        writes into the cache it reads."""
        for store in (self.kv_store, self._start_store, self._saved_store):
            if store is not None:
                store.wait()

    def _skip_to_window(self) -> None:
        """An emptied streaming cache is refilled with what it would hold had it never been
        emptied: the pinned start (sinks, system prompt) and the last `recent_size` ids. The
        ids between are counted as evicted instead of being encoded only to be evicted (after
        /undo or /retry past an eviction, a /load, a new system prompt), so the cost is the
        window, not the whole conversation.
        """
        try:
            self.engine.refill_window(self.kv, self.all_ids, self.config.engine.prefill_chunk)
        finally:
            if not self.kv.settle():
                self._forget_cache()

    def _keep_common_prefix(self) -> None:
        """Cut the cache back to the longest prefix of what it took in that the conversation
        still starts with; empty a bounded cache (its window is refilled instead)."""
        keep = self.kv.common_prefix(self.all_ids)
        if keep == 0 or self.kv.is_bounded or not self.kv.crop_to(keep):
            self._forget_cache()
            return
        for turn in self.turns:
            turn.evicted_before = 0

    def _realign(self, full: str, content: str) -> Segment:
        """The new turn's prompt segment when the template renders the past otherwise than
        the segments hold it (many templates drop the thinking of earlier answers), `full`
        being the whole conversation as it renders now and `content` the new message.

        The segments wholly before the first character that changed are kept; the prompt is
        the rest of `full`. The cache keeps the ids it shares with that (cut at the first
        that differs, so the part of a segment before the change stays, as a prompt segment
        of its own): only what follows the change is encoded again. A bounded cache is
        emptied instead, and its window refilled.
        """
        common = len(os.path.commonprefix(["".join(s.text for s in self.segments), full]))
        n = at = 0
        while n < len(self.segments) and at + len(self.segments[n].text) <= common:
            at += len(self.segments[n].text)
            n += 1
        self.segments = self.segments[:n]
        for turn in self.turns:
            if turn.first_segment >= n:
                turn.first_segment = -1  # found again (`_turn_start`) when undo asks
        head = self.all_ids
        prompt = self._segment("prompt", full[at:], content=content)
        # the prompt's last id stays to be fed: its logits start the answer
        shared = min(self.kv.common_prefix([*head, *prompt.ids]), len(head) + len(prompt.ids) - 1)
        split = 0 if self.kv.is_bounded else max(0, shared - len(head))
        while split:
            text = self.text.decode_after(head, prompt.ids[:split])
            if prompt.text.startswith(text):
                self.segments.append(Segment("prompt", text, prompt.ids[:split]))
                prompt = Segment("prompt", prompt.text[len(text) :], prompt.ids[split:])
                break
            split -= 1
        self._keep_common_prefix()
        return prompt

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
        if target == 0 or self.evicted_total != evicted_before or not self.kv.crop_to(target):
            self._forget_cache()

    def prefill_pending(self, on_progress: Callable[[int, int], None] | None = None) -> int:
        """Feed every pending id into the cache now, in chunks (e.g. after a load).

        Interrupted, it keeps what was fed; the rest stays pending for the next turn.

        Returns:
            the number of tokens fed.

        Raises:
            ContextFullError: the pending ids do not fit in a growing cache.
        """
        self._before_forward()
        self._skip_to_window()
        ids = self.pending_ids
        if not ids:
            return 0
        self.kv.check_room(len(ids))
        before = self.n_fed
        try:
            self.engine.prefill(self.kv, ids, self.config.engine.prefill_chunk, on_progress=on_progress)
        finally:
            if not self.kv.settle():
                self._forget_cache()
        return max(0, self.n_fed - before)

    def cache_layout(self) -> CacheLayout:
        """Where the cache stands, and the oldest text it holds after the pinned part."""
        layout = self.kv.layout()
        tail = self.cache_ids[layout.pinned : layout.pinned + 24]
        oldest = self.tokenizer.decode(tail, skip_special_tokens=True).strip() if tail else ""
        return dataclasses.replace(layout, oldest_text=oldest)

    # -- the cache on disk -------------------------------------------------------------------

    def keep_cache_for(self, session_id: str, resuming: bool = False) -> None:
        """`Chat.keep_cache_for`: a file of `chatbot.conversation.kvstore` beside the log, and
        the start new chats of this model, template and system prompt share (`keep_start`)."""
        from chatbot.conversation.kvstore import SUFFIX, KVStore, kv_dir

        self.keep_cache_in(KVStore(kv_dir() / (session_id + SUFFIX), self.kv_identity), resuming)
        self.keep_start()

    def keep_start(self) -> None:
        """An empty growing cache takes the keys and values of its first ids from the file of
        the start that chats of this model, template, system prompt, dtype, backend and --opt
        share (the template's opening and the system prompt), where an earlier chat wrote it,
        so the first answer skips their prefill; the first turn that finds none writes it.

        Only where the answer stays the one the whole prompt gets (`chatbot.engine.cache.queries`):
        the forward pass of our own model keeps the start's queries with it, and the rest
        of a prompt continues that pass in one call; taken by a prompt that the whole-prompt
        pass would encode in one forward pass (over the backend's `max_batch`, one chunk),
        as many of the start's positions as `exact_rows` allows, leaving at least
        `REST_ROWS` to encode."""
        if self.kv.is_bounded or self.prefix_donor is not None or not self.engine.backend.keeps_queries:
            return
        if getattr(self.engine.device, "type", "cpu") != "cpu":  # `exact_rows` describes the CPU kernel
            return

        def donor(kv: TrackedCache, ids: list[int]) -> int:
            whole = len(ids) + 1  # the last id is fed too

            def limit(n: int, header: dict[str, Any]) -> int:
                written = header.get("pass")
                if not (isinstance(written, int) and self._one_pass(whole)):
                    return 0
                take = min(exact_rows(n, written, whole), whole - REST_ROWS)
                return take if take >= _MIN_START else 0

            store = self._start_file()
            self._start_taken, why = store.load(kv, ids, self.engine.device, limit=limit)
            self._start_refused = why is not None  # (a damaged file: the next first turn rewrites it)
            if self._start_taken:
                self._pass_queries = PassQueries(self._start_taken, store.queries, continuing=True)
                self._reused = (self._start_taken, whole)
            return self._start_taken

        self.prefix_donor = donor
        self._keeps_start = True

    def _one_pass(self, n: int) -> bool:
        """Whether a prompt of `n` ids from an empty cache is one forward pass (not the
        batched rows of a short one, not several chunks)."""
        return self.engine.backend.max_batch < n <= self.kv.chunk_size(self.config.engine.prefill_chunk)

    def _start_file(self) -> KVStore:
        """The shared start's file for the chat as it is now (its system prompt may change)."""
        import torch

        from chatbot.conversation.kvstore import KVStore, prefix_path

        identity = {
            **self.kv_identity(),
            "opt": str(getattr(self.engine.decoder, "level", "none")),
            "torch": torch.__version__,  # `exact_rows` describes its attention kernel
        }
        if self._start_store is not None:
            self._start_store.wait()
        self._start_store = KVStore(prefix_path(identity), lambda: identity)
        return self._start_store

    def _queries_to_keep(self, new_ids: list[int], user: str) -> PassQueries | None:
        """Before a chat's first turn that took no start from the store: the queries its pass
        keeps for the shared start's file (those of the ids before the message's text)."""
        if (
            not self._keeps_start
            or self._start_taken
            or self.n_fed
            or not user
            or not self._one_pass(len(new_ids))
        ):
            return None
        text = "".join(s.text for s in self.segments)
        at = text.find(user)
        if at <= 0:
            return None
        rows = exact_rows(common_prefix(new_ids, self.encode(text[:at])), len(new_ids))
        return PassQueries(rows) if rows >= _MIN_START else None

    def _start_note(self) -> str:
        """What the cache took from the shared start's file (/cache), or "-"."""
        n = self._start_taken
        if not n or self.kv.seen[:n] != self.all_ids[:n]:
            return "-"
        return f"{n:,} tokens of the start chats share (template and system prompt)"

    def _keep_start_after(self, fed: int) -> None:
        """After a chat's first turn (`fed` ids in its prompt): write the start its pass kept to
        the shared file, where that holds fewer ids or was refused (damaged)."""
        kept, self._pass_queries = self._pass_queries, None
        layers = len(self.kv.layers)
        if kept is None or kept.continuing or not kept.complete(layers) or self.kv.evicted_total:
            return
        store = self._start_file()
        if self._start_refused or len(store.held_ids()) < kept.rows:
            store.save(self.kv, start=kept, pass_length=fed)

    def keep_saved_cache(self, data: dict[str, Any]) -> None:
        from chatbot.conversation.kvstore import KVStore, saved_path

        self._saved_store = KVStore(saved_path(data), self.kv_identity)
        self._saved_store.save(self.kv)

    def take_saved_cache(self, data: dict[str, Any]) -> None:
        from chatbot.conversation.kvstore import KVStore, saved_path

        self._resume_from, self._resuming = KVStore(saved_path(data), self.kv_identity), True

    def keep_cache_in(self, store: KVStore | None, resuming: bool = False) -> None:
        """Keep the cache in `store` after each turn; with `resuming`, the next `restore` (the
        logged chat that `store` was written for) takes what it can from it."""
        self.kv_store = store
        self._resuming = resuming

    def kv_identity(self) -> dict[str, str]:
        """What a cache file must have been made with to be used by this chat."""
        if self._model_identity is None:
            from chatbot.conversation.kvstore import model_identity

            self._model_identity = model_identity(self.engine.model)
        template = getattr(self.tokenizer, "chat_template", None)
        return {
            "model": self._model_identity,
            "template": _digest_of(repr((template, sorted(self.text.template_kwargs.items())))),
            "system": _digest_of(self.system or ""),
            "model_dtype": str(getattr(self.engine.model, "dtype", "")),
            "backend": type(self.engine.backend).__name__,
            "window": f"{self.kv.start_size} sinks + {self.kv.recent_size}" if self.kv.is_bounded else "none",
        }


def _digest_of(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:16]
