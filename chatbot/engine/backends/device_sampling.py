"""Decode with the next token chosen on the device and read one step late (`--opt compile`).

The host loop of `chatbot.engine.generate` reads every token back before it feeds it: on a GPU
each read waits for the step to finish, so the device idles while the host detokenizes,
renders and launches the next step. Here, as gpt-fast and vLLM do it:

- `choose_token` picks the next token from the logits with tensor operations only (no
  ``nonzero``, no ``.item()``): the repetition penalty over the ids whose last place is inside
  its window (a ``[vocab]`` buffer of places), temperature, top-k (``topk`` over the
  vocabulary, a static k) and top-p (a cumulative sum over those k, or over the sorted
  vocabulary without top-k), then a draw. It writes the token into the step's input buffer and
  records its place, and returns ``[token, not finite]``. The backend compiles it as one graph
  (`CompiledBackend.choose`).
- The draw is ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn from the turn's generator, which
  is how ``torch.multinomial`` draws one sample, so a seed gives the host loop's answer
  (without the check that makes multinomial read the device).
- `device_token_steps` launches step t+1 (which feeds token t from the input buffer) before it
  reads token t back (a non-blocking copy into pinned memory and an event on CUDA). A stop, the
  length limit or Ctrl-C at that token takes the step back (`TrackedCache.cut_unrecorded`). A
  step that must evict first runs after its token is read, so that a stop never evicts.

Only `chatbot.engine.generate` calls this, for a plain turn (stop strings included): a grammar,
transformers' processors or stopping criteria, or a logprobs observer need the host loop,
which stays.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Sequence
from typing import Any, Protocol

import torch

from chatbot.config import SamplingConfig
from chatbot.engine.cache.tracked import TrackedCache
from chatbot.engine.finite import nonfinite_message
from chatbot.errors import NonFiniteOutputError


def choose_token(
    logits: torch.Tensor,
    last: torch.Tensor,
    window: torch.Tensor,
    params: torch.Tensor,
    noise: torch.Tensor,
    next_ids: torch.Tensor,
    greedy: bool,
    top_k: int,
    nucleus: bool,
) -> torch.Tensor:
    """The next token after `logits` (``[vocab]``), as transformers' processors and
    `torch.multinomial` choose it, in tensor operations only.

    Args:
        logits: the raw logits.
        last: ``[vocab]`` long, where each id last stood in the sequence (-1: nowhere; the
            template's special ids stay -1); the token's entry is set to its place.
        window: ``[2]`` long: the place the token takes (the sequence's length; advanced by one)
            and the repetition penalty's window in tokens (0: none; a huge one: the whole
            sequence). An id is penalised where it last stood inside the window.
        params: ``[3]`` float32: the repetition penalty, the temperature, ``1 - top_p``.
        noise: ``[vocab]`` float32 draws of Exp(1) (unused when greedy).
        next_ids: ``[1, 1]`` long, the next step's input: the token is written there.
        greedy: argmax instead of a draw.
        top_k: keep the k highest scores (0: all); ties at the k-th are kept.
        nucleus: apply top-p (``params[2]``).

    Returns:
        ``[2]`` long: the token, and 1 where the logits hold NaN or infinity (a damaged model).
    """
    raw = logits.float()
    penalty = params[0]
    place, size = window[0], window[1]
    seen = (last >= 0) & (last >= place - size)
    scores = torch.where(seen, torch.where(raw < 0, raw * penalty, raw / penalty), raw)
    if greedy:
        token = scores.argmax(-1, keepdim=True)
    else:
        scores = scores / params[1]
        floor = None
        if top_k > 0:
            candidates = torch.topk(scores, min(top_k, scores.shape[-1])).values.flip(0)
            floor = candidates[:1]
        elif nucleus:
            candidates = torch.sort(scores).values
        if nucleus:
            # transformers' TopPLogitsWarper on the ascending candidates: drop those whose
            # cumulative probability is at most 1 - p, always keeping the highest
            cumulative = candidates.softmax(-1).cumsum(-1)
            keep = cumulative > params[2]
            keep = torch.cat([keep[:-1], keep.new_ones(1)])
            floor = torch.where(keep, candidates, float("inf")).amin(-1, keepdim=True)
        if floor is not None:
            scores = scores.masked_fill(scores < floor, float("-inf"))
        token = (scores.softmax(-1) / noise).argmax(-1, keepdim=True)
    bad = ~torch.isfinite(raw).all()
    # a special id keeps -1 (never penalised); any other takes the token's place
    keep = last.index_select(0, token)
    last.index_copy_(0, token, torch.where(keep < -1, keep, place.view(1)))
    window[0] += 1
    next_ids.copy_(token.view(1, 1))
    return torch.cat([token, bad.view(1).long()])


class TokenReader:
    """Reads a ``[2]`` result back: on CUDA a non-blocking copy into pinned memory and an
    event, so that the host can queue more work before it waits; elsewhere a plain copy."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(2, dtype=torch.long, pin_memory=self.cuda)
        self.event: Any = torch.cuda.Event() if self.cuda else None

    def post(self, result: torch.Tensor) -> None:
        """Queue the copy of `result` (the device may still be computing it)."""
        self.host.copy_(result, non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def take(self) -> tuple[int, bool]:
        """Wait for the posted copy; the token and whether its logits were not finite."""
        if self.event is not None:
            self.event.synchronize()
        token, bad = self.host.tolist()
        return int(token), bool(bad)


class DeviceSampler:
    """A turn's sampling state on the device, in buffers that keep their addresses from turn
    to turn (a CUDA graph replays on them): where each id last stood (the repetition penalty's
    window), the parameters, the noise and the next step's input. One turn at a time (the
    backend lends it under a lock).

    It stands in for `chatbot.engine.sampling.Sampler` in `stream_chunks`: `accept` records
    the answer's ids on the host (for stop strings), and there are no host-side scores or
    constraint.
    """

    scores = None
    complete = False

    def __init__(self, device: torch.device, mark_static: bool = False) -> None:
        self.device = device
        self.mark_static = mark_static
        self.params = torch.ones(3, dtype=torch.float32, device=device)
        self.next_ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.last = torch.zeros(0, dtype=torch.long, device=device)
        self.window = torch.zeros(2, dtype=torch.long, device=device)
        self.noise = torch.ones(0, dtype=torch.float32, device=device)
        self.reader = TokenReader(device)
        self.generator: torch.Generator | None = None
        self._before: torch.Tensor | None = None
        self.greedy, self.top_k, self.nucleus = True, 0, False
        self.history = torch.zeros((1, 0), dtype=torch.long)
        self.n_history = 0
        self.model: Any = None
        if mark_static:
            for buffer in (self.params, self.next_ids, self.window):
                torch._dynamo.mark_static_address(buffer)

    def begin(
        self,
        sampling: SamplingConfig,
        context: Sequence[int],
        vocab: int,
        generator: torch.Generator | None,
        model: Any = None,
        special: Collection[int] = (),
    ) -> None:
        """Set up a turn: `context` holds the ids before the answer. The repetition penalty
        covers the ids among the last `sampling.repeat_last_n` of the sequence (context and
        answer so far, as the host loop's `WindowedRepetitionPenalty`), never the `special` ids."""
        if self.last.shape[0] != vocab:
            self.last = torch.zeros(vocab, dtype=torch.long, device=self.device)
            self.noise = torch.ones(vocab, dtype=torch.float32, device=self.device)
            if self.mark_static:
                torch._dynamo.mark_static_address(self.last)
                torch._dynamo.mark_static_address(self.noise)
        # -1: not seen; -2: special, never penalised (choose_token leaves entries below -1)
        places = torch.full((vocab,), -1, dtype=torch.long)
        for place, i in enumerate(context):
            if 0 <= i < vocab:
                places[i] = place
        specials = [i for i in special if 0 <= i < vocab]
        if specials:
            places[torch.tensor(specials, dtype=torch.long)] = -2
        self.last.copy_(places.to(self.device), non_blocking=True)
        last_n = sampling.repeat_last_n if sampling.repetition_penalty != 1.0 else 0
        size = 1 << 62 if last_n < 0 else last_n
        self.window.copy_(torch.tensor([len(context), size], dtype=torch.long), non_blocking=True)
        greedy = sampling.greedy
        temperature = 1.0 if greedy else sampling.temperature
        values = [sampling.repetition_penalty, temperature, 1.0 - sampling.top_p]
        self.params.copy_(torch.tensor(values, dtype=torch.float32), non_blocking=True)
        self.greedy = greedy
        self.top_k = sampling.top_k if not greedy else 0
        self.nucleus = not greedy and sampling.top_p < 1.0
        self.generator = generator
        self.history = torch.empty((1, len(context) + sampling.max_new_tokens), dtype=torch.long)
        self.history[0, : len(context)] = torch.tensor(list(context), dtype=torch.long)
        self.n_history = len(context)
        self.model = model

    def draw(self) -> None:
        """The Exp(1) noise of the next draw, from the turn's generator (as multinomial)."""
        if not self.greedy:
            if self.generator is not None:
                self._before = self.generator.get_state()  # host-side state: no device read
            self.noise.exponential_(1, generator=self.generator)

    def undo_draw(self) -> None:
        """Put the generator back to before the last draw (a step taken back), so that a seed
        gives the same draws as the host loop in the turns after."""
        if not self.greedy and self.generator is not None and self._before is not None:
            self.generator.set_state(self._before)

    def accept(self, token: int) -> None:
        self.history[0, self.n_history] = token
        self.n_history += 1

    @property
    def context(self) -> torch.Tensor:
        """The ids so far on the host, answer tokens accepted included (``[1, n]``; a stop
        string's criterion reads them)."""
        return self.history[:, : self.n_history]


class DeviceBackend(Protocol):
    """What `device_token_steps` needs of a backend (`CompiledBackend`)."""

    def choose(self, logits: torch.Tensor, sampler: DeviceSampler) -> torch.Tensor: ...

    def launch(self, cache: Any, ids: torch.Tensor) -> torch.Tensor: ...


def device_token_steps(
    backend: DeviceBackend, kv: TrackedCache, logits: torch.Tensor, sampler: DeviceSampler
) -> Generator[tuple[int, torch.Tensor], None, str]:
    """`chatbot.engine.generate.token_steps` with the tokens chosen on the device and each read
    back after the step that feeds it has been launched.

    Yields (token, logits) as `token_steps` does, but the logits are those of the step after
    the token (its own were used on the device); the caller's loop reads only the tokens. A
    token is recorded in `kv` when the caller asks for the next one; a step launched ahead for a
    token the caller ends on is cut from the cache.
    """
    reader = sampler.reader

    def chosen(logits: torch.Tensor) -> torch.Tensor:
        sampler.draw()
        return backend.choose(logits, sampler)

    reader.post(chosen(logits))
    pending = False  # a step and a draw made for a token not yet recorded
    try:
        while True:
            ahead = not kv.is_full() and not kv.would_evict(1)
            if ahead:  # feed token t while it is read back
                logits = backend.launch(kv.cache, sampler.next_ids)
                result = chosen(logits)
                pending = True
            token, bad = reader.take()
            if bad:
                raise NonFiniteOutputError(nonfinite_message(sampler.model))
            yield token, logits
            if not ahead:
                if kv.is_full():
                    return "context"
                kv.evict_for(1)
                logits = backend.launch(kv.cache, sampler.next_ids)
                result = chosen(logits)
            kv.feed((token,))
            pending = False
            reader.post(result)
    finally:
        kv.cut_unrecorded()  # a step launched ahead, or torn by Ctrl-C
        if pending:
            sampler.undo_draw()
