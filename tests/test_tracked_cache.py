"""The one object that knows what a cache holds: its record stays true through feeding,
eviction, cropping and interrupts, and the cache it describes gives the logits of a full
recompute of the ids it says it holds."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from helpers import full_logits, make_model

from chatbot.compat.records import forget, lookup, track
from chatbot.engine.cache import tracked as tracked_cache
from chatbot.engine.cache.tracked import UNKNOWN, TrackedCache
from chatbot.engine.generate import Engine
from chatbot.errors import ContextFullError


class _Tok:
    eos_token_id = None

    def decode(self, ids, **kwargs):
        return ""


@pytest.fixture(scope="module")
def engine():
    return Engine(make_model(sharp=False), _Tok(), max_context=96)


def ids_of(n: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g).tolist()


def next_logits(engine: Engine, kv: TrackedCache, token: int) -> torch.Tensor:
    """The logits after feeding `token` on the cache, leaving the cache as it was."""
    n = len(kv.seen)
    logits = engine.prefill(kv, [token])
    assert kv.crop_to(n)
    return logits


def test_debug_checks_are_on_in_tests():
    assert tracked_cache.DEBUG  # conftest sets CHATBOT_DEBUG_CACHE=1 for every test


def test_growing_cache_record_and_logits_after_crop(engine):
    kv = engine.new_cache()
    ids = ids_of(40)
    engine.prefill(kv, ids, prefill_chunk=16)
    assert kv.ids == kv.seen == ids and kv.length == kv.cache.get_seq_length() == 40
    assert kv.common_prefix([*ids[:25], 999]) == 25
    assert kv.rewindable() == 40 and kv.crop_to(25)
    assert kv.ids == ids[:25] and kv.cache.get_seq_length() == 25
    # The cropped cache is exactly the cache of the first 25 ids: same logits as a recompute.
    got = next_logits(engine, kv, ids[25])
    torch.testing.assert_close(got, full_logits(engine.model, ids[:26])[-1], atol=1e-4, rtol=1e-4)


def test_context_full_is_refused_before_any_work(engine):
    kv = engine.new_cache()
    engine.prefill(kv, ids_of(90))
    with pytest.raises(ContextFullError):
        kv.check_room(10)
    assert kv.length == 90 and not kv.is_full()
    engine.prefill(kv, ids_of(5, seed=4))
    assert kv.is_full()


def test_bounded_cache_evicts_after_the_pin_and_keeps_the_record(engine):
    kv = engine.new_cache(start_size=4, recent_size=16)
    assert kv.is_bounded and kv.capacity == 20 and kv.chunk_size(512) == 16
    ids = ids_of(60)
    for i in range(0, 60, 6):
        engine.prefill(kv, ids[i : i + 6])
    assert kv.length <= 20 and kv.evicted_total == 60 - kv.length
    assert kv.ids == ids[:4] + ids[60 - (kv.length - 4) :]
    assert kv.seen == ids and kv.cache.evicted_total == kv.evicted_total
    # After an eviction only the unpinned tail can be cut; cutting more empties the cache.
    assert kv.rewindable() == kv.length - 4
    assert kv.crop_to(58) and kv.ids[-1] == ids[57]
    assert not kv.crop_to(10) and kv.length == 0 and kv.seen == [] and kv.evicted_total == 0


def test_skip_counts_ids_as_evicted_without_encoding(engine):
    kv = engine.new_cache(start_size=4, recent_size=16)
    ids = ids_of(50)
    engine.prefill(kv, ids[:4])
    kv.skip(ids[4:40])
    engine.prefill(kv, ids[40:])
    assert kv.seen == ids and kv.ids == ids[:4] + ids[40:] and kv.evicted_total == 36
    kv.check()


def test_settle_evens_out_a_forward_pass_cut_short(engine):
    kv = engine.new_cache()
    ids = ids_of(30)
    engine.prefill(kv, ids[:20])
    # An interrupt inside a forward pass: the first layer already took 5 more tokens.
    layer = kv.cache.layers[0]
    layer.update(layer.keys[..., :5, :].clone(), layer.values[..., :5, :].clone())
    assert kv.cache.layers[0].get_seq_length() == 25 != kv.cache.layers[1].get_seq_length()
    assert kv.settle()
    assert {lay.get_seq_length() for lay in kv.cache.layers} == {20} and kv.ids == ids[:20]
    got = next_logits(engine, kv, ids[20])
    torch.testing.assert_close(got, full_logits(engine.model, ids[:21])[-1], atol=1e-4, rtol=1e-4)


def test_settle_empties_a_cache_torn_between_eviction_and_record(engine):
    kv = engine.new_cache(start_size=4, recent_size=16)
    engine.prefill(kv, ids_of(20))
    kv.cache.evict_for_space(8)  # the cache evicted, the record never heard of it
    assert not kv.settle()
    assert kv.length == kv.cache.get_seq_length() == 0 and kv.seen == [] and kv.evicted_total == 0


def test_check_catches_a_record_that_lies(engine):
    kv = engine.new_cache()
    engine.prefill(kv, ids_of(10))
    kv.ids[3] += 1
    with pytest.raises(AssertionError, match="head"):
        kv.check()


def test_track_keeps_a_record_until_the_cache_changes_elsewhere(engine):
    kv = track(engine.new_cache().cache, engine.max_context)
    ids = ids_of(12)
    engine.prefill(kv, ids)
    assert lookup(kv.cache) is kv and track(kv.cache, engine.max_context) is kv
    # Changed behind the record's back (a direct model call): the record is stale.
    engine.model(input_ids=torch.tensor([[5, 6]]), past_key_values=kv.cache, use_cache=True)
    assert lookup(kv.cache) is None
    fresh = track(kv.cache, engine.max_context, assume=[*ids, 5, 6, 7])
    assert fresh is not kv and fresh.seen == [*ids, 5, 6] and fresh.ids == fresh.seen
    forget(kv.cache)
    with pytest.raises(ValueError, match="holds 14 tokens"):
        track(kv.cache, 96, assume=ids)  # a cache without a record needs the whole sequence


def test_a_cache_and_its_record_are_freed_once_unreachable(engine):
    """A record and its cache keep each other alive only while something else holds one of
    them: caches made and dropped (one per request, per /reset) are freed, keys and values
    included, whether the caller held the record or the bare cache."""
    import gc
    import weakref

    gone = []
    for bare in (False, True):
        kv = track(engine.new_cache().cache, engine.max_context)
        engine.prefill(kv, ids_of(12))
        held = kv.cache if bare else kv
        assert lookup(kv.cache) is kv  # the bare cache finds its record while held
        refs = [weakref.ref(kv.cache), weakref.ref(kv), weakref.ref(kv.cache.layers[0].keys)]
        del kv
        if bare:
            assert lookup(held) is not None
        del held
        gc.collect()
        gone.append([ref() is None for ref in refs])
    assert gone == [[True] * 3, [True] * 3]


def test_unknown_ids_match_nothing(engine):
    kv = engine.new_cache()
    engine.prefill(kv, ids_of(8))
    engine.model(input_ids=torch.tensor([[1]]), past_key_values=kv.cache, use_cache=True)
    blind = track(kv.cache, engine.max_context)
    assert blind.seen == [UNKNOWN] * 9 and blind.common_prefix(ids_of(8)) == 0


def test_generate_has_no_bookkeeping_callbacks():
    params = inspect.signature(Engine.generate).parameters
    assert not {"on_evict", "on_fed"} & set(params)
    assert list(params)[1] == "kv"


def test_no_module_but_the_tracked_cache_asks_what_kind_of_cache_it_has():
    root = Path(tracked_cache.__file__).resolve().parents[2]
    probe = re.compile(r"(hasattr|getattr)\((self\.)?(session\.)?(s\.)?cache\b")
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        if path.name != "tracked.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert found == []


def test_settling_an_empty_bounded_cache_keeps_its_pin(engine):
    """A pinned system prompt is pinned before it is fed: settling the empty cache (as every
    turn does) must not pull the pin back to the sinks."""
    kv = engine.new_cache(start_size=4, recent_size=16)
    kv.pin(13)
    assert kv.settle() and kv.pinned == 13
    engine.prefill(kv, ids_of(40))
    assert kv.settle() and kv.pinned == 13 and kv.ids[:13] == ids_of(40)[:13]
    assert kv.crop_to(30) and kv.pinned == 13  # a cut inside the window keeps it too
