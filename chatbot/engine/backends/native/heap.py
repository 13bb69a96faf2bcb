"""The C heap's handling of large, short-lived blocks: a CPU prefill's activations.

A prefill of a few hundred tokens allocates and frees tens of megabytes per layer (each
[tokens, width] float32 tensor, the batched products' int8 inputs). glibc's malloc serves a
block above its mmap threshold with a fresh mapping and returns it on free, and trims freed
memory at the heap's top back to the system: each layer then faults its pages in again, all
of them zero-filled by the kernel (glibc raises its threshold as mapped blocks are freed,
which some processes reach early and others never: the same prefill ran at either speed).
`hold_freed_memory` keeps such blocks in the heap, so a
prefill reuses the pages of the layer before: the 1.5B `Q4_K_M` file prefilled 500 tokens at
258-272 tok/s on two threads instead of 182-238 (docs/benchmarks.md). The cost is memory kept
after a prefill up to the trim threshold, never above the peak the prefill reached.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap: glibc's largest allowed (on 64-bit), above a
1.5B model's [500, 8960] float32 tensors (18 MB)."""
TRIM_THRESHOLD = 256 << 20
"""Free memory at the heap's top is given back to the system only above this."""

_done = False


def hold_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds as above, once per process; True where they are
    set (glibc), False elsewhere (musl, macOS, Windows: their allocators are left alone)."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap_set = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    _done = mmap_set and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
