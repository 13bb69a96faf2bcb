"""What the mixture-of-experts tests share (test_moe_experts.py, test_gpt_oss.py): a batch's
random routes, the experts token by token through the decode step's one-input products (the
reference of `kernels.experts`), and the decode step's logits at a thread count.

Imported as a plain module (`from moe_helpers import routes`): pytest puts tests/ on the path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def routes(n_experts: int, k: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens' k distinct experts each (ids [n, k]) and their weights ([n, k], in [0, 1)),
    drawn from `g`."""
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n)])
    return ids, torch.rand(n, k, generator=g)


ExpertOut = Callable[[int, torch.Tensor], torch.Tensor]


def one_by_one(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, expert_out: ExpertOut) -> torch.Tensor:
    """The experts token by token: out[t] = sum over j of w[t, j] expert_out(ids[t, j], x[t]),
    the slots added in order, as the decode step's loop adds them."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += w[t, j] * expert_out(int(ids[t, j]), x[t])
    return out


def decode_logits(model, ids: Sequence[int], threads: int) -> torch.Tensor:
    """The decode step's logits for each of `ids` (the first through prefill_rows) at `threads`
    threads and ``--opt auto``."""
    from chatbot.engine.backends.native.decoder import FastDecoder

    dec = FastDecoder(model, "auto", threads=threads)
    cache = dec.new_cache()
    return torch.stack([dec.prefill_rows(cache, ids[:1])] + [dec.decode(cache, t) for t in ids[1:]])
