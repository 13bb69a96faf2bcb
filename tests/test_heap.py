"""`chatbot.engine.heap`: a prefill's large, short-lived activations reuse the heap's pages
instead of faulting fresh zero-filled ones in for every layer."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHURN = """
import resource, sys, torch
from chatbot.engine.heap import hold_freed_memory
held = hold_freed_memory() if sys.argv[1] == "hold" else False
def layer():
    a = torch.empty(500, 8960).fill_(1.0)  # 18 MB, as a 1.5B model's MLP activations
    b = torch.empty(500, 8960).fill_(2.0)
    return float((a + b)[0, 0])
layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    layer()
print(held, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def churn(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True)
    held, faults = out.stdout.split()
    return held, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_activations_are_reused_not_faulted_in_again():
    """20 layers' worth of [500, 8960] float32 tensors: ~4,400 page faults per tensor with
    glibc's defaults (each a fresh mapping), a tenth of that once the thresholds are set
    (here 253,230 against 26,250)."""
    assert churn("hold")[0] == "True"
    held, without = churn("default")
    assert held == "False" and without > 20 * 4000
    assert churn("hold")[1] < without / 5


def test_only_once_and_true_after():
    from chatbot.engine import heap

    first = heap.hold_freed_memory()
    assert heap.hold_freed_memory() == first
    assert first == (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
