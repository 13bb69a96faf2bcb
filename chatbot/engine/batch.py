"""Continuous batching of decode steps: generations running in several threads (one per
request) have their one-token steps run as one `Backend.step_batch` call, one pass over
the weights for all of them; a generation joins between two steps and leaves after its last.

The threads take turns: each holds `DecodeBatcher.cond` (its lock) while it works (sampling,
its stop strings, a session's bookkeeping: nothing of a session or the tokenizer need be
thread-safe) and lets go of it only while it waits for a step, and while it prefills a new
generation's prompt (`prefilling`): that runs beside the others' steps, one prefill at a time,
on a cache no other thread touches (the model's forward pass and the decoder's batched calls,
each with scratch of its own, are safe to run at once). The step runs when every generation in
its decode loop has asked for one; the last to ask runs it and wakes the others.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from chatbot.engine.backends.native.threads import capped_threads

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
        backend: a `chatbot.engine.backends.base.Backend` (its `step_batch` and `max_batch`).
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.cond = threading.Condition(threading.Lock())
        self.max_batch = int(backend.max_batch)
        self._pending: list[_Step] = []
        self._active = 0  # generations in their decode loop
        self._entering = 0  # threads about to take `cond` for a new generation
        self._count_lock = threading.Lock()
        self._prefill_lock = threading.Lock()  # one prefill at a time beside the steps
        self._prefill_running = False
        self.steps = 0  # batched steps run (for /health and the tests)
        self.rows = 0  # conversation steps they held
        self.overlapped = 0  # steps run while a prefill ran beside them (for the tests)

    @contextmanager
    def prefilling(self) -> Iterator[None]:
        """Around a new generation's prefill, entered with `cond` held: `cond` is let go
        while the prefill runs (one prefill at a time), so the generations already decoding go
        on stepping meanwhile, and taken again, as by a thread `arriving`, when it ends. While
        it runs, the steps take one thread, and so do the prefill's products while generations
        are decoding: each keeps a core. Entered without `cond` held, it does nothing.

        Why: a prefill run between two steps, holding `cond`, would stall every stream for
        its length (docs/benchmarks.md has figures). (`cond._is_owned` tells whether `cond`
        is held, not by whom: the server's threads hold it whenever they reach here.)
        """
        owned = getattr(self.cond, "_is_owned", lambda: False)()
        if not owned:
            yield
            return
        self.cond.release()
        try:
            with self._prefill_lock, capped_threads(lambda: 1 if self._active > 0 else None):
                self._prefill_running = True
                try:
                    yield
                finally:
                    self._prefill_running = False
        finally:
            # back as a thread arriving: the next step waits for this generation (else the
            # one decoding, never waiting, would keep `cond` to the end of its answer)
            self.arriving()
            self.cond.acquire()
            self.arrived()

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
        beside = self._prefill_running  # a prefill has the other core
        try:
            logits = self.backend.step_batch(
                [r.cache for r in batch], [r.token for r in batch], threads=1 if beside else None
            )
        except BaseException as exc:  # noqa: BLE001 - each waiting generation raises it
            for r in batch:
                r.error = exc
        else:
            for r, row in zip(batch, logits):
                r.logits = row
            self.steps += 1
            self.rows += len(batch)
            self.overlapped += beside
        self.cond.notify_all()
