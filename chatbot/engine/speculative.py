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
A draft is verified only when it pays (`DraftPolicy`): its expected tokens kept, from the
acceptance so far, per the time of a pass of its rows, timed in this turn against a plain
step, must beat plain decoding; lookups declined are checked against the tokens decoded after
them, so the acceptance follows the answer at no cost, and text that does not repeat its input
decodes at about plain speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import Protocol

import torch

from chatbot.engine.cache.tracked import TrackedCache
from chatbot.engine.sampling import Sampler
from chatbot.engine.stats import TurnStats

MAX_NGRAM = 3
"""The longest suffix looked up; shorter ones are tried after it, down to `MIN_NGRAM`."""
MIN_NGRAM = 2
"""A single token repeats too often by chance (a space, "the") to be worth a pass."""
PRIOR_FIXED, PRIOR_ROW = 0.6, 0.45
"""A pass of k rows is taken to cost PRIOR_FIXED + PRIOR_ROW x k plain steps until the turn
has timed one (about the default model's, docs/benchmarks.md); with one size of pass timed,
the others are PRIOR_ROW a row more or less; with two or more, on the line through them."""
MIN_GAIN = 1.05
"""A draft is verified only when its expected tokens per unit of time beat plain decoding's
by this much (the lookup and the sampler's checks cost a little too)."""
DECAY = 0.85
"""The weight the evidence so far keeps at each new observation (acceptance, timings)."""


class DraftPolicy:
    """When a draft pays, and how long it should be, from what drafts cost and how many of
    their tokens are kept.

    The cost of a verification pass of k rows, relative to a plain step, comes from the
    timings of this turn's steps and passes (`step_took`, `pass_took`; `PRIOR_FIXED` and
    `PRIOR_ROW` before any). The acceptance is the chance that a draft token is kept, taken as the same
    for each token of a draft: from the drafts verified, and from the drafts that were not
    (`shadow`: a lookup declined is checked against the tokens decoded plainly after it, at
    no cost), so drafting resumes when the answer starts repeating its input. A draft of d
    tokens then yields 1 + a + ... + a^d tokens in a pass of d + 1 rows; the best d is taken
    when that beats plain decoding by `MIN_GAIN`, else none.
    """

    def __init__(self) -> None:
        self.kept = 1.0  # decayed counts of draft tokens kept and rejected (prior: 1 and 1)
        self.lost = 1.0
        self.step_time: float | None = None  # decayed mean seconds of a plain step
        self.pass_time: dict[int, float] = {}  # rows -> decayed mean seconds of a pass

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is kept."""
        return self.kept / (self.kept + self.lost)

    def observe(self, proposed: int, kept: int) -> None:
        """A draft of `proposed` tokens whose first `kept` were (or would have been) kept."""
        for i in range(min(proposed, kept + 1)):
            self.kept, self.lost = self.kept * DECAY, self.lost * DECAY
            if i < kept:
                self.kept += 1.0
            else:
                self.lost += 1.0

    def step_took(self, seconds: float) -> None:
        """A plain step's time."""
        self.step_time = _mean(self.step_time, seconds)

    def pass_took(self, rows: int, seconds: float) -> None:
        """A verification pass of `rows` rows' time."""
        self.pass_time[rows] = _mean(self.pass_time.get(rows), seconds)

    def cost(self, rows: int) -> float:
        """A pass of `rows` rows in plain steps: as timed, else on the line through the
        passes timed (`PRIOR_FIXED`, `PRIOR_ROW`)."""
        if self.step_time is None or not self.pass_time:
            return PRIOR_FIXED + PRIOR_ROW * rows
        ratios = {k: t / self.step_time for k, t in self.pass_time.items()}
        if rows in ratios:
            return ratios[rows]
        mean_k, mean_c = sum(ratios) / len(ratios), sum(ratios.values()) / len(ratios)
        spread = sum((k - mean_k) ** 2 for k in ratios)
        slope = PRIOR_ROW
        if spread:
            slope = sum((k - mean_k) * (c - mean_c) for k, c in ratios.items()) / spread
        return max(mean_c + max(slope, 0.05) * (rows - mean_k), 1e-3)

    def drafting(self, tokens: int) -> float:
        """What guessing `tokens` tokens costs, in plain steps (a lookup: nothing)."""
        return 0.0

    def length(self, limit: int) -> int:
        """The draft length with the most tokens per unit of time, up to `limit`; 0 when no
        length beats plain decoding by `MIN_GAIN`."""
        a, best, best_gain = self.acceptance, 0, MIN_GAIN
        tokens, power = 1.0, 1.0
        for d in range(1, limit + 1):
            power *= a
            tokens += power
            gain = tokens / max(self.cost(d + 1) + self.drafting(d), 1e-9)
            if gain > best_gain:
                best, best_gain = d, gain
        return best


