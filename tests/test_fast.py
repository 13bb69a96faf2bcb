"""The fast decode path: native kernels, the in-place cache, and the engine on top of them.

References are independent of the code under test: weights quantized by a few lines of
torch here, logits from a full recompute with transformers, tokens from the plain engine.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from helpers import CORPUS, full_logits, greedy_by_recompute, make_model, needs_kernels
from transformers.cache_utils import DynamicCache

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.decoder import BufferLayer, FastDecoder, adopt_layers, make_decoder
from chatbot.engine.cache.sinks import SinkCache, SinkLayer, rotation_for_shift
from chatbot.engine.generate import Engine

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=64)


# --- references ----------------------------------------------------------------------------


def ref_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Dequantized Q8_0, computed here in torch."""
    b = w.reshape(w.shape[0], -1, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(d > 0, b / d, torch.zeros_like(b)).round().clamp(-127, 127)
    return (q * d).reshape(w.shape)


def ref_q4_1(w: torch.Tensor) -> torch.Tensor:
    b = w.reshape(w.shape[0], -1, 32)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    m, d = lo.half().float(), ((hi - lo) / 15).half().float()
    q = torch.where(d > 0, (b - m) / d, torch.zeros_like(b)).round().clamp(0, 15)
    return (q * d + m).reshape(w.shape)


def assert_decode_matches_recompute(decoder: FastDecoder, model, atol: float) -> None:
    """Prefill 10 random tokens with transformers, decode 30 more natively: after each, the
    logits equal a full recompute of the sequence so far."""
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = decoder.new_cache()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:10]]), cache=cache, use_cache=True)
    for i in range(10, 40):
        logits = decoder.decode(cache, ids[i])
        assert torch.allclose(logits, full_logits(model, ids[: i + 1])[-1], atol=atol)


