"""A forward pass run at any depth of the caller's Python stack maps no frame-stack chunk per
module call (`chatbot.engine.backends.native.pystack`): counted as the page faults of the process, which a
chunk mapped afresh on every call costs at least once per call."""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable

import pytest
import torch

from chatbot.engine.backends.base import HFBackend
from chatbot.engine.backends.native.pystack import call_with_room

pytestmark = pytest.mark.skipif(
    sys.implementation.name != "cpython" or sys.platform != "linux",
    reason="CPython's frame stack, page faults from getrusage on Linux",
)

CALLS = 400


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _at_depth(depth: int, fn: Callable[[], object]) -> object:
    """`fn()` called `depth` frames below this one (each frame a few stack words)."""
    if depth:
        return _at_depth(depth - 1, fn)
    return fn()


def _wide() -> None:
    """A frame of about 200 words (its evaluation stack, never touched past its first page)."""


_wide.__code__ = _wide.__code__.replace(co_stacksize=_wide.__code__.co_stacksize + 200)


def _loop() -> None:
    for _ in range(CALLS):
        _wide()


def _faults_per_call(run: Callable[[], object], repeats: int) -> float:
    run()  # the stack's chunks down to this depth exist already
    before = _faults()
    for _ in range(repeats):
        run()
    return (_faults() - before) / repeats


def _faults_at(depth: int, fn: Callable[[], object], repeats: int = 3) -> float:
    """Page faults per call of `fn` called `depth` frames down, less those of getting there
    (the chunks that the descent itself maps and frees)."""
    there = _faults_per_call(lambda: _at_depth(depth, lambda: None), repeats)
    return _faults_per_call(lambda: _at_depth(depth, fn), repeats) - there


# each `_at_depth` frame is about 10 words: 250 depths sweep more than one 2,048-word chunk,
# and the 200-word frame of `_wide` is where no frame of the caller leaves room for it
DEPTHS = range(250)


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="3.13 and later may keep a freed chunk")
def test_a_loop_of_calls_at_a_chunks_end_maps_a_chunk_per_call_where_python_frees_them():
    # the failure `call_with_room` exists for, on the Pythons we run: without this the test
    # below could pass for want of a boundary
    per_call = max(_faults_at(d, _loop) for d in DEPTHS) / CALLS
    assert per_call >= 0.9


def test_calls_with_room_map_one_chunk_per_call_at_every_depth():
    worst = max(_faults_at(d, lambda: call_with_room(_loop)) for d in DEPTHS)
    assert worst <= 8  # faults per `_loop` of 400 calls: the chunk's own pages, not one per call


def test_a_forward_step_at_any_callers_depth_maps_no_chunk_per_module_call(tiny_model):
    # transformers' forward pass calls each layer's modules at one depth: for some depths of
    # its caller one of those calls sits at a chunk's end and, called bare, maps a chunk per
    # layer and step; the backend's step does not, at any depth
    backend = HFBackend(tiny_model)
    cache = backend.new_cache()
    backend.prefill(cache, [5, 6, 7])
    ids = torch.tensor([[9]])

    def bare() -> None:  # the backend's step, less `call_with_room`
        with torch.no_grad():
            backend.forward_model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-1)

    def ours() -> None:
        with torch.no_grad():
            backend.prefill(cache, [9])
            cache.crop(-1)

    bare_worst = max(_faults_at(d, bare) for d in DEPTHS)
    ours_worst = max(_faults_at(d, ours) for d in DEPTHS)
    if sys.version_info < (3, 13):  # a chunk per module call of both layers, at some depth
        assert bare_worst >= 20, bare_worst
    assert ours_worst <= 12  # the fresh chunk's own few pages, at every depth
