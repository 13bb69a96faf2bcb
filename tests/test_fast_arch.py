"""The fast decode path on the other architectures it runs: qwen2 (q/k/v bias), qwen3 (q/k
RMSNorm per head), llama with attention and MLP biases, gemma2 and gemma3. Each tiny random model is checked
against transformers: logits after every native step against a full recompute, greedy tokens
against a recompute, and a streaming conversation (sink cache evicting and re-rotating keys
with the model's own rope) against the plain engine."""

from __future__ import annotations

import pytest
import torch
from helpers import full_logits, greedy_by_recompute, make_model, needs_kernels

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.backends.native.decoder import FastDecoder
from chatbot.engine.generate import Engine

pytestmark = needs_kernels

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=48)
# Each architecture with what sets it apart: q/k RMSNorm per head (qwen3, with a head size
# other than hidden / heads), biases (llama-bias); qwen2 has q/k/v biases of its own.
ARCH_SETTINGS = {
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3", "head_dim": 32},
    "llama-bias": {"arch": "llama", "attention_bias": True, "mlp_bias": True},
    # gemma: four norms per layer (1 + w), GeGLU, a scaled embedding, query_pre_attn_scalar,
    # soft-capped scores and logits (caps small enough to bite on a tiny model), and
    # sliding-window layers with a window the tests decode well past.
    "gemma2": {"arch": "gemma2", "attn": "eager", "head_dim": 32, "query_pre_attn_scalar": 24,
               "sliding_window": 8, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
    # gemma3: q/k norms and a rope per layer type (local base 100, global 10000 scaled x4)
    "gemma3": {"arch": "gemma3", "attn": "eager", "head_dim": 32, "query_pre_attn_scalar": 24,
               "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "full_attention": {"rope_type": "linear", "rope_theta": 10000.0,
                                                      "factor": 4.0}}},
}  # fmt: skip


# The tiny shape of helpers.make_model, for configs built here (Llama-3 rope parameters).
TINY = dict(  # noqa: C408 - keyword form, as the configs take them
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=True,
)


def arch_model(arch: str, vocab: int):
    """A tiny random model of `arch` with non-trivial biases and norm weights (seed 7)."""
    return make_model(vocab, seed=7, randomize=True, **ARCH_SETTINGS[arch])


ARCHS = list(ARCH_SETTINGS)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_full_recompute(arch, tiny_tokenizer):
    model = arch_model(arch, len(tiny_tokenizer))
    decoder = FastDecoder(model, "f32", threads=2)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = decoder.new_cache()  # gemma: prefill through transformers, past its window of 8
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:10]]), cache=cache, use_cache=True)
    for i in range(10, 40):
        logits = decoder.decode(cache, ids[i])
        assert torch.allclose(logits, full_logits(model, ids[: i + 1])[-1], atol=1e-4), i


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers(arch, tiny_tokenizer):
    model = arch_model(arch, len(tiny_tokenizer))
    prompt = list(range(5, 25))
    engine = Engine(model, tiny_tokenizer, decoder=FastDecoder(model, "auto"))
    got = [t for c in engine.generate(engine.new_cache(), prompt, GREEDY) for t in c.token_ids]
    assert got == greedy_by_recompute(model, prompt, GREEDY.max_new_tokens)


