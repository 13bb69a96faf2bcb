"""Room on CPython's frame stack for a call that runs many Python frames (a forward pass).

Since 3.11 CPython keeps a thread's Python frames in chunks (16 KiB, more for a large frame).
A call whose frame does not fit in what is left of the current chunk gets a new chunk (an
``mmap``), and the chunk is freed (``munmap``) as soon as that frame returns. A loop that calls
at the same depth, right at a chunk's end, therefore maps and unmaps a chunk on every call
(CPython gh-142183; 3.13 and 3.14 got a one-chunk cache in 2026, 3.11 and 3.12 did not). A
model's forward pass is such a loop: each layer calls its modules at one depth. Where the
caller's own depth puts those calls on a boundary, a decode step of the default model made about
140 map/unmap pairs. Each unmap interrupts every other CPU running the process's threads (a TLB
shootdown), which in a decode step is the OpenMP team of the products. The same step took 66-92
ms where it was 48-53 ms one or two frames shallower (docs/benchmarks.md, "The compiled decode
step"); which depth a process lands on depends on how it was started (``python -m`` adds
frames), so the loss looked like a property of the process.

`call_with_room` runs a call in frames that begin at the start of a fresh chunk with about 40
KiB free after them, whatever the caller's depth: one chunk mapped and freed per call (about
10 µs), not one per layer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

ROOM_WORDS = 3100
"""The extra stack slots (8-byte words) of the trampoline's frame: more than a 16 KiB chunk
holds, so the frame never fits in the chunk in use (a new one is always taken); CPython then
sizes the new chunk to the frame plus 1,000 words and rounds up to a power of two: 64 KiB,
about 40 KiB of it free for the call's own frames."""


def _trampoline(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    return fn(*args, **kwargs)


if sys.implementation.name == "cpython" and sys.version_info >= (3, 11):
    # a frame's size is its locals plus its evaluation stack (`co_stacksize`): a larger stack
    # is never used, only reserved, and the pages it spans are never touched
    _trampoline.__code__ = _trampoline.__code__.replace(
        co_stacksize=_trampoline.__code__.co_stacksize + ROOM_WORDS
    )


def call_with_room(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, its frames at the start of a fresh chunk of CPython's frame
    stack (see the module's docstring); elsewhere (another Python, another version) a plain
    call."""
    return _trampoline(fn, args, kwargs)