def answer(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


# --- kernels -------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0", "q4_1"])
def test_matvec_matches_dequantized_weights(fmt):
    torch.manual_seed(0)
    w = torch.randn(200, 96)
    x = torch.randn(96)
    packed = kernels.PACKERS[fmt](w)
    deq = kernels.unpack(packed)
    expected = {"f32": w, "bf16": w.bfloat16().float(), "q8_0": ref_q8_0(w), "q4_1": ref_q4_1(w)}[fmt]
    assert torch.allclose(deq, expected, atol=1e-6)
    for threads in (1, 2):
        assert torch.allclose(kernels.matvec(packed, x, threads), deq @ x, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("act,top", [(kernels.ACT_Q8, 127), (kernels.ACT_I16, 32767)])
def test_integer_products_with_quantized_activations(fmt, act, top):
    """Activations quantized per block of 32 (scale absmax / top, float32): int8 for the
    lossy levels, int16 for `auto` on block-format weights."""
    torch.manual_seed(1)
    w, x = torch.randn(200, 96), torch.randn(96) * torch.rand(96) * 4
    b = x.reshape(-1, 32)
    d = b.abs().amax(-1, keepdim=True) / top
    xq = ((b / d).round() * d).reshape(-1)
    packed = kernels.PACKERS[fmt](w)
    deq = kernels.unpack(packed)
    for threads in (1, 2):
        got = kernels.matvec(packed, x, threads, act=act)
        assert torch.allclose(got, deq @ xq, atol=1e-4)
    if act == kernels.ACT_I16:  # 16 bits: within float32 rounding of the exact product
        assert torch.allclose(kernels.matvec(packed, x, 2, act=act), deq @ x, atol=2e-3)
        assert not torch.allclose(kernels.matvec(packed, x, 2, act=kernels.ACT_Q8), deq @ x, atol=2e-3)


@needs_kernels
def test_lossless_packing_picks_the_format_the_weights_are_in():
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    assert kernels.pack_lossless(ref_q4_1(w)).format_name == "q4_1"
    assert kernels.pack_lossless(ref_q8_0(w)).format_name == "q8_0"
    assert kernels.pack_lossless(w.bfloat16().float()).format_name == "bf16"
    assert kernels.pack_lossless(w).format_name == "f32"
    assert kernels.pack_lossless(torch.randn(8, 40)).format_name == "f32"  # not whole blocks


def test_no_compiler_means_no_fast_path(monkeypatch, tiny_model):
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setattr(kernels, "find_compiler", lambda: None)
    with pytest.raises(kernels.KernelsUnavailable, match="no C compiler"):
        kernels.load_library()
    decoder, reason = make_decoder(tiny_model, "auto")
    assert decoder is None and "no C compiler" in reason


# --- the in-place cache ----------------------------------------------------------------------


def test_buffer_layer_behaves_like_a_sink_layer():
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    ref, buf = SinkLayer(), BufferLayer()
    for n in (5, 300, 1, 1):  # the second update forces the buffer to grow
        k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
        ref.update(k, v)
        rk, rv = buf.update(k, v)
        assert torch.equal(rk, ref.keys) and torch.equal(rv, ref.values)
    cos, sin = rotation_for_shift(40, inv_freq)
    ref.drop(4, 44, cos, sin)
    buf.drop(4, 44, cos, sin)
    assert buf.get_seq_length() == ref.get_seq_length() == 267
    assert torch.allclose(buf.keys, ref.keys) and torch.equal(buf.values, ref.values)
    ref.crop(-7)
    buf.crop(-7)
    assert torch.equal(buf.keys, ref.keys)
    buf.reset()
    assert buf.get_seq_length() == 0 and buf.capacity >= 512  # buffers kept for reuse


def test_adopting_a_filled_cache_keeps_its_contents(tiny_model):
    cache = SinkCache.for_model(tiny_model, start_size=2, recent_size=64)
    with torch.no_grad():
        tiny_model(input_ids=torch.tensor([list(range(5, 35))]), cache=cache, use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    assert adopt_layers(cache)
    assert all(isinstance(layer, BufferLayer) for layer in cache.layers)
    for (k, v), layer in zip(before, cache.layers):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert cache.get_seq_length() == 30 and cache.evict_for_space(40) is not None


# --- decoding --------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("level", ["f32", "auto"])
def test_fast_greedy_equals_float32_reference_for_64_tokens(tiny_model, tiny_tokenizer, level):
    prompt = list(range(5, 25))
    engine = Engine(tiny_model, tiny_tokenizer, decoder=FastDecoder(tiny_model, level))
    cache = engine.new_cache()
    got = answer(engine.generate(cache, prompt, GREEDY))
    assert got == greedy_by_recompute(tiny_model, prompt, 64)
    assert cache.length == len(prompt) + 63  # the last token is never fed


@needs_kernels
def test_exact_on_block_quantized_weights_matches_recompute_and_greedy_reference(tiny_tokenizer):
    """A model whose weights sit on the Q4_1 grid (as one converted from a Q4_1 GGUF): `exact`
    packs them exactly and runs int16 activations; logits stay within 1e-3 of a float32
    full recompute and 64 greedy tokens equal the reference."""
    model = _q4_1_grid_model(len(tiny_tokenizer))
    decoder = FastDecoder(model, "exact")
    assert set(decoder.info().formats) <= {"q4_1", "q8_0"}
    assert decoder.struct.act == kernels.ACT_I16
    assert "int16 activations" in decoder.info().label()  # what /model shows
    assert_decode_matches_recompute(decoder, model, atol=1e-3)
    prompt = list(range(5, 25))
    engine = Engine(model, tiny_tokenizer, decoder=decoder)
    assert answer(engine.generate(engine.new_cache(), prompt, GREEDY)) == greedy_by_recompute(
        model, prompt, 64
    )


def _q4_1_grid_model(vocab: int):
    """A tiny model whose matrices sit on the Q4_1 grid (the embedding/head on Q8_0's), as one
    converted from a Q4_1 GGUF: the native levels pack them as those formats, exactly."""
    model = make_model(vocab)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0:
                p.copy_(ref_q4_1(p) if "embed" not in name else ref_q8_0(p))
    return model


def _step_logits(decoder: FastDecoder, ids: list[int]) -> torch.Tensor:
    cache = decoder.new_cache()
    decoder.prefill_model(input_ids=torch.tensor([ids[:4]]), cache=cache, use_cache=True)
    return torch.stack([decoder.decode(cache, t) for t in ids[4:]])


@needs_kernels
def test_auto_takes_int8_inputs_where_faster_and_int16_into_the_head(tiny_tokenizer):
    """`auto` holds the inputs of each product site by the build's `chatbot_int8_faster`:
    on AVX2 the Q4_1 layers take int8 (llama.cpp's own rounding) and the Q8_0 head int16;
    elsewhere every site takes int16, as `exact`. The per-site form is real in the kernels:
    `fast` with every site's bit set decodes bit for bit as `exact`, and with auto's bits as
    `auto`; auto's logits sit between exact's and fast's distance from a float32 recompute."""
    from chatbot.engine.backends.native.inputs import SITES

    model = _q4_1_grid_model(len(tiny_tokenizer))
    ids = list(range(5, 29))
    exact, auto, fast = (FastDecoder(model, level, threads=1) for level in ("exact", "auto", "fast"))
    lib = kernels.load_library()
    head = 1 << SITES.index("head")
    if lib.chatbot_int8_faster(kernels.FMT_Q4_1, 0):
        assert (auto.inputs.act, auto.inputs.int16_sites) == (kernels.ACT_Q8, head)
        assert auto.info().activations == "int8+int16" and "llama.cpp" in auto.info().label()
    else:  # no faster int8 product in this build: auto is exact
        assert (auto.inputs.act, auto.inputs.int16_sites) == (kernels.ACT_I16, 0)
    assert (exact.inputs.act, fast.inputs.act, fast.inputs.int16_sites) == (
        kernels.ACT_I16,
        kernels.ACT_Q8,
        0,
    )
    got = {name: _step_logits(d, ids) for name, d in (("exact", exact), ("auto", auto), ("fast", fast))}
    fast.struct.act_i16_sites = (1 << len(SITES)) - 1
    assert torch.equal(_step_logits(fast, ids), got["exact"])
    fast.struct.act_i16_sites = auto.inputs.int16_sites
    assert torch.equal(_step_logits(fast, ids), got["auto"])
    ref = torch.stack([full_logits(model, ids[: i + 1])[-1] for i in range(4, len(ids))])
    err = {name: float((logits - ref).abs().mean()) for name, logits in got.items()}
    assert err["exact"] < 1e-4 < err["fast"], err
    if auto.inputs.act == kernels.ACT_Q8:
        assert err["exact"] < err["auto"] < err["fast"], err


@needs_kernels
def test_fast_logits_match_full_recompute(tiny_model):
    assert_decode_matches_recompute(FastDecoder(tiny_model, "f32", threads=2), tiny_model, atol=1e-4)


@needs_kernels
def test_multi_turn_session_on_the_fast_path_matches_plain_engine(tiny_model, tiny_tokenizer):
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=20)
    answers = {}
    for name, decoder in [("plain", None), ("fast", FastDecoder(tiny_model, "f32"))]:
        session = ChatSession(
            Engine(tiny_model, tiny_tokenizer, decoder=decoder), ChatConfig(sampling=sampling)
        )
        answers[name] = [answer(session.send(text)) for text in ("Hello there!", "How are you?", "Café 🙂")]
        assert session.cache.get_seq_length() == len(session.cache_ids)
    assert answers["fast"] == answers["plain"]


@needs_kernels
def test_streaming_eviction_and_rerotation_on_the_fast_path(tiny_model, tiny_tokenizer):
    """A sink cache small enough to evict during decoding gives the plain engine's tokens."""
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=150)
    config = ChatConfig(
        sampling=sampling, engine=EngineConfig(enable_streaming=True, start_size=4, recent_size=48)
    )
    results = {}
    for name, decoder in [("plain", None), ("fast", FastDecoder(tiny_model, "f32"))]:
        session = ChatSession(Engine(tiny_model, tiny_tokenizer, decoder=decoder), config)
        got = [answer(session.send(text)) for text in ("Hello there!", "The quick brown fox")]
        results[name] = (got, list(session.cache_ids), session.evicted_total)
        assert session.evicted_total > 0
        assert session.cache.get_seq_length() == len(session.cache_ids) <= session.cache.capacity
    assert results["fast"] == results["plain"]


@needs_kernels
def test_crop_after_decoding_then_continue(tiny_model, tiny_tokenizer):
    """Cutting the cache back (undo, an interrupt) and decoding again stays exact."""
    decoder = FastDecoder(tiny_model, "f32")
    engine = Engine(tiny_model, tiny_tokenizer, decoder=decoder)
    cache = engine.new_cache()
    prompt = list(range(5, 25))
    first = answer(
        engine.generate(
            cache, prompt, SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=10)
        )
    )
    assert cache.crop_to(len(prompt) + 3)
    history = prompt + first[:3]
    again = answer(
        engine.generate(
            cache, [first[3]], SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=8)
        )
    )
    assert again == greedy_by_recompute(tiny_model, history + [first[3]], 8)