def assert_fast_streams_as_plain(model, tokenizer, recent_size: int, new_tokens: int) -> None:
    """Two turns with a sink cache small enough to evict while decoding: the fast path gives
    the plain engine's tokens, cache ids and eviction count."""
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=new_tokens)
    config = ChatConfig(
        sampling=sampling, engine=EngineConfig(enable_streaming=True, start_size=4, recent_size=recent_size)
    )
    results = {}
    for name, decoder in [("plain", None), ("fast", FastDecoder(model, "f32"))]:
        session = ChatSession(Engine(model, tokenizer, decoder=decoder), config)
        got = [
            [t for c in session.send(text) for t in c.token_ids] for text in ("Hello there!", "The quick fox")
        ]
        results[name] = (got, list(session.cache_ids), session.evicted_total)
        assert session.evicted_total > 0
    assert results["fast"] == results["plain"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_streaming_rerotation_uses_the_models_rope(arch, tiny_tokenizer):
    """A sink cache small enough to evict while decoding: the fast path gives the plain
    engine's tokens, cache ids and eviction count."""
    model = arch_model(arch, len(tiny_tokenizer))
    with torch.no_grad():  # a rope base of its own, so a default-rope re-rotation would show
        rotary = model.model.rotary_emb
        rotary.inv_freq.copy_(
            1.0 / (1234.0 ** (torch.arange(0, rotary.inv_freq.numel()) * 2 / (2 * rotary.inv_freq.numel())))
        )
        rotary.original_inv_freq = rotary.inv_freq.clone()
    assert_fast_streams_as_plain(model, tiny_tokenizer, recent_size=48, new_tokens=120)


# --- Llama-3 rope scaling from a GGUF file ----------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip


@pytest.fixture
def llama3_gguf(tmp_path, monkeypatch, tiny_tokenizer):
    """A tiny Llama with llama3 rope scaling (a short original context, so that most of its
    frequencies are scaled), and its GGUF file as llama.cpp's converter writes it: the scaling
    as a ``rope_freqs.weight`` tensor of per-frequency factors (gguf_synthetic's formula)."""
    import gguf
    import transformers
    from helpers import write_tiny_gguf

    from devtools.gguf_synthetic import llama3_rope_factors

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch.manual_seed(11)
    config = transformers.LlamaConfig(
        vocab_size=len(tiny_tokenizer), rope_parameters=dict(LLAMA3_ROPE), **TINY
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():  # sharp attention, so that a wrong rope changes the tokens
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    path = tmp_path / "llama3.gguf"
    factors = llama3_rope_factors(16, 10000.0, 8.0, 1.0, 4.0, 64)
    add_tensor = gguf.GGUFWriter.add_tensor

    def with_rope_freqs(self, name, *args, **kwargs):
        add_tensor(self, name, *args, **kwargs)
        if name == "output_norm.weight":
            add_tensor(self, "rope_freqs.weight", factors)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", with_rope_freqs)
    write_tiny_gguf(path, model, tiny_tokenizer)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    return path, model


def test_llama3_rope_scaling_from_gguf_matches_transformers(llama3_gguf, tiny_tokenizer):
    """The loaded file's rotary frequencies are transformers' llama3 ones (not the plain rope
    transformers' GGUF reader would give); logits, and greedy tokens on the fast path by
    default, equal transformers' on the model the file was written from."""
    from chatbot.models.loader import load_model

    path, model = llama3_gguf
    loaded = load_model(str(path), device="cpu")
    ours, theirs = loaded.model.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq
    assert not torch.allclose(theirs, 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16))  # scaling shows
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    ids = list(range(5, 60))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits, rtol=1e-4, atol=1e-4
        )
    decoder = FastDecoder(loaded.model, "auto")
    assert decoder.source == "gguf"
    engine = Engine(loaded.model, loaded.tokenizer, decoder=decoder)
    prompt = list(range(5, 25))
    got = [t for c in engine.generate(engine.new_cache(), prompt, GREEDY) for t in c.token_ids]
    assert got == greedy_by_recompute(model, prompt, GREEDY.max_new_tokens)


def test_llama3_streaming_rerotates_with_the_scaled_rope(llama3_gguf, tiny_tokenizer):
    """--enable-streaming on the loaded file (fast path, sink cache evicting and re-rotating)
    gives the tokens of transformers' own llama3 model on the plain engine."""
    from chatbot.models.loader import load_model

    path, model = llama3_gguf
    loaded = load_model(str(path), device="cpu")
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=120)
    config = ChatConfig(
        sampling=sampling, engine=EngineConfig(enable_streaming=True, start_size=4, recent_size=48)
    )
    results = {}
    for name, engine in [
        ("transformers", Engine(model, tiny_tokenizer)),
        ("gguf-fast", Engine(loaded.model, loaded.tokenizer, decoder=FastDecoder(loaded.model, "auto"))),
    ]:
        session = ChatSession(engine, config)
        got = [
            [t for c in session.send(text) for t in c.token_ids] for text in ("Hello there!", "The quick fox")
        ]
        results[name] = (got, list(session.cache_ids), session.evicted_total)
        assert session.evicted_total > 0
        # the re-rotation turns keys by the scaled frequencies, transformers' llama3 ones
        torch.testing.assert_close(
            session.cache.inv_freq, model.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0
        )
    assert results["gguf-fast"] == results["transformers"]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_each_gemma_feature_changes_the_logits(arch, tiny_tokenizer):
    """The gemma tests above would catch a kernel that skipped any of gemma's features: with
    each one turned off in the decoder, its logits leave transformers' by far more than the
    tolerance (the features the architecture has; gemma3 has no soft-capping)."""
    model = arch_model(arch, len(tiny_tokenizer))
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = [full_logits(model, ids[: i + 1])[-1] for i in range(len(ids))]
    features = {"window": None, "embed_scale": 0.0}
    if arch == "gemma2":
        features.update(attn_softcap=0.0, final_softcap=0.0)
    else:
        features.update(rope_sel=None)
    for field, off in [(None, None), *features.items()]:
        decoder = FastDecoder(model, "f32", threads=1)
        if field is not None:
            setattr(decoder.struct, field, off)
        cache = decoder.new_cache()
        with torch.no_grad():
            model(input_ids=torch.tensor([ids[:4]]), cache=cache, use_cache=True)
        error = max((decoder.decode(cache, ids[i]) - reference[i]).abs().max().item() for i in range(4, 24))
        assert (error < 1e-4) == (field is None), (field, error)