def _mean(old: float | None, new: float) -> float:
    return new if old is None else DECAY * old + (1.0 - DECAY) * new


class NgramDrafter:
    """Proposes the next tokens of `context` by looking its last `MAX_NGRAM`..`MIN_NGRAM`
    tokens up earlier in it (the latest earlier occurrence wins) and taking what followed,
    as many as its `policy` says pay (none when a pass would cost more than it yields).

    An index of every n-gram's latest end is kept up to date as the context grows, so a
    lookup costs a few dict reads, not a scan of the conversation.

    Args:
        context: the ids so far (history, prompt); the answer's tokens are added by `extend`.
        max_tokens: the most tokens one draft proposes (and the verification pass takes + 1).
        policy: when drafts pay and how long (default: a new `DraftPolicy`).
    """

    def __init__(self, context: Sequence[int], max_tokens: int, policy: DraftPolicy | None = None) -> None:
        self.context: list[int] = list(context)
        self.max_tokens = max(1, max_tokens)
        self.policy = policy or DraftPolicy()
        self.shadow: list[int] = []  # a lookup declined, checked against the plain tokens
        self._shadow_kept = 0
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> the latest position after it
        self._indexed = 0  # n-grams ending before this position are indexed

    def extend(self, ids: Sequence[int]) -> None:
        """The answer's next tokens join the context (a declined lookup is checked
        against them)."""
        for token in ids:
            if not self.shadow:
                break
            if token == self.shadow[self._shadow_kept]:
                self._shadow_kept += 1
                if self._shadow_kept < len(self.shadow):
                    continue
            self._close_shadow()
        self.context.extend(ids)

    def _close_shadow(self) -> None:
        if self.shadow:
            self.policy.observe(len(self.shadow), self._shadow_kept)
        self.shadow, self._shadow_kept = [], 0

    def _update_index(self) -> None:
        ctx, end = self.context, len(self.context)
        for j in range(max(self._indexed, 1), end):  # an n-gram ending at j, followed by ctx[j]
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if j >= n:
                    self._index[tuple(ctx[j - n : j])] = j
        self._indexed = end

    def lookup(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the context's last n-gram earlier in it; []
        when nothing matches."""
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

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that may follow the context, as many as the policy finds
        worth a pass; [] when nothing matches or no draft pays (the lookup is then
        checked against the tokens decoded plainly, for the acceptance)."""
        if self.shadow:  # a declined lookup still being checked: no new one yet
            return []
        found = self.lookup(min(limit, self.max_tokens))
        if not found:
            return []
        length = self.policy.length(len(found))
        if length < 1:
            self.shadow, self._shadow_kept = found, 0
            return []
        return found[:length]

    def rejected(self, proposed: int, kept: int) -> None:
        """A verified draft of `proposed` tokens kept its first `kept`."""
        self.policy.observe(proposed, kept)


class Drafter(Protocol):
    """What proposes drafts: `NgramDrafter`, `chatbot.engine.draft_model.ModelDrafter`."""

    @property
    def policy(self) -> DraftPolicy: ...
    def propose(self, limit: int) -> list[int]: ...
    def extend(self, ids: Sequence[int]) -> None: ...
    def rejected(self, proposed: int, kept: int) -> None: ...


Verify = Callable[[Sequence[int]], torch.Tensor]
"""Feed ids into the cache in one pass (it has room); the logits after each ``[n, vocab]``."""


def draft_token_steps(
    verify: Verify,
    step: Callable[[int], torch.Tensor],
    kv: TrackedCache,
    logits: torch.Tensor,
    sampler: Sampler,
    drafter: Drafter,
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
                start = time.perf_counter()
                logits = step(token)
                drafter.policy.step_took(time.perf_counter() - start)
                token = sampler(logits)
                emitted, keep = emitted + 1, len(kv.seen)
                drafter.extend((token,))
                yield token, logits
                continue
            start = time.perf_counter()
            rows = verify([token, *draft])
            drafter.policy.pass_took(len(draft) + 1, time.perf_counter() - start)
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
