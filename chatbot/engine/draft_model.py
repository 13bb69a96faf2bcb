"""Speculative decoding with a draft model: a small model of the target's vocabulary guesses
the next tokens on its own cache, and the target checks them in one pass
(`chatbot.engine.speculative.draft_token_steps`, which n-gram drafts share).

Exact by construction as the n-gram drafts are: the draft model's guess is its greedy choice
on the raw logits, a proposal with probability 1, so the target keeps or replaces each token by
the same rule (`Sampler.verify`), and the answer is the one plain decoding gives (greedy: token
for token). What the draft model guesses decides only how fast.

Its cost is counted: a draft of d tokens costs d steps of the draft model besides the target's
pass (`ModelDraftPolicy`), timed in the turn, so a draft model too slow or too often wrong
stops drafting. While it does not draft it is not run at all, except for a one-token probe now
and then (its interval doubling after each miss), which keeps the acceptance up to date at a
small cost: at most the last `PROBE_TAIL` tokens in one pass, then one step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from chatbot.engine.cache.tracked import TrackedCache
from chatbot.engine.speculative import DECAY, DraftPolicy


class Engine(Protocol):
    """What the draft model runs on: `chatbot.engine.generate.Engine`'s methods it uses."""

    @property
    def tokenizer(self) -> Any: ...

    def new_cache(self, start_size: int | None = None, recent_size: int | None = None) -> TrackedCache: ...
    def prefill(self, kv: TrackedCache, ids: Sequence[int]) -> torch.Tensor: ...
    def step(self, kv: TrackedCache, token: int) -> torch.Tensor: ...
    def refill_window(self, kv: TrackedCache, ids: Sequence[int]) -> None: ...


PROBE_FIRST, PROBE_MOST = 16, 256
"""Tokens decoded plainly between two probes of a draft model that does not pay: the first
interval, doubled after each probe whose guess was wrong, up to the most."""
PROBE_TAIL = 64
"""A probe's guess is made from at most this many of the last ids the draft's cache lacks
(the rest are not fed), so that probing costs a bounded share of the plain steps between."""
PRIOR_DRAFT = 0.2
"""A draft model's step in target steps until one is timed (a model ~5x smaller)."""


class VocabularyMismatch(ValueError):
    """The draft model's tokenizer is not the target's: its guesses would be other tokens."""


def check_vocabulary(target: Any, draft: Any) -> None:
    """Refuse a draft tokenizer that maps any token to another id than the target's.

    Raises:
        VocabularyMismatch: naming the first difference.
    """
    have, other = target.get_vocab(), draft.get_vocab()
    if have == other:
        return
    if len(have) != len(other):
        raise VocabularyMismatch(f"the draft model has {len(other):,} tokens, the model {len(have):,}")
    token = next(t for t in sorted(have) if other.get(t) != have[t])
    raise VocabularyMismatch(f"the draft model's token {token!r} has another id than the model's")


class DraftModel:
    """A draft model loaded beside the target: its engine and one cache kept across turns
    (a new turn feeds only what its cache lacks, as the target's does).

    Args:
        engine: the draft model's engine (its own backend).
        name: how notes and /model call it.
    """

    def __init__(self, engine: Engine, name: str = "draft model") -> None:
        self.engine = engine
        self.name = name
        self.kv: TrackedCache | None = None
        self._logits: torch.Tensor | None = None  # after the cache's ids, while they stand
        self.policy_state: ModelDraftPolicy | None = None

    def _cache_like(self, target: TrackedCache) -> TrackedCache:
        """The draft's cache, bounded as the target's is (a chat that runs forever)."""
        bound = (target.start_size, target.recent_size) if target.is_bounded else None
        kv = self.kv
        if kv is None or bound != ((kv.start_size, kv.recent_size) if kv.is_bounded else None):
            kv = self.kv = self.engine.new_cache(*(bound or (None, None)))
            self._logits = None
        return kv

    def sync(
        self, target: TrackedCache, context: Sequence[int], ahead: int = 1, tail: int | None = None
    ) -> torch.Tensor | None:
        """Bring the draft's cache to have taken in `context`; the logits after it, or None
        where the draft model has no room for it and `ahead` more tokens. With `tail`, where
        the cache lacks more than that many of its ids, it takes only the last `tail` (a
        probe's guess needs no more, and its cost stays bounded however long it waited)."""
        kv = self._cache_like(target)
        common = kv.common_prefix(context)
        if tail is not None and len(context) - common > tail:
            kv.reset()
            context, common, self._logits = context[-tail:], 0, None
        if not kv.is_bounded and len(context) + ahead >= kv.max_context:
            return None
        if common == len(context) == len(kv.seen) and self._logits is not None:
            return self._logits
        if not kv.crop_to(min(common, len(context) - 1)):
            self.engine.refill_window(kv, context)
        self._logits = self.engine.prefill(kv, list(context[len(kv.seen) :]))
        return self._logits

    @torch.inference_mode()
    def guess(
        self, target: TrackedCache, context: Sequence[int], n: int, vocab: int, tail: int | None = None
    ) -> list[int]:
        """The draft model's greedy next `n` tokens after `context` (ids below `vocab`, the
        target's logits' width), from its last `tail` ids where the cache lacks more (see
        `sync`); [] where it has no room."""
        logits = self.sync(target, context, n, tail)
        if logits is None:
            return []
        kv, out = self.kv, []
        assert kv is not None
        for i in range(n):
            token = int(logits[..., :vocab].float().argmax())
            out.append(token)
            if i + 1 < n:
                logits = self.engine.step(kv, token)
        self._logits = None if n > 1 else self._logits
        return out


