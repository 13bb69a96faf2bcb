"""SinkCache: unit tests on random tensors, then engine tests on a tiny random Llama
compared against an independent reference (a fresh forward pass over the kept ids)."""

from __future__ import annotations

import pytest
import torch
from helpers import CORPUS, cli, make_model, needs_kernels
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    PhiConfig,
    Qwen2Config,
)

from chatbot.engine.cache import sinks as sink_cache
from chatbot.engine.cache.sinks import (
    SinkCache,
    check_streaming_support,
)
from chatbot.errors import ChatbotError, StreamingUnsupportedError

HEAD_DIM = 16  # hidden 64 / 4 heads
KV_HEADS = 2


def random_ids(n: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (1, n), generator=gen)


def fill(cache: SinkCache, n: int, num_layers: int = 2) -> torch.Tensor:
    """Append n tokens of random keys/values to every layer; return layer 0's keys."""
    keys = torch.randn(1, KV_HEADS, n, HEAD_DIM)
    for layer_idx in range(num_layers):
        cache.update(keys.clone(), torch.randn(1, KV_HEADS, n, HEAD_DIM), layer_idx)
    return keys


def unit_cache(**kwargs: int) -> SinkCache:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM))
    return SinkCache(num_layers=2, inv_freq=inv_freq, **kwargs)


def feed_streaming(model, cache: SinkCache, ids: torch.Tensor, chunk: int = 1):
    """Feed ids in chunks with eviction before each forward; return (last logits, kept ids)."""
    kept: list[int] = []
    logits = None
    with torch.no_grad():
        for lo in range(0, ids.shape[1], chunk):
            piece = ids[:, lo : lo + chunk]
            removed = cache.evict_for_space(piece.shape[1])
            if removed is not None:
                del kept[removed[0] : removed[1]]
            logits = model(input_ids=piece, cache=cache, use_cache=True).logits
            kept.extend(piece[0].tolist())
    assert len(kept) == cache.get_seq_length()
    return logits, kept


def fresh_logits_and_cache(model, kept: list[int]):
    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([kept]), cache=cache, use_cache=True)
    return out.logits, cache


# --- units on random tensors -------------------------------------------------------------


def test_no_eviction_while_it_fits():
    cache = unit_cache(start_size=4, recent_size=16, evict_block=4)
    fill(cache, 15)
    assert cache.capacity == 20
    assert cache.evict_for_space(5) is None
    assert cache.get_seq_length() == 15
    assert cache.evicted_total == 0


def test_eviction_range_and_block_rounding():
    cache = unit_cache(start_size=4, recent_size=16, evict_block=4)
    keys = fill(cache, 20)
    # needs 1 -> rounded up to a block of 4, taken right after the 4 sinks
    assert cache.evict_for_space(1) == (4, 8)
    assert cache.get_seq_length() == 16
    assert cache.evicted_total == 4
    for layer in cache.layers:
        assert layer.keys.shape[-2] == layer.values.shape[-2] == 16
    # the sinks are untouched, the rest moved (rotated)
    assert torch.equal(cache.layers[0].keys[..., :4, :], keys[..., :4, :])
    # needs 5 -> 8
    fill(cache, 4)
    assert cache.evict_for_space(5) == (4, 12)
    assert cache.evicted_total == 12


def test_eviction_never_takes_more_than_the_unpinned_tokens():
    cache = unit_cache(start_size=4, recent_size=16, evict_block=64)
    fill(cache, 20)
    # block rounding would say 64, only 16 are evictable
    assert cache.evict_for_space(16) == (4, 20)
    assert cache.get_seq_length() == 4


