"""The queries of a forward pass's first positions, kept so that a later prompt with the same
start continues that pass exactly.

A prompt's first forward pass computes its attention in one call over all its positions (sdpa
with `is_causal`); how the kernel cuts that call into blocks decides the last bits of every
position's result. A prompt that takes its start's keys and values from a store (the template's
opening and the system prompt, `chatbot.conversation.cache`) and encodes only the rest in a
pass of its own would attend in other blocks: its logits, and so a greedy answer, could differ
from the whole prompt's. With the start's queries kept too, the pass that continues it puts
them before its own and makes the very call the whole prompt would have made, so every
position after the start gets the bits it gets without the store (the products of the other
modules are computed row by row, the same for any cut).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PassQueries:
    """The queries (after the rotary embedding) of a pass's first `rows` positions, one
    ``[1, heads, rows, head_dim]`` tensor per layer.

    A pass given one with `continuing` False (a prompt's first pass, from an empty cache) keeps
    its first `rows` queries in `layers`; one with `continuing` True (the rest of that prompt,
    after a cache that holds those `rows` positions' keys and values) puts them before its own.
    """

    rows: int
    layers: list[torch.Tensor] = field(default_factory=list)
    continuing: bool = False

    def complete(self, n_layers: int) -> bool:
        """Whether every layer's queries are here (a pass kept them all)."""
        return len(self.layers) == n_layers and all(q.shape[-2] == self.rows for q in self.layers)


SDPA_QUERY_BLOCK = 32
"""Queries per block of torch's CPU attention kernel (flash attention) for a pass of fewer than
`SDPA_SMALL_PASS` positions: each block of 32 queries is one product with the keys, and a
position's bits depend on the block it falls in (its length and the keys it reaches)."""
SDPA_SMALL_PASS = 192
"""From this many positions on the kernel cuts its queries in larger blocks (and the bits of a
start's positions vary with the prompt's length): a start is taken only below it."""

REST_ROWS = 5
"""The fewest positions left to encode after a stored start: the packed products of up to 4
input rows are matrix-vector ones (`chatbot.engine.backends.native.packed.SMALL_INPUT_ROWS`),
whose sums run in another order than the batched product the whole prompt's rows take."""


def exact_rows(start: int, *passes: int) -> int:
    """How many of a stored start's `start` positions a prompt may take from the store and
    still get the bits it gets encoded whole: those in whole blocks of queries in every one of
    `passes` (the lengths of the first pass that stored them and of the prompt's own), each
    under `SDPA_SMALL_PASS`; 0 where one is not. In such a block the products, the softmax's
    sums and the keys reached are those of any pass long enough to fill it (measured on
    torch 2.13, AVX-512: tests/test_kv_disk.py checks the logits bit for bit)."""
    if not passes or any(not 0 < n < SDPA_SMALL_PASS for n in passes):
        return 0
    whole = min(passes) // SDPA_QUERY_BLOCK * SDPA_QUERY_BLOCK
    return max(0, min(start, whole))
