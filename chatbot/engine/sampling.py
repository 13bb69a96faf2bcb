"""Choosing answer tokens: the `Sampler`, its processors, and the sampling defaults a model
ships (`sampling_from_model`).

The processors are our own, each computing what transformers' processor of the same role
computes (tests/test_sampling.py compares them on random logits), so that a turn on the
native backend never imports transformers (`import transformers` alone is ~1 s of a one-shot;
docs/benchmarks.md). Top-k then top-p sorts only the k candidates left after top-k, where
transformers' `TopPLogitsWarper` sorts the whole vocabulary at every step (49,152 entries for
SmolLM2; docs/benchmarks.md has figures).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any, Protocol, cast

import torch

from chatbot.config import SamplingConfig
from chatbot.engine.finite import checked_token, sampled_token
from chatbot.settings import layer


class LogitsProcessor(Protocol):
    """What changes the scores before a token is chosen (transformers' processors are such
    too): ``[B, vocab]`` scores and the ids so far ``[B, n]`` to new scores."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor: ...


class LogitsProcessorList(list[LogitsProcessor]):
    """Processors applied in order (as transformers' `LogitsProcessorList`, which a caller of
    `Engine.generate` may pass instead)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class TemperatureLogitsWarper:
    """Scores divided by `temperature` (> 0), as transformers' processor of that name."""

    def __init__(self, temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopKLogitsWarper:
    """Every score below the k-th highest set to -inf (ties at the k-th kept), as
    transformers' processor of that name."""

    def __init__(self, top_k: int, min_tokens_to_keep: int = 1) -> None:
        if not isinstance(top_k, int) or top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {top_k}")
        self.top_k = max(top_k, min_tokens_to_keep)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.size(-1))
        kth = torch.topk(scores, k).values[..., -1:]  # [B, 1]
        return scores.masked_fill(scores < kth, -float("inf"))


class TopPLogitsWarper:
    """Only the smallest set of highest scores whose probability reaches `top_p` kept (the
    others -inf; at least `min_tokens_to_keep`), as transformers' processor of that name."""

    def __init__(self, top_p: float, min_tokens_to_keep: int = 1) -> None:
        if not 0.0 <= float(top_p) <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {top_p}")
        self.top_p = float(top_p)
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        # the tail whose whole probability is at most 1 - p goes; the highest are always kept
        drop_sorted = cumulative <= (1 - self.top_p)
        drop_sorted[..., -self.min_tokens_to_keep :] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        return scores.masked_fill(drop, -float("inf"))


class TopKTopPLogitsWarper:
    """transformers' `TopKLogitsWarper(k)` followed by `TopPLogitsWarper(p)`, in one step that
    sorts only the top-k candidates.

    The kept tokens and their scores are those of the two-step chain (ties at the k-th score
    are kept, as transformers does); only the float rounding of the cumulative probabilities
    can differ, in their last bit.

    Args:
        top_k: keep the k highest scores (> 0).
        top_p: then the smallest set of them whose probability reaches `top_p` (0 < p < 1).
        min_tokens_to_keep: never keep fewer.
    """

    def __init__(self, top_k: int, top_p: float, min_tokens_to_keep: int = 1) -> None:
        if not isinstance(top_k, int) or top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.top_k = max(top_k, min_tokens_to_keep)
        self.top_p = float(top_p)
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.size(-1))
        kth = torch.topk(scores, k).values[..., -1:]  # [B, 1]
        out = torch.full_like(scores, -float("inf"))
        for row in range(scores.shape[0]):
            idx = torch.nonzero(scores[row] >= kth[row], as_tuple=True)[0]  # top-k, ties included
            cand = scores[row, idx]
            # TopPLogitsWarper on the candidates alone (the others have probability 0).
            sorted_logits, order = torch.sort(cand, descending=False)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - self.top_p)
            remove[-self.min_tokens_to_keep :] = False
            keep = idx[order[~remove]]
            out[row, keep] = scores[row, keep]
        return out


def sampling_from_model(model: Any, **overrides: Any) -> SamplingConfig:
    """Sampling defaults from the model's generation_config, then explicit overrides.

    Raises:
        ConfigError: an override is out of range.
    """
    base = SamplingConfig()
    gc = getattr(model, "generation_config", None)
    values: dict[str, Any] = {}
    if gc is not None:
        for key in (row.name for row in layer("sampling") if row.from_model):
            v = getattr(gc, key, None)
            if v is not None and v != getattr(type(gc)(), key, None):
                values[key] = v
        if getattr(gc, "do_sample", None) is False:
            # The model ships greedy decoding: its temperature (if any) is not used, as in
            # transformers' generate(). An explicit --temperature still wins.
            values["temperature"] = 0.0
    values.update({k: v for k, v in overrides.items() if v is not None})
    return dataclasses.replace(base, **values).validated()


def penalised_ids(context: Sequence[int], last_n: int, special: Collection[int] = ()) -> set[int]:
    """The ids the repetition penalty covers: those among the last `last_n` of `context` (0:
    none, -1: all), less the template's special ids (`special`: end of turn and the like,
    which every turn holds)."""
    if last_n == 0:
        return set()
    window = context if last_n < 0 else context[-last_n:]
    return set(window).difference(special)