def test_values_are_cut_not_rotated_and_keys_are_rotated_by_shift():
    cache = unit_cache(start_size=2, recent_size=6, evict_block=1)
    keys = fill(cache, 8, num_layers=1)
    values = cache.layers[0].values.clone()
    assert cache.evict_for_space(2) == (2, 4)
    assert torch.equal(cache.layers[0].values, torch.cat([values[..., :2, :], values[..., 4:, :]], -2))
    cos, sin = sink_cache.rotation_for_shift(2, cache.inv_freq)
    expected = sink_cache.rotate_keys(keys[..., 4:, :], cos, sin)
    assert torch.allclose(cache.layers[0].keys[..., 2:, :], expected)
    # a pure rotation: norms of every rotary pair are kept
    assert torch.allclose(expected.norm(dim=-1), keys[..., 4:, :].norm(dim=-1), atol=1e-5)


def test_more_incoming_tokens_than_the_window_keep_only_the_sinks():
    """As StreamingLLM: every recent token goes, the sinks stay, nothing raises (issue 14)."""
    empty = unit_cache(start_size=4, recent_size=16, evict_block=4)
    assert empty.evict_for_space(100) is None and empty.get_seq_length() == 0
    cache = unit_cache(start_size=4, recent_size=16, evict_block=4)
    keys = fill(cache, 20)
    assert cache.evict_for_space(17) == (4, 20)
    assert torch.equal(cache.layers[0].keys, keys[..., :4, :])
    assert cache.evict_for_space(50) is None  # only the sinks are left


def test_pin_raises_the_pinned_region():
    cache = unit_cache(start_size=4, recent_size=16, evict_block=4)
    cache.pin(10)
    assert cache.pinned == 10
    assert cache.capacity == 26
    fill(cache, 26)
    assert cache.evict_for_space(1) == (10, 14)
    cache.pin(2)  # never below start_size
    assert cache.pinned == 4
    with pytest.raises(ValueError):
        cache.pin(-1)


def test_layout_nbytes_crop_and_reset():
    cache = unit_cache(start_size=4, recent_size=16, evict_block=4)
    assert cache.nbytes == 0
    fill(cache, 20)
    cache.evict_for_space(1)
    assert (cache.pinned, cache.recent_size, cache.capacity) == (4, 16, 20)
    assert (cache.get_seq_length(), cache.evicted_total) == (16, 4)
    assert cache.nbytes == 2 * 2 * (1 * KV_HEADS * 16 * HEAD_DIM) * 4  # layers * (k, v) * fp32
    cache.crop(-3)
    assert cache.get_seq_length() == 13
    assert all(layer.keys.shape[-2] == 13 for layer in cache.layers)
    cache.pin(12)
    cache.crop(-5)  # cuts into the pin: the pin follows the cut
    assert cache.pinned == 8
    cache.reset()
    assert cache.get_seq_length() == 0
    assert cache.evicted_total == 0
    assert cache.pinned == 4
    assert cache.nbytes == 0


def test_constructor_validation():
    with pytest.raises(ValueError):
        unit_cache(start_size=4, recent_size=0)
    with pytest.raises(ValueError):
        unit_cache(evict_block=0)
    with pytest.raises(ValueError):
        unit_cache(start_size=-1)


# --- engine tests on a tiny random Llama ------------------------------------------------


def test_same_logits_as_dynamic_cache_before_any_eviction():
    model = make_model(sharp=False)
    ids = random_ids(14)
    sink = SinkCache.for_model(model, start_size=4, recent_size=64)
    dense = DynamicCache()
    with torch.no_grad():
        for cache in (sink, dense):
            assert getattr(cache, "evict_for_space", lambda n: None)(8) is None
        a = model(input_ids=ids[:, :8], cache=sink, use_cache=True).logits
        b = model(input_ids=ids[:, :8], cache=dense, use_cache=True).logits
        assert torch.allclose(a, b, atol=1e-6)
        for t in range(8, 14):
            assert sink.evict_for_space(1) is None
            a = model(input_ids=ids[:, t : t + 1], cache=sink, use_cache=True).logits
            b = model(input_ids=ids[:, t : t + 1], cache=dense, use_cache=True).logits
            assert torch.allclose(a, b, atol=1e-6)
    assert sink.evicted_total == 0


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_one_layer_after_eviction_matches_fresh_pass_over_kept_ids(attn):
    model = make_model(layers=1, attn=attn, sharp=False)
    cache = SinkCache.for_model(model, start_size=4, recent_size=16, evict_block=4)
    logits, kept = feed_streaming(model, cache, random_ids(40))
    assert cache.evicted_total > 0
    assert kept[:4] == random_ids(40)[0, :4].tolist()  # the sinks stay
    ref, _ = fresh_logits_and_cache(model, kept)
    assert torch.allclose(logits[0, -1], ref[0, -1], atol=1e-5)