def test_gemma3_with_its_vision_tower_falls_back_with_a_reason():
    """A multimodal Gemma 3 checkpoint (text config gemma3_text, layers under a language
    model) is refused with a reason, not an AttributeError."""
    import transformers

    from chatbot.engine.backends.native.decoder import make_decoder

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,  # noqa: C408
                num_key_value_heads=2, head_dim=16, vocab_size=300)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,  # noqa: C408
                  image_size=28, patch_size=14)  # fmt: skip
    model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision)
    ).eval()
    decoder, reason = make_decoder(model, "auto")
    assert decoder is None and reason == (
        "fast decode off: no fast decode for Gemma3ForConditionalGeneration (a text-only model runs)"
    )


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_streams_on_the_fast_path_as_on_transformers(arch, tiny_tokenizer):
    """--enable-streaming on gemma (the cache inside its sliding window of 64): the fast
    path's tokens, cache ids and evictions equal the plain engine's; gemma3's local and
    global layers each keep their own rope through the re-rotations."""
    settings = {**ARCH_SETTINGS[arch], "sliding_window": 64}
    model = make_model(len(tiny_tokenizer), seed=7, randomize=True, **settings)
    assert_fast_streams_as_plain(model, tiny_tokenizer, recent_size=40, new_tokens=100)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_rows_is_decoding_one_by_one(arch, threads, tiny_tokenizer):
    """A few prompt tokens in one batched pass (rows sharing one cache, each seeing the keys
    of the rows before it) leave the cache and logits of decoding them one by one, bit for
    bit, and the logits of a full recompute; gemma's window of 8 is crossed inside the rows."""
    model = arch_model(arch, len(tiny_tokenizer))
    decoder = FastDecoder(model, "f32", threads=threads)
    ids = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    one, rows = decoder.new_cache(), decoder.new_cache()
    with torch.no_grad():
        for cache in (one, rows):
            model(input_ids=torch.tensor([ids[:4]]), cache=cache, use_cache=True)
    for token in ids[4:16]:
        alone = decoder.decode(one, token)
    together = decoder.prefill_rows(rows, ids[4:16])
    assert torch.equal(together, alone)
    for a, b in zip(one.layers, rows.layers):
        assert a.length == b.length == 16
        assert torch.equal(a._k[..., :16, :], b._k[..., :16, :]) and torch.equal(
            a._v[..., :16, :], b._v[..., :16, :]
        )
    assert torch.allclose(together, full_logits(model, ids[:16])[-1], atol=1e-4)
    # and a decode step after them sees them as its own
    assert torch.allclose(decoder.decode(rows, ids[16]), full_logits(model, ids[:17])[-1], atol=1e-4)


def test_prefill_rows_takes_up_to_max_batch_tokens(tiny_tokenizer):
    model = arch_model("qwen2", len(tiny_tokenizer))
    decoder = FastDecoder(model, "f32", threads=1)
    cache = decoder.new_cache()
    with pytest.raises(ValueError, match="prefill_rows takes 1 to"):
        decoder.prefill_rows(cache, list(range(3, 4 + decoder.max_batch)))
    with pytest.raises(ValueError, match="prefill_rows takes 1 to"):
        decoder.prefill_rows(cache, [])
    # an empty cache takes a whole short prompt this way
    logits = decoder.prefill_rows(cache, [5, 6, 7])
    assert torch.allclose(logits, full_logits(model, [5, 6, 7])[-1], atol=1e-4)
