"""Conversation caches as a prefix cache: the server-side form of the persistent cache.

Each entry is a `ChatSession` (its messages, token ids and KV cache). A request whose
messages extend an entry's conversation continues that session, so only the new tokens are
prefilled; one that shares the start of a conversation but differs later (a retry, an edit)
takes that entry over, its cache cropped to the tokens they share (not re-encoded). A new
conversation takes the keys and values of the longest start it shares with a kept one (the
template's opening and system prompt, most often) as a copy, and prefills only the rest
(`share_prefix`). A bounded number of entries is kept, and a memory cap; the least recently
used go first. A `cache_salt` (as in vLLM) keeps requests apart: only entries made with the
same salt are reused, so a fresh salt per request turns the cache off for it.

Not thread-safe: one worker thread owns the pool and the engine.
"""

from __future__ import annotations

import hashlib
import itertools
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.kvstore import SUFFIX, KVStore
from chatbot.conversation.saved import Turn
from chatbot.conversation.session import ChatSession, sampling_from_model
from chatbot.engine.cache.buffers import BufferLayer
from chatbot.engine.cache.tracked import TrackedCache
from chatbot.engine.generate import Engine
from chatbot.engine.seq import common_prefix
from chatbot.models.templates import TemplateInfo


@dataclass
class Conversation:
    """A request's conversation: the system prompt, the finished exchanges before the last
    message, and the last user message (or, with `continue_answer`, the answer to go on)."""

    system: str | None
    turns: list[tuple[str, str]]
    user: str
    partial_answer: str | None = None  # continue this assistant message instead of answering
    salt: str | None = None


@dataclass
class Entry:
    key: int
    session: ChatSession
    salt: str | None
    fresh: bool = True  # made for this request, never kept: a refused request drops it