@needs_kernels
def test_rope_table_and_cache_grow_past_their_first_size(tiny_model):
    decoder = FastDecoder(tiny_model, "f32")
    decoder._rope_tables = [(c[:8], s[:8]) for c, s in decoder._rope_tables]  # as if made for 8 positions
    decoder.struct.rope_len = 8
    ids = torch.randint(3, 300, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = decoder.new_cache()
    with torch.no_grad():
        tiny_model(input_ids=torch.tensor([ids[:2]]), cache=cache, use_cache=True)
    for i in range(2, 300):  # crosses the 256-token first buffer size too
        logits = decoder.decode(cache, ids[i])
    assert decoder.struct.rope_len >= 301 and cache.layers[0].capacity == 384  # 256, grown 1.5x
    assert torch.allclose(logits, full_logits(tiny_model, ids)[-1], atol=1e-4)


@needs_kernels
def test_a_turn_sizes_the_cache_once_and_a_longer_one_grows_it_by_half(tiny_model, tiny_tokenizer):
    """The cache's buffers are made before the prefill, for the prompt and the answer, and
    are not regrown (reallocated) during the turn; the next turn that needs more room grows
    them to 1.5x rather than 2x, and the answers stay exact."""
    decoder = FastDecoder(tiny_model, "f32")
    engine = Engine(tiny_model, tiny_tokenizer, max_context=1024, decoder=decoder)
    kv = engine.new_cache()
    ids = torch.randint(3, 300, (400,), generator=torch.Generator().manual_seed(9)).tolist()
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=84, stream_interval=1)
    chunks = engine.generate(kv, ids[:300], sampling, prefill_chunk=64)
    first = next(chunks)
    layers = kv.cache.layers
    versions = [layer.version for layer in layers]
    got = list(first.token_ids) + answer(chunks)
    assert [layer.version for layer in layers] == versions  # no reallocation after the prefill
    assert {layer.capacity for layer in layers} == {384}  # 300 + 84 (a multiple of 64), not 512
    assert got == greedy_by_recompute(tiny_model, ids[:300], 84)
    held = kv.length
    more = ids[300:400]
    again = answer(
        engine.generate(kv, more, SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=8))
    )
    assert {layer.capacity for layer in layers} == {576}  # 1.5x (383 + 100 + 8 need less), not 768
    assert again == greedy_by_recompute(tiny_model, kv.ids[:held] + more, 8)


