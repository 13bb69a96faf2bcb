"""What the native path of a GGUF model uses instead of transformers (`import transformers`
alone is ~1 s of a one-shot answer: docs/benchmarks.md, "Start-up"), each against
transformers' own class as the reference: the config (`chatbot.gguf.config.ModelConfig`
against `PreTrainedConfig`), our model's generation config (`skeleton.GenerationDefaults`
against `GenerationConfig.from_model_config`)."""

from __future__ import annotations

import json

import pytest

CONFIGS = {
    "smollm2": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.02,
        "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
        "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "tie_word_embeddings": True, "unk_token_id": 0, "use_cache": True, "vocab_size": 49152,
    },
    "windowed": {
        "model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "sliding_window": 32, "eos_token_id": [2, 7], "bos_token_id": 1,
        "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    },
    "hybrid": {
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 3, "sliding_window": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "eos_token_id": 1,
        "temperature": 0.6, "top_p": 0.9,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_our_config_reads_as_transformers_plain_config(tmp_path, name):
    """Every attribute of transformers' plain config (less its private ones) is ours, with
    the same value; the caches and the generation config made from either are the same."""
    from transformers.cache_utils import DynamicCache
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.generation.configuration_utils import GenerationConfig

    from chatbot.gguf.config import ModelConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]), encoding="utf-8")
    theirs, ours = PreTrainedConfig.from_json_file(str(path)), ModelConfig.from_json_file(path)
    own = ("id2label", "label2id", "transformers_version")  # a classifier's labels, its version
    public = {k: v for k, v in vars(theirs).items() if not k.startswith("_") and k not in own}
    assert {k: getattr(ours, k) for k in public} == public
    assert set(ours.to_dict()) == {*public, "output_attentions"}  # (theirs: _output_attentions)
    assert ours.output_attentions is theirs.output_attentions is False
    assert ours.get_text_config(decoder=True) is ours
    assert not hasattr(ours, "sliding_window") or ours.sliding_window == theirs.sliding_window
    layers = [type(layer) for layer in DynamicCache(config=ours).layers]
    assert layers == [type(layer) for layer in DynamicCache(config=theirs).layers] and layers
    kinds = {
        k: getattr(layer, "sliding_window", None) for k, layer in enumerate(DynamicCache(config=ours).layers)
    }
    assert kinds == {
        k: getattr(layer, "sliding_window", None)
        for k, layer in enumerate(DynamicCache(config=theirs).layers)
    }
    mine, other = GenerationConfig.from_model_config(ours), GenerationConfig.from_model_config(theirs)
    assert mine.to_dict() == other.to_dict()
    with pytest.raises(AttributeError):
        _ = ours.no_such_setting


def test_the_generation_settings_our_config_drops_are_those_transformers_drops():
    from transformers.generation.configuration_utils import GenerationConfig

    from chatbot.gguf.config import GENERATION_KEYS

    assert set(GENERATION_KEYS) == set(GenerationConfig._get_default_generation_params())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_our_generation_config_gives_what_transformers_gives(tmp_path, name):
    """The token ids, the sampling defaults a model ships (`sampling_from_model`), the stop
    ids a template adds, and transformers' own object for `generate`'s builders: the same
    from `GenerationDefaults` as from transformers' `GenerationConfig`."""
    import types

    from transformers.configuration_utils import PreTrainedConfig
    from transformers.generation.configuration_utils import GenerationConfig

    from chatbot.engine.backends.native.skeleton import GenerationDefaults
    from chatbot.engine.sampling import sampling_from_model
    from chatbot.gguf.config import ModelConfig
    from chatbot.models.templates import _add_eos_ids

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]), encoding="utf-8")
    config = ModelConfig.from_json_file(path)
    ours = types.SimpleNamespace(generation_config=GenerationDefaults.from_model_config(config))
    theirs = types.SimpleNamespace(
        generation_config=GenerationConfig.from_model_config(PreTrainedConfig.from_json_file(str(path)))
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours.generation_config, key) == getattr(theirs.generation_config, key)
    assert sampling_from_model(ours) == sampling_from_model(theirs)
    assert sampling_from_model(ours, temperature=0.3) == sampling_from_model(theirs, temperature=0.3)
    for model in (ours, theirs):
        _add_eos_ids(model, [5, 2])
    assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id
    assert ours.generation_config.to_transformers(config).to_dict() == theirs.generation_config.to_dict()