@dataclass
class PoolStats:
    """Counters for /health and the tests."""

    hits: int = 0  # requests that continued or took over a kept conversation
    misses: int = 0
    shared: int = 0  # new conversations that took a kept one's start (`share_prefix`)
    shared_tokens: int = 0
    evictions: int = 0
    disk: int = 0  # new conversations that took their start from a file of `cache_dir`
    disk_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def server_sampling(model: Any, preset: dict[str, Any] | None = None, **overrides: Any) -> SamplingConfig:
    """A server's default settings, as `chatbot run` has them: the built-in ones, then the
    model's generation_config, then the preset's sampling, then the flags given. A request
    that leaves its settings out gets these (see `protocol.sampling_of`).

    Raises:
        ConfigError: a preset value or an override is out of range.
    """
    values = {k: v for k, v in (preset or {}).items() if v is not None}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return sampling_from_model(model, **values)


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token takes in a KV cache of this model (keys and values, every layer)."""
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = getattr(cfg, "num_attention_heads", 1) or 1
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    element = model.get_input_embeddings().weight.element_size()
    return int(2 * layers * kv_heads * head_dim * max(element, 2))


class PrefixCachePool:
    """Keeps up to `max_entries` conversations (and at most `max_bytes` of KV cache).

    Args:
        engine: the model runner every session uses.
        engine_config: chunking and the streaming (sink) cache of each session.
        sampling: the default settings of new sessions.
        max_entries: conversations kept between requests; 0 turns the prefix cache off.
        max_bytes: cap on the KV bytes kept (estimated from the tokens each cache holds).
        cache_dir: a folder where every conversation's cache is also written (after each
            answer, as a chat's disk cache): a new conversation, after a restart too, takes
            the longest start of it a file there holds (`share_prefix`). None: memory only.
        disk_bytes: the folder's size cap (the files written longest ago go first).
    """

    def __init__(
        self,
        engine: Engine,
        engine_config: EngineConfig,
        sampling: SamplingConfig,
        max_entries: int = 8,
        max_bytes: int = 2 << 30,
        template: TemplateInfo | None = None,
        cache_dir: Path | None = None,
        disk_bytes: int | None = None,
    ) -> None:
        self.engine = engine
        self.cache_dir = cache_dir
        self.disk_bytes = disk_bytes
        self._files: dict[Path, list[int]] | None = None  # cache_dir's files -> their ids (read once)
        self.template = template
        self.engine_config = engine_config
        self.sampling = sampling
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes_per_token = kv_bytes_per_token(engine.model)
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.stats = PoolStats()
        self._keys = itertools.count()

    # -- figures ------------------------------------------------------------------------

    def entry_bytes(self, entry: Entry) -> int:
        """The KV bytes a kept conversation takes: its tokens', or on the fast path the
        buffers' it holds, when more (they are sized ahead, for an answer and for growth)."""
        held = len(entry.session.cache_ids) * self.bytes_per_token
        layers = entry.session.kv.cache.layers
        allocated = sum(layer.nbytes for layer in layers if isinstance(layer, BufferLayer))
        return max(held, allocated)

    @property
    def kept_bytes(self) -> int:
        return sum(self.entry_bytes(e) for e in list(self.entries.values()))

    def describe(self) -> dict[str, Any]:
        return {
            "enabled": self.max_entries > 0,
            "conversations": len(self.entries),
            "max_conversations": self.max_entries,
            "kept_tokens": sum(len(e.session.cache_ids) for e in list(self.entries.values())),
            "kept_bytes_estimate": self.kept_bytes,
            "max_bytes": self.max_bytes,
            "hits": self.stats.hits,
            "misses": self.stats.misses,
            "shared_starts": self.stats.shared,
            "shared_start_tokens": self.stats.shared_tokens,
            "evictions": self.stats.evictions,
            "disk": None
            if self.cache_dir is None
            else {
                "folder": str(self.cache_dir),
                "files": len(self._disk_files()),
                "max_bytes": self.disk_bytes,
                "starts_taken": self.stats.disk,
                "tokens_taken": self.stats.disk_tokens,
            },
        }

    # -- check out and in -----------------------------------------------------------------

    def checkout(self, conv: Conversation) -> Entry:
        """A session that holds `conv`'s history (system prompt and turns): a kept one that
        shares the most of it, cut back to what it shares, or a new one.

        The entry leaves the pool until `checkin` (or `discard`).
        """
        best: tuple[int, int, int] | None = None  # (extends, shared turns, key)
        for key, entry in self.entries.items():
            s = entry.session
            if entry.salt != conv.salt or s.system != conv.system:
                continue
            shared = _shared_turns(s.turns, conv)
            extends = shared == len(s.turns)
            # A partial match must share a turn or the first message; else it is another
            # conversation with the same system prompt, whose cache we leave alone.
            first_user = conv.turns[0][0] if conv.turns else conv.user
            if not extends and shared == 0 and not (s.turns and s.turns[0].user == first_user):
                continue
            rank = (int(extends), shared, key)
            if best is None or rank[:2] > best[:2]:
                best = rank
        if best is None:
            self.stats.misses += 1
            return self._new_entry(conv)
        entry = self.entries.pop(best[2])
        self.stats.hits += 1
        self._position(entry.session, conv, best[1])
        return entry

    def checkin(self, entry: Entry) -> None:
        """Keep the entry as the most recently used; evict beyond the limits."""
        if self.max_entries <= 0:
            return
        entry.fresh = False
        store = entry.session.kv_store
        if store is not None:  # its file holds (or will, once written) what the cache took in
            self._disk_files()[store.path] = list(entry.session.kv.seen)
        self.entries[entry.key] = entry
        self.entries.move_to_end(entry.key)
        while len(self.entries) > self.max_entries or (
            len(self.entries) > 1 and self.kept_bytes > self.max_bytes
        ):
            _, old = self.entries.popitem(last=False)
            old.session.reset()
            self.stats.evictions += 1
        if self.entries and self.kept_bytes > self.max_bytes:  # one conversation over the cap
            _, old = self.entries.popitem(last=False)
            old.session.reset()
            self.stats.evictions += 1

    def add_start(self, path: Path, ids: list[int]) -> None:
        """Make the cache file `path` (holding `ids`) a start new conversations may take."""
        self._disk_files()[path] = list(ids)

    def drop(self, entry: Entry) -> None:
        """Forget a kept conversation (its cache emptied)."""
        self.entries.pop(entry.key, None)
        entry.session.reset()

    def discard(self, entry: Entry) -> None:
        """Drop an entry whose state is in doubt (an unexpected error)."""
        entry.session.reset()

    def clear(self) -> None:
        for entry in self.entries.values():
            entry.session.reset()
        self.entries.clear()

    # -- helpers ----------------------------------------------------------------------------

    def _new_entry(self, conv: Conversation) -> Entry:
        config = ChatConfig(system=conv.system, sampling=self.sampling, engine=self.engine_config)
        session = ChatSession(self.engine, config, self.template)
        if conv.turns:
            _restore(session, conv)
        if self.max_entries > 0:
            salt = conv.salt
            if self.cache_dir is not None:
                session.keep_cache_in(
                    KVStore(
                        self.cache_dir / f"{uuid.uuid4().hex}{SUFFIX}",
                        conversation_identity(session, salt),
                        self.disk_bytes,
                    )
                )
            session.prefix_donor = lambda kv, ids: self.share_prefix(kv, ids, salt, session)
        return Entry(next(self._keys), session, conv.salt)

    def share_prefix(
        self, kv: TrackedCache, ids: list[int], salt: str | None, session: ChatSession | None = None
    ) -> int:
        """Fill the empty cache `kv` with the keys and values of the longest start of `ids`
        a kept conversation (made with the same salt) holds, copied, or a file of `cache_dir`
        (made by `session`'s model, template, system prompt and salt), read; returns how many
        ids that is (0: none shares `MIN_SHARED` ids, or the caches cannot be copied)."""
        best: Entry | None = None
        most = MIN_SHARED - 1
        for entry in self.entries.values():
            held = entry.session.kv
            if entry.salt != salt or held.is_bounded or held.evicted_total:
                continue
            n = common_prefix(held.ids, ids)
            if n > most:
                best, most = entry, n
        if session is not None and self._disk_files():
            taken = self._from_disk(kv, ids, most, conversation_identity(session, salt))
            if taken:
                return taken
        if best is None or not self.engine.copy_prefix(best.session.kv, kv, most):
            return 0
        self.stats.shared += 1
        self.stats.shared_tokens += most
        return most

    def _disk_files(self) -> dict[Path, list[int]]:
        """`cache_dir`'s cache files and the ids each holds (their headers, read at first use;
        then kept up to date as conversations are checked in)."""
        if self._files is None:
            self._files = {}
            if self.cache_dir is not None and self.cache_dir.is_dir():
                for path in sorted(self.cache_dir.glob("*" + SUFFIX)):
                    ids = KVStore(path, dict).held_ids()
                    if ids:
                        self._files[path] = ids
        return self._files

    def _from_disk(self, kv: TrackedCache, ids: list[int], more_than: int, identity: Any) -> int:
        """Fill `kv` from the file of `cache_dir` that holds the longest start of `ids`, if
        longer than `more_than`; how many ids it took (0: none, or none could be read)."""
        files = self._disk_files()
        ranked = sorted(((common_prefix(held, ids), str(path)) for path, held in files.items()), reverse=True)
        for n, name in ranked[:4]:  # a file of another model or salt is refused: try the next
            if n <= more_than:
                break
            taken, _ = KVStore(Path(name), identity).load(kv, ids, self.engine.device)
            if taken:
                self.stats.disk += 1
                self.stats.disk_tokens += taken
                return taken
            if not Path(name).is_file():
                files.pop(Path(name), None)  # removed under the folder's cap
        return 0

    def _position(self, session: ChatSession, conv: Conversation, shared: int) -> None:
        """Make the session hold the request's finished turns, keeping what its cache shares.

        A growing cache keeps the longest token prefix it shares with the request's
        conversation (`restore` crops it there: a retry keeps everything up to the answer it
        replaces). A bounded (sink) cache cannot be cropped into what it evicted: its turns
        are undone one by one instead, which cuts it back when nothing was evicted since.
        """
        if shared == len(session.turns) == len(conv.turns):
            return
        if session.kv.is_bounded:
            while len(session.turns) > shared:
                session.undo()
            if len(conv.turns) == shared:
                return
        _restore(session, conv)


MIN_SHARED = 8
"""Fewest leading ids a new conversation takes from a kept one (fewer are not worth a copy)."""


def _shared_turns(turns: list[Turn], conv: Conversation) -> int:
    n = 0
    for have, (user, answer) in zip(turns, conv.turns):
        if have.user != user or have.answer != answer:
            break
        n += 1
    return n


def conversation_identity(session: ChatSession, salt: str | None) -> Any:
    """What a conversation's file of `cache_dir` is made with: the chat's identity (model,
    template, system prompt, dtype, backend, window) and the request's `cache_salt`."""
    digest = hashlib.sha256((salt or "").encode("utf-8", errors="surrogatepass")).hexdigest()[:16]
    return lambda: {**session.kv_identity(), "salt": digest}


def _restore(session: ChatSession, conv: Conversation) -> None:
    data = {
        "system": conv.system,
        "turns": [{"user": u, "answer": a} for u, a in conv.turns],
        "settings": session.sampling.as_dict(),
    }
    session.restore(data, encode=False)