def test_a_dropped_cache_is_freed_without_the_garbage_collector(tiny_model, tiny_tokenizer):
    """A record refers to its cache, not the other way round: a holder that drops it (a
    finished server request, a bench run) frees the cache at once, and so does /reset."""
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=4)
    engine = Engine(tiny_model, tiny_tokenizer)
    gc.disable()
    try:
        kv = engine.new_cache()
        answer(engine.generate(kv, [5, 6, 7], sampling))
        kept = weakref.ref(kv.cache)
        del kv
        assert kept() is None
        session = ChatSession(engine, ChatConfig(sampling=sampling))
        answer(session.send("Hello there!"))
        old = weakref.ref(session.kv.cache)
        session.reset()
        assert old() is None
        assert answer(session.send("Hello there!"))  # the new cache works
    finally:
        gc.enable()


# --- lossy levels ------------------------------------------------------------------------------


def perplexity(decoder: FastDecoder, model, ids: list[int]) -> float:
    """Next-token perplexity of `ids`, one token per decode step after the first."""
    cache = decoder.new_cache()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:1]]), cache=cache, use_cache=True).logits[0, -1]
    nll = 0.0
    for i in range(1, len(ids)):
        nll -= float(torch.log_softmax(logits.float(), -1)[ids[i]])
        if i + 1 < len(ids):
            logits = decoder.decode(cache, ids[i])
    return math.exp(nll / (len(ids) - 1))