def test_negative_control_without_rerotation_differs(monkeypatch):
    model = make_model(layers=1, sharp=False)
    monkeypatch.setattr(sink_cache, "rotate_keys", lambda keys, cos, sin: keys)
    cache = SinkCache.for_model(model, start_size=4, recent_size=16, evict_block=4)
    logits, kept = feed_streaming(model, cache, random_ids(40))
    ref, ref_cache = fresh_logits_and_cache(model, kept)
    assert not torch.allclose(logits[0, -1], ref[0, -1], atol=1e-4)
    assert not torch.allclose(cache.layers[0].keys, ref_cache.layers[0].keys, atol=1e-3)


def test_chunked_feeding_keeps_layer0_keys_equal_to_fresh_keys():
    model = make_model(layers=2, sharp=False)
    cache = SinkCache.for_model(model, start_size=4, recent_size=24, evict_block=8)
    _, kept = feed_streaming(model, cache, random_ids(90), chunk=5)
    assert cache.evicted_total > 0
    _, ref_cache = fresh_logits_and_cache(model, kept)
    assert torch.allclose(cache.layers[0].keys, ref_cache.layers[0].keys, atol=1e-5)
    assert torch.allclose(cache.layers[0].values, ref_cache.layers[0].values, atol=1e-6)
    # layer 1 saw the evicted tokens through layer 0's outputs: it must differ
    assert not torch.allclose(cache.layers[1].keys, ref_cache.layers[1].keys, atol=1e-5)


def test_bf16_cache_stays_bf16_and_close_to_fresh_keys():
    model = make_model(layers=1, sharp=False).to(torch.bfloat16)
    cache = SinkCache.for_model(model, start_size=4, recent_size=16, evict_block=2)
    _, kept = feed_streaming(model, cache, random_ids(60))
    assert cache.evicted_total >= 40  # every kept key was re-rotated many times
    assert cache.layers[0].keys.dtype == torch.bfloat16
    assert cache.inv_freq.dtype == torch.float32
    _, ref_cache = fresh_logits_and_cache(model, kept)
    ref = ref_cache.layers[0].keys.float()
    err = (cache.layers[0].keys.float() - ref).abs().max().item()
    assert err <= 0.02 * ref.abs().max().item()


def test_ten_windows_token_by_token_stay_inside_the_window():
    model = make_model(layers=2, sharp=False)
    start, recent = 4, 12
    cache = SinkCache.for_model(model, start_size=start, recent_size=recent, evict_block=3)
    positions: list[int] = []

    def record(module, args, kwargs):
        positions.extend(kwargs["position_ids"].flatten().tolist())

    handle = model.model.rotary_emb.register_forward_pre_hook(record, with_kwargs=True)
    ids = random_ids(10 * (start + recent))
    try:
        with torch.no_grad():
            for t in range(ids.shape[1]):
                cache.evict_for_space(1)
                model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
                assert all(layer.keys.shape[-2] <= start + recent for layer in cache.layers)
    finally:
        handle.remove()
    assert len(positions) == ids.shape[1]
    assert max(positions) < start + recent
    assert cache.evicted_total == ids.shape[1] - cache.get_seq_length()


# --- support check -----------------------------------------------------------------------


