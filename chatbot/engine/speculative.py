"""Speculative decoding by n-gram lookup (prompt lookup): no second model.

An answer that repeats its input (a summary quoting it, a rewrite, a code edit, a pasted file
read back) holds runs of tokens the conversation already has. `NgramDrafter` finds the last
few tokens of the conversation earlier in it and proposes the tokens that followed them
there; `draft_token_steps` feeds the token just chosen and the draft through the model in one
forward pass that returns the logits after each (`Backend.prefill_every`), keeps the longest
run of the draft that the model itself would have chosen, and cuts the cache back past the
first token it would not have.

Exact by construction:

- greedy: a draft token is kept while it is the argmax of the processed scores at its
  position (repetition penalty over the answer so far, the draft tokens kept before it
  included), so the answer is token for token the plain loop's (the native kernels' rows
  give its logits bit for bit);
- sampled: the proposal is deterministic (one token, probability 1), so the standard rule
  becomes: keep draft token x with probability p(x) under the processed distribution, else
  sample from p with x removed (renormalised): P(y) = p(y) either way (`Sampler.verify`).

The cache never evicts inside a verified run: a draft is cut to the room the cache has
(`TrackedCache.room`), and with no room the plain step runs, evicting as the plain loop does.
When drafts are rejected the drafter backs off (`NgramDrafter.rejected`), so text that does
not repeat its input costs little more than plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch

from chatbot.engine.cache.tracked import TrackedCache
from chatbot.engine.sampling import Sampler
from chatbot.engine.stats import TurnStats

MAX_NGRAM = 3
"""The longest suffix looked up; shorter ones are tried after it, down to `MIN_NGRAM`."""
MIN_NGRAM = 2
"""A single token repeats too often by chance (a space, "the") to be worth a pass."""
MAX_SKIP = 32
"""The most tokens decoded plainly after a run of rejected drafts before drafting again."""


class NgramDrafter:
    """Proposes the next tokens of `context` by looking its last `MAX_NGRAM`..`MIN_NGRAM`
    tokens up earlier in it (the latest earlier occurrence wins) and taking what followed.

    An index of every n-gram's latest end is kept up to date as the context grows, so a
    lookup costs a few dict reads, not a scan of the conversation.

    Args:
        context: the ids so far (history, prompt); the answer's tokens are added by `extend`.
        max_tokens: the most tokens one draft proposes (and the verification pass takes + 1).
    """

    def __init__(self, context: Sequence[int], max_tokens: int) -> None:
        self.context: list[int] = list(context)
        self.max_tokens = max(1, max_tokens)
        self.length = self.max_tokens  # the next draft's length: shrinks after rejections
        self.skip = 0  # tokens to decode plainly before the next lookup
        self.cooldown = 1  # the next skip after a fully rejected draft
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> the latest position after it
        self._indexed = 0  # n-grams ending before this position are indexed

    def extend(self, ids: Sequence[int]) -> None:
        """The answer's next tokens join the context."""
        self.context.extend(ids)

    def _update_index(self) -> None:
        ctx, end = self.context, len(self.context)
        for j in range(max(self._indexed, 1), end):  # an n-gram ending at j, followed by ctx[j]
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if j >= n:
                    self._index[tuple(ctx[j - n : j])] = j
        self._indexed = end

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens (and this drafter's current length) that may follow the
        context; [] when nothing matches or the drafter is backing off."""
        if self.skip > 0:
            self.skip -= 1
            return []
        limit = min(limit, self.length)
        if limit < 1:
            return []
        self._update_index()  # (the suffix itself ends at len(context): not yet indexed)
        ctx = self.context
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(ctx) <= n:
                continue
            start = self._index.get(tuple(ctx[-n:]))
            if start is not None:
                return ctx[start : start + limit]
        return []

    def rejected(self, proposed: int, kept: int) -> None:
        """Adapt to a verified draft: its length follows what was kept (one more than the
        run kept, doubled after a full run); a draft rejected at once pauses drafting for a
        while, longer after each one in a row."""
        if kept == proposed:
            self.length = min(self.max_tokens, max(self.length, 2 * proposed))
            self.cooldown = 1
            return
        self.length = max(1, kept + 1)
        if kept == 0:
            self.skip = self.cooldown
            self.cooldown = min(MAX_SKIP, 2 * self.cooldown)
        else:
            self.cooldown = 1


Verify = Callable[[Sequence[int]], torch.Tensor]
"""Feed ids into the cache in one pass (it has room); the logits after each ``[n, vocab]``."""


def draft_token_steps(
    verify: Verify,
    step: Callable[[int], torch.Tensor],
    kv: TrackedCache,
    logits: torch.Tensor,
    sampler: Sampler,
    drafter: NgramDrafter,
    stats: TurnStats,
    max_new_tokens: int,
) -> Generator[tuple[int, torch.Tensor], None, str]:
    """`chatbot.engine.generate.token_steps` with n-gram drafts verified in one pass each.

    Yields the same (token, logits it was chosen from) as the plain loop, and holds its
    contract: a token yielded is in the cache only once the next one is asked for, so when
    the caller stops (a stop id, a stop string, the length limit) the cache is cut back to
    hold every token before the last one yielded, and not it (a verified draft ran ahead).
    Returns "context" when a growing cache can take no more. The drafts' counts go into
    `stats` (`draft_tokens`, `draft_accepted`).
    """
    token = sampler(logits)
    emitted = 1
    keep = len(kv.seen)  # what the cache holds if the caller stops at this token
    try:
        drafter.extend((token,))
        yield token, logits
        while True:
            if kv.is_full():
                return "context"
            draft = drafter.propose(min(max_new_tokens - emitted - 1, kv.room() - 1))
            if not draft:
                logits = step(token)
                token = sampler(logits)
                emitted, keep = emitted + 1, len(kv.seen)
                drafter.extend((token,))
                yield token, logits
                continue
            rows = verify([token, *draft])
            base = len(kv.seen) - len(draft)  # the cache holding `token`, no draft token
            stats.draft_tokens += len(draft)
            kept = 0
            for i, guess in enumerate(draft):
                keep = base + i
                choice = sampler.verify(rows[i], guess)
                if choice != guess:
                    kv.crop_to(keep)
                    break
                kept += 1
                emitted += 1
                drafter.extend((guess,))
                yield guess, rows[i]
            else:
                keep = len(kv.seen)
                choice = sampler(rows[-1])
            stats.draft_accepted += kept
            drafter.rejected(len(draft), kept)
            token = choice
            emitted += 1
            drafter.extend((token,))
            yield token, rows[kept]
    finally:
        if len(kv.seen) > keep:  # stopped inside a verified run: its tail leaves the cache
            kv.crop_to(keep)
