"""A llama GGUF file is built as our own model (`chatbot.engine.backends.native.skeleton`), not
transformers' `LlamaForCausalLM`: the same modules by the same names, and the same logits bit
for bit, against transformers' class filled with the same packed weights (the reference is
built with `gguf_model._skeleton` swapped for transformers' `from_config`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import needs_kernels

from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf


def transformers_twin(path, monkeypatch):
    """The packed model of `path` on transformers' class and config (the former build)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from chatbot.models import gguf_model
    from chatbot.models.loader import load_model
    from chatbot.models.manifest import cache_root

    loaded = load_model(str(path))  # writes the config/tokenizer cache
    cache = next(iter(cache_root().glob(f"gguf-meta/{path.stem}-*")))
    with monkeypatch.context() as m:
        m.setattr(gguf_model, "_skeleton", lambda c: AutoModelForCausalLM.from_config(c, dtype=torch.float32))
        twin = gguf_model.build_packed_model(path, AutoConfig.from_pretrained(str(cache)))
    return loaded, twin


def names(model) -> list[str]:
    return sorted(n for n, _ in [*model.named_parameters(), *model.named_buffers()])


def same_logits(ours, theirs, ids: list[int]) -> None:
    """Prefill, a prefill on a filled cache, single steps, and no cache: equal logits."""
    from transformers.cache_utils import DynamicCache

    t = torch.tensor([ids])
    with torch.no_grad():
        mine, other = DynamicCache(config=ours.config), DynamicCache(config=theirs.config)
        pairs = [
            (ours(input_ids=t[:, :12], cache=mine).logits, theirs(input_ids=t[:, :12], cache=other).logits)
        ]
        kw = {"use_cache": True, "logits_to_keep": 1}
        pairs.append((ours(input_ids=t[:, 12:20], cache=mine, **kw).logits,
                      theirs(input_ids=t[:, 12:20], cache=other, **kw).logits))  # fmt: skip
        for i in range(20, len(ids)):
            pairs.append((ours(input_ids=t[:, i : i + 1], cache=mine).logits,
                          theirs(input_ids=t[:, i : i + 1], cache=other).logits))  # fmt: skip
        pairs.append((ours(input_ids=t, use_cache=False).logits, theirs(input_ids=t, use_cache=False).logits))
    for a, b in pairs:
        assert a.shape == b.shape and torch.equal(a, b)


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


@needs_kernels
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
def test_a_llama_file_is_our_model_and_computes_as_transformers(cache_home, monkeypatch, kind):
    from chatbot.config import SamplingConfig
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.generate import Engine

    path = cache_home / f"llama-{kind}.gguf"
    write_synthetic_gguf(path, "llama", SHAPES["llama"]["tiny"], kind, seed=3)
    loaded, twin = transformers_twin(path, monkeypatch)
    ours = loaded.model
    assert type(ours).__module__ == "chatbot.engine.backends.native.skeleton"
    assert type(twin).__name__ == "LlamaForCausalLM"
    assert names(ours) == names(twin)
    assert ours.config.model_type == twin.config.model_type == "llama"
    same_logits(ours, twin, list(range(40, 72)))
    greedy = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=16)
    tokens = []
    for model in (ours, twin):
        engine = Engine(model, loaded.tokenizer, decoder=FastDecoder(model, "auto"))
        tokens.append(
            [t for c in engine.generate(engine.new_cache(), list(range(5, 30)), greedy) for t in c.token_ids]
        )
    assert len(tokens[0]) == 16 and tokens[0] == tokens[1]


@needs_kernels
def test_a_llama3_file_scales_the_rope_of_our_model_as_of_transformers(cache_home, monkeypatch):
    shape = dataclasses.replace(SHAPES["llama"]["tiny"], rope_theta=5e5, llama3_rope=(32.0, 1.0, 4.0, 64))
    path = cache_home / "llama3.gguf"
    write_synthetic_gguf(path, "llama", shape, "Q8_0", seed=2)
    loaded, twin = transformers_twin(path, monkeypatch)
    rotary = loaded.model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, twin.model.rotary_emb.inv_freq)
    assert not torch.equal(rotary.inv_freq, type(rotary)(loaded.model.config).inv_freq)  # scaled
    same_logits(loaded.model, twin, list(range(100, 124)))


@needs_kernels
def test_other_architectures_keep_transformers_classes(cache_home):
    from chatbot.models.loader import load_model

    path = cache_home / "qwen3.gguf"
    write_synthetic_gguf(path, "qwen3", SHAPES["qwen3"]["tiny"], "Q8_0", seed=1)
    assert type(load_model(str(path)).model).__name__ == "Qwen3ForCausalLM"