def test_refuses_gpt2_with_a_message():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(StreamingUnsupportedError, match="gpt2 uses learned absolute positions") as info:
        check_streaming_support(model)
    assert isinstance(info.value, ChatbotError)
    assert "the attention-sink cache needs rotary position embeddings" in str(info.value)
    with pytest.raises(StreamingUnsupportedError):
        SinkCache.for_model(model, 4, 64)


def test_accepts_llama():
    model = make_model(sharp=False)
    check_streaming_support(model)
    check_streaming_support(model.config)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (PhiConfig(), "partial_rotary_factor=0.5"),
        (Qwen2Config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=0), "sliding_attention"),
        (MistralConfig(num_hidden_layers=2, sliding_window=4096), "sliding window of 4096"),
        (GPT2Config(), "gpt2 uses learned absolute positions"),
    ],
)
def test_refuses_configs(config, reason):
    with pytest.raises(StreamingUnsupportedError, match=reason):
        check_streaming_support(config)


def test_sliding_window_larger_than_the_cache_is_accepted():
    config = MistralConfig(num_hidden_layers=2, sliding_window=4096)
    check_streaming_support(config, capacity=2004)
    with pytest.raises(StreamingUnsupportedError):
        check_streaming_support(config, capacity=8192)
    check_streaming_support(Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=4096))


def test_sliding_window_model_streams_when_the_cache_fits_its_window():
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=32,
    )
    model = MistralForCausalLM(config).eval()
    with pytest.raises(StreamingUnsupportedError, match="sliding window of 32"):
        SinkCache.for_model(model, start_size=4, recent_size=40)
    cache = SinkCache.for_model(model, start_size=4, recent_size=20, evict_block=4)
    assert cache.max_capacity == 32
    cache.pin(12)
    with pytest.raises(StreamingUnsupportedError, match="sliding window of 32"):
        cache.pin(13)
    assert cache.pinned == 12
    logits, kept = feed_streaming(model, cache, random_ids(80))
    assert cache.evicted_total > 0
    ref, _ = fresh_logits_and_cache(model, kept)
    assert torch.allclose(logits[0, -1], ref[0, -1], atol=1e-5)


def test_refuses_mrope():
    config = LlamaConfig(num_hidden_layers=2)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    with pytest.raises(StreamingUnsupportedError, match="mrope_section"):
        check_streaming_support(config)


# --- chatbot bench streaming ---------------------------------------------------------------


@pytest.mark.parametrize("opt", ["off", pytest.param("f32", marks=needs_kernels)])
def test_bench_streaming_cache_stays_within_the_window(tmp_path, capsys, tiny_model, tiny_tokenizer, opt):
    """`chatbot bench streaming` feeds a text through the sink cache to 16x the window: the
    cache holds at most the window at every mark, its bytes do not grow, and the figures
    land in the JSON (on the transformers path and on the native one)."""
    import json

    folder = tmp_path / "tiny"
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    text = tmp_path / "long.txt"
    text.write_text(" ".join(CORPUS * 40))
    out = tmp_path / "streaming.json"
    code, stdout, _ = cli(capsys, "bench", "streaming", "--model", str(folder), "--text", str(text),
                          "--recent-size", "16", "--start-size", "4", "--decode-tokens", "4",
                          "--opt", opt, "--json", str(out))  # fmt: skip
    assert code == 0 and f"--opt {opt}" in stdout
    result = json.loads(out.read_text())
    assert result["opt"] == opt
    (run,) = result["runs"]
    assert run["window"] == 20
    marks = run["marks"]
    assert [m["multiple"] for m in marks] == [1, 4, 16]
    assert marks[-1]["tokens_passed"] > 16 * 20
    for m in marks:
        assert 0 < m["cache_tokens"] <= 20
        assert m["decode_tps"] > 0 and m["recompute_tps"] > 0
    assert max(m["cache_bytes"] for m in marks) <= 2 * min(m["cache_bytes"] for m in marks)
