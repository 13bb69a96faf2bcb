"""Our own KV cache (`chatbot.engine.cache.layers`) against transformers' `DynamicCache`, the
reference it replaces on the native path: the same calls give the same tensors and sizes, and
transformers' own model classes give the same logits, bit for bit, over either."""

from __future__ import annotations

import pytest
import torch

from chatbot.engine.cache.layers import KVCache, KVLayer, is_cache, is_plain_layer, new_cache
from chatbot.engine.cache.sinks import SinkCache
from tests.helpers import make_model


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)


def _same_state(ours: KVCache, theirs) -> None:
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(zip(ours.layers, theirs.layers)):
        assert a.is_initialized == b.is_initialized
        assert a.get_seq_length() == b.get_seq_length() == ours.get_seq_length(k) == theirs.get_seq_length(k)
        for q in (1, 5):
            assert ours.get_mask_sizes(q, k) == theirs.get_mask_sizes(q, k)
        assert ours.get_query_offset(k) == theirs.get_query_offset(k)
        if b.is_initialized:
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert ours.get_seq_length(len(ours)) == theirs.get_seq_length(len(theirs)) == 0
    assert ours.get_mask_sizes(3, len(ours)) == theirs.get_mask_sizes(3, len(theirs))
    assert ours.is_sliding == theirs.is_sliding and ours.is_compileable == theirs.is_compileable
    assert ours.is_linear == theirs.is_linear and ours.is_dummy == theirs.is_dummy


def test_the_same_calls_give_what_dynamic_cache_gives():
    from transformers.cache_utils import Cache, DynamicLayer

    ours, theirs = KVCache([KVLayer(), KVLayer()]), Cache(layers=[DynamicLayer(), DynamicLayer()])
    _same_state(ours, theirs)
    seed = 0
    for step in ("update 7", "update 1", "crop -3", "update 4", "crop 0", "update 1", "reset 0", "update 2"):
        op, n = step.split()
        if op == "update":
            for layer in range(2):
                seed += 1
                k, v = _kv(int(n), seed)
                got, want = ours.update(k, v, layer), theirs.update(k, v, layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
        elif op == "crop":
            ours.crop(int(n))
            theirs.crop(int(n))
        else:
            ours.reset()
            theirs.reset()
        _same_state(ours, theirs)
    with pytest.raises(ValueError, match="negative"):
        ours.crop(2)
    beam = torch.tensor([0])
    ours.reorder_cache(beam)
    theirs.reorder_cache(beam)
    _same_state(ours, theirs)


def test_which_layers_and_caches_count_as_plain():
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    assert is_plain_layer(KVLayer()) and is_plain_layer(DynamicLayer())
    assert not is_plain_layer(DynamicSlidingWindowLayer(sliding_window=4))
    sink = SinkCache(num_layers=2, inv_freq=torch.ones(4))
    assert not is_plain_layer(sink.layers[0])  # it cuts blocks out: not a plain prefix
    assert is_cache(sink) and is_cache(KVCache([])) and is_cache(DynamicCache())
    assert not is_cache(object()) and not is_cache([KVLayer()])


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("mistral", {"sliding_window": 6}), ("gemma3", {"sliding_window": 6})],
)
def test_transformers_models_give_the_same_logits_over_our_cache(arch, overrides):
    """A prefill and decode steps past the window (for the sliding ones, whose window then
    comes from the mask alone), through transformers' own model class: our cache against
    transformers' full-layer cache (`full_cache`, what the engine gave it before)."""
    from chatbot.engine.backends.base import full_cache

    model = make_model(arch=arch, layers=3, sharp=False, randomize=True, **overrides)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    ours, theirs = new_cache(model.config), full_cache(model.config)
    assert len(ours) == len(theirs) == 3
    with torch.no_grad():
        for chunk in (ids[:, :5], ids[:, 5:6], ids[:, 6:7], ids[:, 7:12]):
            got = model(chunk, cache=ours, use_cache=True).logits
            want = model(chunk, cache=theirs, use_cache=True).logits
            assert torch.equal(got, want)
        assert ours.get_seq_length() == theirs.get_seq_length() == 12
        ours.crop(-4)
        theirs.crop(-4)
        got = model(ids[:, 8:10], cache=ours, use_cache=True).logits
        want = model(ids[:, 8:10], cache=theirs, use_cache=True).logits
        assert torch.equal(got, want)


def test_transformers_cache_filled_with_our_layers_runs_its_model():
    """A transformers `DynamicCache` whose layers the fast path took over (`adopt_layers`, as
    for a cache a compat caller passes in, or the compiled backend's) still answers its own
    methods, and its model gives the logits it gives over an untouched one."""
    from transformers.cache_utils import DynamicCache

    from chatbot.engine.cache.buffers import BufferLayer, adopt_layers

    model = make_model(layers=2, sharp=False, randomize=True)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    adopted, plain = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :4], cache=adopted, use_cache=True)
        model(ids[:, :4], cache=plain, use_cache=True)
        assert adopt_layers(adopted)
        assert all(type(layer) is BufferLayer for layer in adopted.layers)
        assert adopted.get_seq_length() == 4 and adopted.get_mask_sizes(2, 1) == plain.get_mask_sizes(2, 1)
        for chunk in (ids[:, 4:5], ids[:, 5:9]):
            got = model(chunk, cache=adopted, use_cache=True).logits
            assert torch.equal(got, model(chunk, cache=plain, use_cache=True).logits)
