"""Shared fixtures: a tiny random Llama with a tokenizer trained in the test, and the real
default model (slow tier)."""

from __future__ import annotations

import os

# Every TrackedCache checks its invariant after each change (also in REPL subprocesses).
os.environ.setdefault("CHATBOT_DEBUG_CACHE", "1")

import pytest
import torch

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "Hello there! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog. Café, naïve, résumé, Zürich.",
    "日本語のテキストと中文文本, emoji 🙂🚀🎉 and symbols like € and ✓.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "You are a helpful assistant. Answer briefly and clearly.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer():
    """A byte-level BPE trained on a few lines, with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHATML
    return fast


def make_llama(vocab_size: int, layers: int = 2, seed: int = 0, attn: str = "sdpa", **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(  # noqa: C408 - keyword form, as LlamaConfig takes them
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    config = LlamaConfig(**{**settings, **overrides})
    config._attn_implementation = attn
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform logits; scale up so greedy choices are well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return make_llama(len(tiny_tokenizer))


@pytest.fixture
def tiny_engine(tiny_model, tiny_tokenizer):
    from chatbot.engine.generate import Engine

    return Engine(tiny_model, tiny_tokenizer)


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct (converted once into the user cache)."""
    from chatbot.models.loader import load_model

    return load_model(None)


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch):
    """Keep session logs and history out of the real home; share the model cache."""
    data = tmp_path_factory.mktemp("data")
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    if "CHATBOT_TEST_CACHE" in os.environ:
        monkeypatch.setenv("XDG_CACHE_HOME", os.environ["CHATBOT_TEST_CACHE"])


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests: the tiny model's many small forward passes
    run fastest so (two threads spin against each other on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