@needs_kernels
@pytest.mark.parametrize("level", ["int8", "int4"])
def test_lossy_levels_keep_perplexity_close(tiny_model, tiny_tokenizer, level):
    ids = tiny_tokenizer(" ".join(CORPUS), add_special_tokens=False)["input_ids"][:120]
    ref = perplexity(FastDecoder(tiny_model, "f32"), tiny_model, ids)
    lossy = perplexity(FastDecoder(tiny_model, level), tiny_model, ids)
    # A random 2-layer model with 64-wide rows: a coarse bound; the real model is held to
    # 3% by the slow test below.
    assert abs(lossy / ref - 1) < 0.15, (ref, lossy)


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("level", ["exact", "auto", "fast", "int8", "int4"])
def test_default_model_perplexity_within_3_percent(default_model, level):
    import json
    from importlib import resources

    turns = json.loads(resources.files("chatbot").joinpath("data/conversation.json").read_text())["turns"]
    ids = default_model.tokenizer("\n\n".join(turns), add_special_tokens=False)["input_ids"][:256]
    logits = full_logits(default_model.model, ids)[:-1]
    ref = math.exp(float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))))
    got = perplexity(FastDecoder(default_model.model, level), default_model.model, ids)
    assert abs(got / ref - 1) < (1e-3 if level == "exact" else 0.03), (ref, got)


# --- fallbacks ---------------------------------------------------------------------------------


def test_unsupported_models_fall_back_with_a_reason(tiny_tokenizer):
    gelu = make_model(len(tiny_tokenizer), hidden_act="gelu")
    decoder, reason = make_decoder(gelu, "auto")
    assert decoder is None and "gelu" in reason
    bf16 = make_model(len(tiny_tokenizer)).to(torch.bfloat16)
    decoder, reason = make_decoder(bf16, "auto")
    assert decoder is None and "float32" in reason
    assert make_decoder(bf16, "off") == (None, None)
    with pytest.raises(ValueError, match="unknown optimization level"):
        make_decoder(bf16, "turbo")


def test_thread_tuner_settles_on_the_faster_count_and_rechecks_rarely():
    from chatbot.engine.backends.native.decoder import ThreadTuner

    tuner = ThreadTuner(4, explore_every=8)
    cost = {1: 0.010, 4: 0.100}  # a busy machine: four threads ten times slower
    picks = []
    for _ in range(400):
        n = tuner.pick()
        picks.append(n)
        tuner.record(n, cost[n])
    assert picks[:2] == [1, 4]
    assert 1 <= picks[2:].count(4) <= 400 / 80 + 1  # re-checked about every 8 x 10 steps
    cost = {1: 0.010, 4: 0.004}  # the machine went quiet
    for _ in range(200):
        n = tuner.pick()
        tuner.record(n, cost[n])
    assert tuner.pick() == 4
    assert ThreadTuner(1).pick() == 1


def test_adopt_refuses_a_filled_sliding_window_layer_and_a_lookalike_by_name():
    """Only transformers' own DynamicLayer, SinkLayer and BufferLayer are taken over, and an
    empty sliding-window layer (nothing to lose: the buffer keeps every token, the window is
    a mask); a sliding-window layer holding tokens (it dropped the older ones), a subclass
    that stores its tokens differently, or a class that merely shares the name, leaves the
    cache unchanged."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    filled = DynamicSlidingWindowLayer(sliding_window=8)
    filled.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))
    lookalike = type("DynamicLayer", (DynamicSlidingWindowLayer,), {})
    for layer in (filled, lookalike(sliding_window=8)):
        cache = DynamicCache()
        cache.layers = [DynamicLayer(), layer]
        assert adopt_layers(cache) is False
        assert cache.layers[1] is layer and type(cache.layers[0]) is DynamicLayer
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=8)]
    assert adopt_layers(cache) is True
    assert [type(layer) for layer in cache.layers] == [BufferLayer, BufferLayer]


@needs_kernels
def test_kernels_refuse_ctypes_mirrors_of_the_wrong_size():
    """The ctypes mirrors match the C structs' sizeof; a mirror missing a field is refused
    with a message naming the struct, before any call could read a shifted field."""
    import ctypes

    lib = kernels.load_library()
    kernels.check_abi(lib)  # the real mirrors pass
    # without `cols` and `x8` (one field alone would hide in the alignment padding)
    short = type("Mat", (ctypes.Structure,), {"_fields_": kernels.Mat._fields_[:-2]})
    with pytest.raises(kernels.KernelsUnavailable, match="struct mat is 24 bytes in csrc/kernels.h but 16"):
        kernels.check_abi(lib, {**kernels.ABI_MIRRORS, "mat": short})
