"""Small helpers for the words of messages, shared by the terminal and the benchmarks."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and its noun in the number it takes: "1 turn", "2 turns", "1,024 tokens".

    Args:
        plural: the plural where it is not `noun` + "s".
    """
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"
