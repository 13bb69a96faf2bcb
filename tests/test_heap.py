"""`chatbot.engine.backends.native.heap`: a prefill's large, short-lived activations reuse the heap's pages
instead of faulting fresh zero-filled ones in for every layer."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHURN = """
import ctypes, resource, sys, torch
from chatbot.engine.backends.native.heap import M_MMAP_THRESHOLD, hold_freed_memory
# glibc's initial threshold, pinned: left to itself glibc raises it as mapped blocks are freed,
# and whether these blocks then come back from the heap varied from run to run
ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)
held = hold_freed_memory() if sys.argv[1] == "hold" else False
def layer():
    a = torch.empty(500, 8960).fill_(1.0)  # 18 MB, as a 1.5B model's MLP activations
    b = torch.empty(500, 8960).fill_(2.0)
    return float((a + b)[0, 0])
for _ in range(10):  # the heap grows to its size
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(held, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def churn(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True)
    held, faults = out.stdout.split()
    return held, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_activations_are_reused_not_faulted_in_again():
    """10 layers' worth of [500, 8960] float32 tensors (after 10 to let the heap grow): at
    glibc's initial mmap threshold each tensor is a fresh mapping and faults its ~4,400 pages
    in (131,280 faults here), none once `hold_freed_memory` has set the thresholds."""
    assert churn("hold") == ("True", 0)
    held, without = churn("default")
    assert held == "False" and without > 10 * 4000


def test_only_once_and_true_after():
    from chatbot.engine.backends.native import heap

    first = heap.hold_freed_memory()
    assert heap.hold_freed_memory() == first
    assert first == (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
