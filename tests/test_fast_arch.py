"""The fast decode path on the other architectures it runs: qwen2 (q/k/v bias), qwen3 (q/k
RMSNorm per head), and llama with attention and MLP biases. Each tiny random model is checked
against transformers: logits after every native step against a full recompute, greedy tokens
against a recompute, and a streaming conversation (sink cache evicting and re-rotating keys
with the model's own rope) against the plain engine."""

from __future__ import annotations

import pytest
import torch
from helpers import full_logits, greedy_by_recompute, make_model, needs_kernels

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.engine.fast import FastDecoder
from chatbot.engine.generate import Engine
from chatbot.session import ChatSession

pytestmark = needs_kernels

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=48)
# Each architecture with what sets it apart: q/k RMSNorm per head (qwen3, with a head size
# other than hidden / heads), biases (llama-bias); qwen2 has q/k/v biases of its own.
ARCH_SETTINGS = {
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3", "head_dim": 32},
    "llama-bias": {"arch": "llama", "attention_bias": True, "mlp_bias": True},
}


def arch_model(arch: str, vocab: int):
    """A tiny random model of `arch` with non-trivial biases and norm weights (seed 7)."""
    return make_model(vocab, seed=7, randomize=True, **ARCH_SETTINGS[arch])


ARCHS = list(ARCH_SETTINGS)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_full_recompute(arch, tiny_tokenizer):
    model = arch_model(arch, len(tiny_tokenizer))
    decoder = FastDecoder(model, "f32", threads=2)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = decoder.new_cache()
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


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_streaming_rerotation_uses_the_models_rope(arch, tiny_tokenizer):
    """A sink cache small enough to evict while decoding: the fast path gives the plain
    engine's tokens, cache ids and eviction count."""
    model = arch_model(arch, len(tiny_tokenizer))
    with torch.no_grad():  # a rope base of its own, so a default-rope re-rotation would show
        rotary = model.model.rotary_emb
        rotary.inv_freq.copy_(1.0 / (1234.0 ** (torch.arange(0, rotary.inv_freq.numel()) * 2 / (2 * rotary.inv_freq.numel()))))
        rotary.original_inv_freq = rotary.inv_freq.clone()
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=120)
    config = ChatConfig(sampling=sampling, engine=EngineConfig(enable_streaming=True, start_size=4, recent_size=48))
    results = {}
    for name, decoder in [("plain", None), ("fast", FastDecoder(model, "f32"))]:
        session = ChatSession(Engine(model, tiny_tokenizer, decoder=decoder), config)
        got = [[t for c in session.send(text) for t in c.token_ids] for text in ("Hello there!", "The quick fox")]
        results[name] = (got, list(session.cache_ids), session.evicted_total)
        assert session.evicted_total > 0
    assert results["fast"] == results["plain"]