@needs_kernels
def test_bench_decodes_baseline_gets_transformers_class_with_generate(cache_home, monkeypatch):
    """`chatbot bench decode`'s baseline is transformers' own generate(): its worker loads a
    llama file on transformers' class (CHATBOT_OWN_MODEL=0), which has it; ours has not."""
    from chatbot.models.loader import load_model

    path = cache_home / "llama.gguf"
    write_synthetic_gguf(path, "llama", SHAPES["llama"]["tiny"], "Q8_0", seed=1)
    assert not hasattr(load_model(str(path)).model, "generate")
    monkeypatch.setenv("CHATBOT_OWN_MODEL", "0")
    model = load_model(str(path)).model
    assert type(model).__name__ == "LlamaForCausalLM"
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


@pytest.mark.slow
def test_the_default_model_answers_and_tokenizes_as_through_transformers(monkeypatch):
    """The default model, loaded from its cache without transformers' config, tokenizer and
    model classes (its tokenizer is ours, `chatbot.gguf.tokenizer`): the same greedy tokens,
    ids, decoded text and rendered chat template as transformers' classes give (AutoTokenizer,
    LlamaForCausalLM)."""
    from transformers import AutoTokenizer

    from chatbot.config import SamplingConfig
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.generate import Engine
    from chatbot.models import gguf_model
    from chatbot.models.loader import default_gguf_path
    from chatbot.models.manifest import cache_root

    path = default_gguf_path()
    loaded, twin = transformers_twin(path, monkeypatch)
    cache = cache_root() / "gguf-meta" / f"{path.stem}-{gguf_model.metadata_key(path)}"
    auto = AutoTokenizer.from_pretrained(str(cache))
    mine = loaded.tokenizer
    assert type(mine).__name__ == "Tokenizer" and type(auto).__name__ == "TokenizersBackend"
    assert mine.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert mine.special_tokens_map == auto.special_tokens_map and mine.chat_template == auto.chat_template
    texts = [
        "Hi",
        "A KV cache, explained: ünïcödé 🙂 and\ttabs.\n\n  spaces",
        "<|im_start|>user\nx<|im_end|>",
    ]
    for text in texts:
        assert mine.encode(text) == auto.encode(text)
        assert mine.decode(mine.encode(text)) == auto.decode(auto.encode(text))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = mine.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = mine.encode(rendered)
    same_logits(loaded.model, twin, ids[:24])
    greedy = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=24)
    tokens = []
    for model in (loaded.model, twin):
        engine = Engine(model, mine, decoder=FastDecoder(model, "auto"))
        tokens.append([t for c in engine.generate(engine.new_cache(), ids, greedy) for t in c.token_ids])
    assert len(tokens[0]) >= 8 and tokens[0] == tokens[1]


@needs_kernels
def test_colossal_stream_generate_runs_on_our_model_as_on_transformers(cache_home, monkeypatch):
    """`stream_generate` builds transformers' processors from the model's generation config;
    our model has no `GenerationMixin`, and gets the same processors and tokens."""
    from chatbot.compat.colossal import stream_generate

    path = cache_home / "llama.gguf"
    write_synthetic_gguf(path, "llama", SHAPES["llama"]["tiny"], "Q8_0", seed=4)
    loaded, twin = transformers_twin(path, monkeypatch)
    prompt = torch.tensor([list(range(7, 27))])
    kw = {"max_new_tokens": 8, "do_sample": False, "repetition_penalty": 1.3, "min_new_tokens": 4}
    outs = [list(stream_generate(model, prompt, **kw))[-1] for model in (loaded.model, twin)]
    assert outs[0].shape[1] > prompt.shape[1] and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("groups", [1, 3])
def test_our_attention_is_transformers_sdpa_bit_for_bit(groups):
    """`skeleton.sdpa_attention` against transformers' `sdpa_attention_forward` (the attention
    transformers' Llama runs on the CPU), on random tensors: one query or several, with no
    mask, a boolean mask as the chunked prefill makes, or one per head; grouped heads or not."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from chatbot.engine.backends.native.skeleton import sdpa_attention

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    g = torch.Generator().manual_seed(groups)
    for q_len, kv_len, mask_kind in [(1, 9, None), (7, 7, None), (4, 11, "bool"), (1, 9, "bool"),
                                     (5, 5, "heads"), (1, 6, "heads"), (6, 6, "float")]:  # fmt: skip
        query = torch.randn(1, 2 * groups, q_len, 16, generator=g)
        key, value = (torch.randn(1, 2, kv_len, 16, generator=g) for _ in range(2))
        mask = None
        if mask_kind is not None:
            offset = kv_len - q_len
            mask = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + offset  # [q, kv]
            heads = 2 * groups if mask_kind == "heads" else 1
            mask = mask[None, None].expand(1, heads, q_len, kv_len).contiguous()
            if mask_kind == "float":
                mask = torch.where(mask, 0.0, -1e9) + 0.1 * torch.randn(1, 1, q_len, kv_len, generator=g)
        ours, _ = sdpa_attention(module, query, key, value, mask, scaling=0.25)
        theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
        assert ours.shape == theirs.shape == (1, q_len, 2 * groups, 16)
        assert torch.equal(ours, theirs), (q_len, kv_len, mask_kind)