class ModelDraftPolicy(DraftPolicy):
    """`DraftPolicy` with the draft model's own steps counted in each draft's cost."""

    def __init__(self) -> None:
        super().__init__()
        self.draft_time: float | None = None  # decayed mean seconds of a draft model's token

    def drafted(self, tokens: int, seconds: float) -> None:
        """A draft of `tokens` tokens took `seconds` of the draft model."""
        if tokens:
            each, old = seconds / tokens, self.draft_time
            self.draft_time = each if old is None else DECAY * old + (1.0 - DECAY) * each

    def drafting(self, tokens: int) -> float:
        if self.draft_time is None or self.step_time is None:
            return PRIOR_DRAFT * tokens
        return tokens * self.draft_time / self.step_time


class ModelDrafter:
    """`NgramDrafter`'s interface (`propose`, `extend`, `rejected`, `policy`) over a draft
    model: proposes its greedy guesses, as many as its policy finds worth a pass.

    Args:
        draft: the loaded draft model.
        kv: the target's cache (the draft's is bounded as it is).
        context: the ids so far; the answer's tokens are added by `extend`.
        max_tokens: the most tokens one draft proposes.
        vocab: the target's logits' width.
    """

    def __init__(
        self, draft: DraftModel, kv: TrackedCache, context: Sequence[int], max_tokens: int, vocab: int
    ) -> None:
        self.draft = draft
        self.kv = kv
        self.context: list[int] = list(context)
        self.max_tokens = max(1, max_tokens)
        self.vocab = vocab
        if draft.policy_state is None:  # what the draft model costs carries over turns
            draft.policy_state = ModelDraftPolicy()
        self.policy: ModelDraftPolicy = draft.policy_state
        self.shadow: list[int] = []  # a probe's guess, checked against the next plain token
        self._interval = PROBE_FIRST
        self._since_probe = 0

    def extend(self, ids: Sequence[int]) -> None:
        """The answer's next tokens join the context (a probe is checked against them)."""
        if self.shadow and ids:
            hit = ids[0] == self.shadow[0]
            self.policy.observe(1, int(hit))
            self._interval = PROBE_FIRST if hit else min(2 * self._interval, PROBE_MOST)
            self.shadow = []
        self._since_probe += len(ids)
        self.context.extend(ids)

    def _guess(self, n: int) -> list[int]:
        start = time.perf_counter()
        found = self.draft.guess(self.kv, self.context, n, self.vocab)
        self.policy.drafted(len(found), time.perf_counter() - start)
        return found

    def _probe(self) -> list[int]:
        return self.draft.guess(self.kv, self.context, 1, self.vocab, tail=PROBE_TAIL)

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` guessed tokens, as many as pay; [] when none does (then, now and
        then, one guess is made and checked against the plain token, for the acceptance)."""
        limit = min(limit, self.max_tokens)
        if limit < 1 or self.shadow:
            return []
        length = self.policy.length(limit)
        if length >= 1:
            self._since_probe = 0
            return self._guess(length)
        if self._since_probe >= self._interval:
            self._since_probe = 0
            self.shadow = self._probe()
        return []

    def rejected(self, proposed: int, kept: int) -> None:
        """A verified draft of `proposed` tokens kept its first `kept`."""
        self.policy.observe(proposed, kept)