TEXTS = [
    "Hi", "", " ", "  leading and trailing  ", "Hello, world! How's it going?", "line one\nline two\n\n\ttab",
    "naïve café — déjà vu, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and emoji 🤖👍🏽, 日本語のテキスト, русский текст, العربية",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "a<|im_end|>b<|endoftext|>c<repo_name>d",
    "<|im_start|> spaced <|im_end|>", "def f(x):\n    return x ** 2  # code\n", "1234567890 3.14159 1e-9",
    "ÀÉÎÕÜ ß ø å æ", "\u200b zero\u00a0width", "x" * 300, "The quick brown fox. " * 20,
    "don't won't I'm you're they've it's", "<", "<|", "<|im_start", "|>",
]  # fmt: skip
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! ☺"},
     {"role": "user", "content": "Again\n"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "<|im_end|> inside"}],
]  # fmt: skip
RICH_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif -%}"
    "{%- if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{% continue %}{% endif -%}"
    "{%- set ns.n = ns.n + 1 -%}"
    "{{ bos_token }}{{ m.role }}:{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
    "{% generation %}{{ m.content | trim }}{% endgeneration %}{{ eos_token }}\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ bos_token }}assistant ({{ ns.n }}, {{ dict(a=1) | tojson }}, "
    "{{ strftime_now('%Y') | length }}, {{ enable_thinking | default('unset') }}):{% endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in «a city»",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def default_tokenizer_folder(tmp_path_factory):
    """The default model's tokenizer cache, as a load writes it (transformers reads the GGUF)."""
    from chatbot.models.gguf_model import load_config_and_tokenizer, metadata_key
    from chatbot.models.source import default_gguf_path

    path = default_gguf_path()
    folder = tmp_path_factory.mktemp("cache") / f"{path.stem}-{metadata_key(path)}"
    load_config_and_tokenizer(path, folder, [])
    return folder


def both(folder):
    from transformers import TokenizersBackend

    from chatbot.gguf.tokenizer import Tokenizer

    ours = Tokenizer.from_folder(folder)
    assert ours is not None
    return ours, TokenizersBackend.from_pretrained(str(folder))


def test_our_tokenizer_encodes_and_decodes_as_transformers(default_tokenizer_folder):
    ours, theirs = both(default_tokenizer_folder)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "unk_token_id", "pad_token_id", "all_special_tokens", "all_special_ids",
                 "special_tokens_map", "chat_template", "vocab_size", "model_max_length",
                 "name_or_path"):  # fmt: skip
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    for text in TEXTS:
        for special in (True, False):
            for split in (False, True):
                kw = {"add_special_tokens": special, "split_special_tokens": split}
                assert ours(text, **kw)["input_ids"] == theirs(text, **kw)["input_ids"], (text, kw)
            kw = {"add_special_tokens": special, "return_offsets_mapping": True}
            mine, other = ours(text, **kw), theirs(text, **kw)
            assert mine["offset_mapping"] == other["offset_mapping"] and (
                mine["offset_mapping"] or not text
            ), text
            ids = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
            for skip in (False, True):
                for clean in (None, True, False):
                    kw = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": clean}
                    assert ours.decode(ids, **kw) == theirs.decode(ids, **kw), (text, kw)
    assert ours.decode(5) == theirs.decode(5) and ours.convert_ids_to_tokens(
        7
    ) == theirs.convert_ids_to_tokens(7)
    tokens = ["<|im_start|>", "Hello", "not-a-token-at-all"]
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)


def test_our_chat_template_renders_as_transformers(default_tokenizer_folder, tmp_path):
    """The default model's template, then a template that uses what transformers' sandbox
    offers (tools, tojson, namespace, dict, raise_exception, strftime_now, loop controls, the
    generation tag, reasoning aliases, keyword arguments), on the same files."""
    import shutil

    import jinja2

    ours, theirs = both(default_tokenizer_folder)
    for chat in CONVERSATIONS:
        for prompt in (False, True):
            want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == want
    rich = tmp_path / "rich"
    shutil.copytree(default_tokenizer_folder, rich)
    (rich / "chat_template.jinja").write_text(RICH_TEMPLATE, encoding="utf-8")
    ours, theirs = both(rich)
    reasoning = [{"role": "user", "content": " q "}, {"role": "assistant", "content": "a", "thinking": "hmm"}]
    tool_use = [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": '{"t": 3}'}]
    for chat in [*CONVERSATIONS, reasoning, tool_use]:
        for kwargs in ({}, {"tools": TOOLS}, {"enable_thinking": False}, {"add_generation_prompt": True}):
            want = theirs.apply_chat_template(chat, tokenize=False, **kwargs)
            assert ours.apply_chat_template(chat, tokenize=False, **kwargs) == want, kwargs
    for bad in ([{"role": "bad", "content": "x"}],):
        with pytest.raises(jinja2.TemplateError, match="no bad roles"):
            theirs.apply_chat_template(bad, tokenize=False)
        with pytest.raises(jinja2.TemplateError, match="no bad roles"):
            ours.apply_chat_template(bad, tokenize=False)
    (rich / "chat_template.jinja").write_text(
        "{% set ns = namespace() %}{% set ns._x = 1 %}", encoding="utf-8"
    )
    ours, theirs = both(rich)
    for tokenizer in (ours, theirs):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    # what this class does not do itself is transformers' answer
    ours, theirs = both(default_tokenizer_folder)
    assert ours.apply_chat_template(CONVERSATIONS[1]) == theirs.apply_chat_template(CONVERSATIONS[1])
