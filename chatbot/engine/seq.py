"""Small helpers on token-id sequences and figures, used by the session, the compat
adapters and the benches (one definition each)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank, lower), 0.0 for none.

    Raises:
        ValueError: `q` outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile needs 0 <= q <= 1, got {q}")
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