class WindowedRepetitionPenalty:
    """transformers' `RepetitionPenaltyLogitsProcessor` over the last `last_n` ids only (as
    llama.cpp's `repeat_last_n`), never over `special` ids: a penalty over the whole chat
    would hold back the end-of-turn token and every common word of a long conversation.

    Args:
        penalty: a score above 0 is divided by it, one below multiplied (> 1: penalised).
        last_n: the window, in tokens (0: none, -1: the whole context).
        special: ids never penalised.
    """

    def __init__(self, penalty: float, last_n: int, special: Collection[int] = ()) -> None:
        self.penalty = penalty
        self.last_n = last_n
        self.special = frozenset(special)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        # only the window is read back to the host: per token, not the whole conversation
        window = input_ids if self.last_n < 0 else input_ids[:, -self.last_n :]
        for row in range(scores.shape[0]):
            ids = penalised_ids(window[row].tolist(), self.last_n, self.special)
            if not ids:
                continue
            idx = torch.tensor(sorted(ids), dtype=torch.long, device=scores.device)
            picked = out[row, idx]
            out[row, idx] = torch.where(picked < 0, picked * self.penalty, picked / self.penalty)
        return out


def build_logits_processor(sampling: SamplingConfig, special: Collection[int] = ()) -> LogitsProcessorList:
    """The processors for the settings (top-k with top-p fused into one that sorts
    only the k candidates; the repetition penalty over a window, never on `special` ids):
    built once per turn."""
    processors = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0 and sampling.repeat_last_n != 0:
        processors.append(
            WindowedRepetitionPenalty(sampling.repetition_penalty, sampling.repeat_last_n, special)
        )
    if not sampling.greedy:
        if sampling.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0 and sampling.top_p < 1.0:
            # The same filter as TopK then TopP, sorting k candidates instead of the vocabulary.
            processors.append(TopKTopPLogitsWarper(sampling.top_k, sampling.top_p))
        elif sampling.top_k > 0:
            processors.append(TopKLogitsWarper(sampling.top_k))
        elif sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(sampling.top_p))
    return processors


def seeded_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A random generator for sampling on `device`: seeded with `seed`, or from the OS."""
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return generator


class TokenConstraint(Protocol):
    """What holds an answer to a grammar (`chatbot.engine.grammar.JsonConstraint`)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (``[vocab]``) with the forbidden tokens at -inf (a copy)."""
        ...

    def accept(self, token: int) -> None: ...

    @property
    def complete(self) -> bool:
        """Nothing may follow the answer so far."""
        ...


class Sampler:
    """Chooses each answer token from the logits: the constraint's mask where there is one,
    the processors (repetition penalty over the context so far, temperature, top-k/p), then
    argmax or a draw from `generator`.

    Args:
        sampling: the settings (greedy or not, the most answer tokens).
        context: the ids before the answer (the repetition penalty's context).
        processors: the logits processors (ours or transformers'), applied in order.
        generator: the random generator (seeded by the caller).
        device: where the context buffer lives (the logits' device).
        model: the model, only to name its file when its logits are not finite.
        constraint: a grammar the answer must follow (None: free text); masked first, so
            that top-k and top-p choose among the tokens it allows.
    """

    def __init__(
        self,
        sampling: SamplingConfig,
        context: Sequence[int],
        processors: LogitsProcessor,
        generator: torch.Generator | None,
        device: torch.device,
        model: Any = None,
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.model = model
        self.constraint = constraint
        self.greedy = sampling.greedy
        self.processors = processors
        self.generator = generator
        # preallocated for the whole answer
        self.seen = torch.empty((1, len(context) + sampling.max_new_tokens), dtype=torch.long, device=device)
        self.seen[0, : len(context)] = torch.tensor(list(context), dtype=torch.long)
        self.n_seen = len(context)
        self.scores: torch.Tensor | None = None  # the last token's processed scores [1, vocab]

    @property
    def context(self) -> torch.Tensor:
        """The ids so far, answer tokens accepted included (``[1, n]``)."""
        return self.seen[:, : self.n_seen]

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token after `logits` (``[vocab]``).

        Raises:
            NonFiniteOutputError: the chosen token's logit is NaN or infinite (a damaged model).
        """
        context = cast(torch.LongTensor, self.context)
        allowed = logits if self.constraint is None else self.constraint.mask(logits)
        scores = self.scores = self.processors(context, allowed[None]) if self.processors else allowed[None]
        # The raw logits are checked: a masked one's -inf is the grammar's, not the model's.
        if self.greedy:  # the chosen token's logit is tested as it is read: free
            return checked_token(logits, scores.argmax(-1), self.model)
        return sampled_token(logits, scores, self.generator, self.model)

    def verify(self, logits: torch.Tensor, draft: int) -> int:
        """The next token after `logits` (``[vocab]``) where a draft proposes `draft`: drawn
        from the same distribution as `__call__`'s (greedy: the same token). Sampling keeps
        `draft` with its probability p(draft) under the processed scores, else draws from
        them without it (renormalised): P(y) = p(y) for every y, the standard speculative
        rule for a draft that proposes one token with certainty.

        Raises:
            NonFiniteOutputError: as `__call__`.
        """
        if self.greedy or self.constraint is not None:
            return self(logits)
        context = cast(torch.LongTensor, self.context)
        scores = self.scores = self.processors(context, logits[None]) if self.processors else logits[None]
        p = torch.softmax(scores[0], dim=-1)[draft]
        draw = torch.rand((), generator=self.generator, device=scores.device)
        if bool(draw < p):
            return checked_token(logits, torch.tensor(draft, device=logits.device), self.model)
        rest = scores.clone()
        rest[0, draft] = -float("inf")
        return sampled_token(logits, rest, self.generator, self.model)

    def accept(self, token: int) -> None:
        """`token` joins the answer (the repetition penalty's context, the constraint's state)."""
        self.seen[0, self.n_seen] = token
        self.n_seen += 1
        if self.constraint is not None:
            self.constraint.accept(token)

    @property
    def complete(self) -> bool:
        """The constraint allows nothing after the answer so far (never without one)."""
        return self.constraint is not None and self.constraint.complete
