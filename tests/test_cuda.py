"""On an NVIDIA GPU: the engine in bfloat16 and with bitsandbytes 4/8-bit weights.

Skipped without CUDA (run by `scripts/gpu-check` on a machine that has one). Each test
compares with an independent reference: transformers' own forward passes on the same
model, recomputing the whole sequence every step.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from chatbot.config import SamplingConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


def _greedy_engine(model, tokenizer, ids: list[int], n: int) -> list[int]:
    from chatbot.engine.generate import Engine

    engine = Engine(model, tokenizer)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=n)
    out: list[int] = []
    for chunk in engine.generate(engine.new_cache(), ids, sampling):
        out.extend(chunk.token_ids)
    return out


def _greedy_recompute(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq], device=model.device)).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
    return seq[len(ids) :]


def test_engine_on_cuda_bf16_matches_recomputation(tiny_tokenizer) -> None:
    """The persistent cache on the GPU gives the tokens that recomputing the whole
    sequence gives (float32 keeps ties out of the way on a random tiny model)."""
    from helpers import make_model

    model = make_model(len(tiny_tokenizer)).to("cuda", torch.float32).eval()
    ids = tiny_tokenizer("hello there, how are you", add_special_tokens=False)["input_ids"]
    assert _greedy_engine(model, tiny_tokenizer, ids, 12) == _greedy_recompute(model, ids, 12)
    assert next(model.parameters()).device.type == "cuda"


def test_default_model_bf16_on_cuda_stays_close_to_float32(default_model) -> None:
    """SmolLM2 in bfloat16 on the GPU: the next-token distribution stays close to float32's
    on the CPU (top token of the prompt equal, logits within bf16 rounding)."""
    from chatbot.models.loader import load_model

    gpu = load_model(None, device="cuda", dtype="bfloat16")
    ids = default_model.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        ref = default_model.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        got = gpu.model(input_ids=torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu()
    assert int(torch.argmax(got)) == int(torch.argmax(ref))
    assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.99


@needs_bnb
@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_bitsandbytes_loads_and_chats(bits: str) -> None:
    """--quantize 4bit/8bit on CUDA: the weights are bitsandbytes layers, the model answers,
    and its first greedy token after a plain prompt is among the float reference's top 5."""
    from chatbot.models.loader import load_model

    loaded = load_model(None, device="cuda", dtype="bfloat16", quantize=bits)
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert kinds & {"Linear4bit", "Linear8bitLt"}
    ref = load_model(None, device="cuda", dtype="bfloat16")
    ids = loaded.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        top5 = torch.topk(ref.model(input_ids=torch.tensor([ids], device="cuda")).logits[0, -1], 5).indices
    answer = _greedy_engine(loaded.model, loaded.tokenizer, ids, 8)
    assert len(answer) == 8
    assert answer[0] in top5.tolist()


def test_compiled_step_on_cuda_equals_eager_with_evictions_and_no_syncs(tiny_tokenizer) -> None:
    """`--opt compile` on CUDA (CUDA graphs): 256 greedy tokens with evictions equal the eager
    step's; inside the decode loop after warm-up no host synchronization (sync debug mode
    "error" raises on one) and no recompile."""
    from helpers import make_model

    from chatbot.engine.backends.base import HFBackend
    from chatbot.engine.backends.compiled import CompiledBackend
    from chatbot.engine.generate import Engine

    model = make_model(len(tiny_tokenizer)).to("cuda", torch.bfloat16)
    ids = tiny_tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]

    def greedy(backend, check: bool) -> list[int]:
        engine = Engine(model, tiny_tokenizer, backend=backend)
        kv = engine.new_cache(4, 60)
        out: list[int] = []
        with torch.inference_mode():
            logits = engine.prefill(kv, ids)
            for i in range(256):
                token = int(logits.argmax())
                out.append(token)
                kv.evict_for(1)  # (an eviction copies rotations to the device: outside the check)
                checked = check and i >= 8  # after warm-up
                if checked:
                    torch._dynamo.config.error_on_recompile = True
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    logits = backend.step(kv.cache, token)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    torch._dynamo.config.error_on_recompile = False
                kv.feed((token,))
        assert kv.evicted_total > 100
        return out

    assert greedy(CompiledBackend(model), True) == greedy(HFBackend(model), False)


def test_device_loop_on_cuda_reads_back_nothing_per_token(tiny_tokenizer) -> None:
    """`--opt compile` on CUDA: a sampled turn (top-k, top-p, repetition penalty) through
    `Engine.generate` makes no more synchronizing calls (sync debug mode "warn") for 200
    tokens than for 40: the token is read one step late through pinned memory and an event,
    nothing else waits for the device per token. And a seed gives the host loop's answer."""
    import warnings

    from helpers import make_model

    from chatbot.engine.backends.base import HFBackend
    from chatbot.engine.backends.compiled import CompiledBackend
    from chatbot.engine.generate import Engine
    from chatbot.engine.sampling import seeded_generator

    model = make_model(len(tiny_tokenizer)).to("cuda", torch.bfloat16)
    ids = tiny_tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    compiled = Engine(model, tiny_tokenizer, backend=CompiledBackend(model))

    def turn(engine, n: int, seed: int = 1) -> list[int]:
        sampling = SamplingConfig(
            temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2, max_new_tokens=n
        )
        generator = seeded_generator(engine.device, seed)
        return [
            t
            for c in engine.generate(engine.new_cache(), ids, sampling, generator=generator)
            for t in c.token_ids
        ]

    def syncs(n: int) -> int:
        turn(compiled, n)  # compiles
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert len(turn(compiled, n)) == n
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    assert syncs(200) == syncs(40)
    assert turn(compiled, 64, seed=9) == turn(
        Engine(model, tiny_tokenizer, backend=HFBackend(model)), 64, seed=9
    )
