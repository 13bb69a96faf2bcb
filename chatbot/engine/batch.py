"""Continuous batching of decode steps: generations running in several threads (one per
request) have their one-token steps run as one `FastDecoder.decode_batch` call, one pass over
the weights for all of them; a generation joins between two steps and leaves after its last.

The threads take turns, never run at once: each holds `DecodeBatcher.cond` (its lock) while it
works (prefill, sampling, its stop strings, a session's bookkeeping: nothing of the engine, a
session or the tokenizer need be thread-safe) and lets go of it only while it waits for a
step. The step runs when every generation in its decode loop has asked for one; the last to
ask runs it and wakes the others.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

STRAGGLER_S = 0.5
"""A step waits at most this long for a generation that joined and has not asked (one whose
consumer went away without closing it); then it runs with those that asked."""


@dataclass
class _Step:
    cache: Any
    token: int
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class DecodeBatcher:
    """Gathers the one-token steps of concurrent generations into batched steps.

    Args:
        decoder: a `FastDecoder` (its `decode_batch` and `max_batch`).
    """

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self.cond = threading.Condition(threading.Lock())
        self.max_batch = int(decoder.max_batch)
        self._pending: list[_Step] = []
        self._active = 0  # generations in their decode loop
        self._entering = 0  # threads about to take `cond` for a new generation
        self._count_lock = threading.Lock()
        self.steps = 0  # batched steps run (for /health and the tests)
        self.rows = 0  # conversation steps they held

    def arriving(self) -> None:
        """A thread is about to take `cond` to start a generation: the next step waits until
        it has (its prefill runs between two steps). Called without `cond`."""
        with self._count_lock:
            self._entering += 1

    def arrived(self) -> None:
        """The thread announced by `arriving` holds `cond` (or gave up)."""
        with self._count_lock:
            self._entering -= 1

    # The rest called with `cond` held, by the generation's own thread.
    def join(self) -> None:
        """A generation enters its decode loop: steps wait for it from now on."""
        self._active += 1

    def leave(self) -> None:
        """A generation left its decode loop (finished, stopped or cancelled)."""
        self._active -= 1
        if self._pending and len(self._pending) >= self._active and not self._entering:
            self._run()

    def step(self, cache: Any, token: int) -> torch.Tensor:
        """Feed `token` at the end of `cache` with the other generations' steps; the logits
        after it. Called with `cond` held; lets go of it while it waits."""
        request = _Step(cache, int(token))
        self._pending.append(request)
        waited = time.monotonic()
        while request.logits is None and request.error is None:
            ready = len(self._pending) >= self._active and not self._entering
            if ready or time.monotonic() - waited > STRAGGLER_S:
                self._run()
                continue
            self.cond.wait(0.05)
        if request.error is not None:
            raise request.error
        assert request.logits is not None
        return request.logits

    def _run(self) -> None:
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        try:
            logits = self.decoder.decode_batch([r.cache for r in batch], [r.token for r in batch])
        except BaseException as exc:  # noqa: BLE001 - each waiting generation raises it
            for r in batch:
                r.error = exc
        else:
            for r, row in zip(batch, logits):
                r.logits = row
            self.steps += 1
            self.rows += len(batch)
        self.cond.notify_all()
