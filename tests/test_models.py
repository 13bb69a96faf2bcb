"""Any model a user brings: five families saved as folders, a GGUF written here, the hub
cache, device maps with disk offload, and every kind of bad input as one line, exit 2."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CHATML, assert_one_line_error, cli, make_model, make_tokenizer, write_tiny_gguf

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine
from chatbot.errors import ConfigError, ModelLoadError, StreamingUnsupportedError
from chatbot.models import loader
from chatbot.models.loader import load_model, parse_device_map, parse_max_memory


def build(family: str, vocab: int):
    """A tiny random model of a family (seed 0): the tests' sharpened Llama, the others with
    transformers' plain init."""
    if family == "llama":
        return make_model(vocab)
    extra = {"sliding_window": None} if family == "mistral" else {}
    return make_model(vocab, arch=family, sharp=False, **extra)


FAMILIES = ["llama", "mistral", "qwen2", "phi3", "gpt2"]
ROPE_FAMILIES = ["llama", "mistral", "qwen2", "phi3"]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def save(tmp_path: Path, family: str, tok, name: str | None = None) -> Path:
    folder = tmp_path / (name or family)
    build(family, len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def chat(loaded, turns, **engine):
    session = ChatSession(
        Engine(loaded.model, loaded.tokenizer),
        ChatConfig(
            system="Be brief.",
            sampling=SamplingConfig(temperature=0, max_new_tokens=6),
            engine=EngineConfig(**engine),
        ),
    )
    for text in turns:
        chunks = list(session.send(text))
        assert chunks[-1].finish_reason in ("stop", "length")
    return session


# -- families -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_two_turn_chat(family, tmp_path, tok):
    loaded = load_model(str(save(tmp_path, family, tok)), device="cpu")
    assert loaded.kind == "folder" and loaded.model.config.model_type == family
    assert loaded.describe()["template"] == "tokenizer"
    session = chat(loaded, ["Hello there, how are you?", "The quick brown fox."])
    assert loaded.tokenizer.decode(session.all_ids) == session.rendered
    assert len(session.turns) == 2
    # the second turn fed only its own tokens; the first turn's stayed in the cache
    assert session.turns[1].stats.context_tokens < len(session.all_ids) // 2 + 8
    assert session.cache.get_seq_length() == len(session.cache_ids)


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_two_turn_chat_with_the_streaming_cache(family, tmp_path, tok):
    loaded = load_model(str(save(tmp_path, family, tok)), device="cpu")
    session = chat(
        loaded,
        [
            "Hello there, how are you today? I am fine, thank you.",
            "The quick brown fox jumps over the lazy dog.",
        ],
        enable_streaming=True,
        start_size=4,
        recent_size=16,
    )
    assert session.evicted_total > 0
    # The system prompt is pinned (--keep-system is on with a system prompt): the window is
    # the pinned tokens plus the 16 recent ones.
    pinned = session.system_prompt_tokens()
    assert session.cache.pinned == max(4, pinned)
    assert session.cache.get_seq_length() == len(session.cache_ids) <= session.cache.pinned + 16
    assert loaded.tokenizer.decode(session.all_ids) == session.rendered


def test_gpt2_is_refused_for_streaming(tmp_path, tok, capsys):
    folder = save(tmp_path, "gpt2", tok)
    loaded = load_model(str(folder), device="cpu")
    with pytest.raises(StreamingUnsupportedError, match="rotary position embeddings; gpt2 uses learned"):
        chat(loaded, ["Hello"], enable_streaming=True, recent_size=16)
    assert_one_line_error(
        capsys,
        "run",
        "--model",
        str(folder),
        "--device",
        "cpu",
        "--enable-streaming",
        match="gpt2 uses learned absolute positions",
    )


def test_describe_shows_what_the_banner_needs(tmp_path, tok):
    loaded = load_model(str(save(tmp_path, "qwen2", tok)), device="cpu", dtype="bfloat16", template="chatml")
    d = loaded.describe()
    assert d["model"] == "qwen2" and d["dtype"] == "bfloat16" and d["device"] == "cpu"
    assert d["quantization"] == "none" and d["context"] == "512" and d["template"] == "chatml"
    assert d["parameters"].endswith("M") and d["load time"].endswith(" s")


# -- GGUF ---------------------------------------------------------------------------------------


def test_gguf_loads_as_the_model_it_was_written_from(tiny_gguf, monkeypatch):
    """A GGUF file runs as it is: no converted copy, every matrix a packed module over the
    file's bytes, the same logits as the model it was written from; the second load takes
    the config and tokenizer from the small cache instead of parsing the file's vocabulary."""
    from chatbot.engine.backends.native.packed import PackedEmbedding, PackedLinear

    def no_conversion(*a, **k):
        raise AssertionError("converted")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    path, model, tok = tiny_gguf
    loaded = load_model(str(path), device="cpu")
    assert loaded.kind == "gguf" and loaded.name == "tiny" and loaded.notes == []
    assert isinstance(loaded.model.model.embed_tokens, PackedEmbedding)
    assert isinstance(loaded.model.model.layers[0].self_attn.q_proj, PackedLinear)
    assert loaded.num_parameters == sum(p.numel() for p in model.parameters())
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert not list(loader.cache_root().rglob("*.safetensors"))
    text = "Hello there! How are you today? Café 🙂"
    ids = tok(text)["input_ids"]
    assert loaded.tokenizer(text)["input_ids"] == ids
    assert loaded.tokenizer.chat_template == CHATML
    with torch.no_grad():
        for n in (1, 3, len(ids)):  # the matrix-vector and the dequantize-then-GEMM products
            x = torch.tensor([ids[:n]])
            torch.testing.assert_close(loaded.model(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)
    session = chat(loaded, ["Hello there", "How are you?"])
    assert loaded.tokenizer.decode(session.all_ids) == session.rendered

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    def no_parse(*a, **k):
        raise AssertionError("parsed the file's metadata again")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_parse)
    again = load_model(str(path), device="cpu")
    assert again.notes == [] and again.tokenizer(text)["input_ids"] == ids


def test_gguf_tokenizer_cache_is_rebuilt_when_corrupt(tiny_gguf):
    path, _, tok = tiny_gguf
    load_model(str(path), device="cpu")
    (cached,) = loader.cache_root().glob("gguf-meta/*/tokenizer.json")
    with cached.open("r+b") as f:
        f.truncate(cached.stat().st_size // 2)
    again = load_model(str(path), device="cpu")
    assert any("rebuilt" in n for n in again.notes)
    assert again.tokenizer("Hello there")["input_ids"] == tok("Hello there")["input_ids"]
    assert load_model(str(path), device="cpu").notes == []


def test_gguf_converted_copy_is_rebuilt_when_corrupt(tiny_gguf):
    """bfloat16 cannot run from the blocks: such a load goes through a converted copy."""
    path, _, _ = tiny_gguf
    load_model(str(path), device="cpu", dtype="bfloat16")
    weights = loader.converted_dir(path) / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    again = load_model(str(path), device="cpu", dtype="bfloat16")
    assert any("rebuilt" in n for n in again.notes)
    assert load_model(str(path), device="cpu", dtype="bfloat16").notes == []


def test_gguf_copy_is_keyed_by_content(tiny_gguf):
    path, _, _ = tiny_gguf
    first = loader.converted_dir(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one weight byte changes: a different file, a different copy
    path.write_bytes(bytes(data))
    assert loader.converted_dir(path) != first


def test_truncated_gguf_is_one_line(tiny_gguf, capsys):
    path, _, _ = tiny_gguf
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    assert_one_line_error(capsys, "run", "--model", str(path), match="cannot read GGUF file")
    with pytest.raises(ModelLoadError, match="truncated"):
        loader.check_gguf(path)


# -- hub ids ----------------------------------------------------------------------------------


def test_hub_id_loads_from_the_local_cache_offline(tmp_path, tok, monkeypatch):
    import huggingface_hub.constants as hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snap = repo / "snapshots" / commit
    build("llama", len(tok)).save_pretrained(snap)
    tok.save_pretrained(snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("tiny-org/tiny-llama", device="cpu")
    assert loaded.kind == "hub" and loaded.name == "tiny-org/tiny-llama"
    chat(loaded, ["Hello"])

    from chatbot.models.catalog import hub_models

    assert [m.name for m in hub_models()] == ["tiny-org/tiny-llama"]


def _stand_in_cli(hub, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """chatbot ARGS in a process whose huggingface_hub uses the stand-in `hub` (its endpoint
    is read when huggingface_hub is imported)."""
    env = {**os.environ, **hub.env(tmp_path)}
    env.pop("HF_HUB_OFFLINE", None)
    argv = [sys.executable, "-m", "chatbot.cli", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=False)


def test_hub_repo_with_pytorch_weights_only(tmp_path, tok):
    """A repo without safetensors (older ones: Vicuna, Colossal-LLaMA-2) gets its .bin
    weights, from a stand-in hub on loopback through huggingface_hub, and answers as the
    same folder read from disk."""
    from hub_standin import StandInHub
    from safetensors.torch import load_file

    src = tmp_path / "src"
    build("llama", len(tok)).save_pretrained(src)
    tok.save_pretrained(src)
    (src / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((src / "tokenizer_config.json").read_text()), "chat_template": CHATML})
    )
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    hub = StandInHub({"old-org/old-model": {p.name: p for p in src.iterdir()}})
    ask = ["--greedy", "--max-new-tokens", "8", "--no-stats", "Hello there"]
    try:
        pulled = _stand_in_cli(hub, tmp_path, "run", "--model", "old-org/old-model", "--revision", "v1", *ask)
    finally:
        hub.close()
    assert pulled.returncode == 0, pulled.stderr
    got = {path.rsplit("/", 1)[-1] for method, path, _ in hub.requests if "/resolve/" in path}
    assert "pytorch_model.bin" in got and "config.json" in got
    local = _stand_in_cli(hub, tmp_path, "run", "--model", str(src), *ask)
    assert local.returncode == 0, local.stderr
    assert pulled.stdout == local.stdout


def test_a_gguf_repo_named_without_a_quant_lists_its_quants(tmp_path):
    from hub_standin import StandInHub

    hub = StandInHub({"gg/model-GGUF": {"model-Q4_K_M.gguf": b"GGUF", "model-Q8_0.gguf": b"GGUF"}})
    try:
        done = _stand_in_cli(hub, tmp_path, "run", "--model", "gg/model-GGUF", "hi")
    finally:
        hub.close()
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "chatbot: error: gg/model-GGUF holds GGUF files: name one; it has: Q4_K_M, Q8_0 "
        "(e.g. gg/model-GGUF:Q8_0)"
    )


def test_hub_id_missing_offline_is_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_one_line_error(
        capsys,
        "run",
        "--model",
        "nobody/nothing",
        "--revision",
        "v2",
        match="nobody/nothing@v2 is not in the local hub cache and HF_HUB_OFFLINE is set",
    )


# -- device maps ------------------------------------------------------------------------------


def test_device_map_with_disk_offload(tmp_path, tok, monkeypatch):
    """One layer on disk (accelerate's offload): same logits, and both caches still work,
    each layer's cache on the device its layer computes on."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = save(tmp_path, "llama", tok)
    reference = build("llama", len(tok))
    placement = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    loaded = load_model(str(folder), device="cpu", device_map=json.dumps(placement))
    assert loaded.devices == ["cpu", "disk"] and loaded.describe()["device"] == "cpu, disk"
    assert str(loaded.device) == "cpu"
    x = torch.tensor([tok("Hello there! How are you?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x).logits, reference(x).logits)
    chat(loaded, ["Hello there, how are you today?", "The quick brown fox."])
    session = chat(
        loaded,
        ["Hello there, how are you today?", "The quick brown fox."],
        enable_streaming=True,
        recent_size=16,
    )
    assert session.evicted_total > 0


def test_max_memory_implies_device_map_auto(tmp_path, tok, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = save(tmp_path, "llama", tok)
    # 300 KB: the embeddings (100 KB) and the head stay on the CPU, the layers go to disk
    loaded = load_model(str(folder), device="cpu", max_memory="cpu=300KB")
    assert loaded.devices == ["cpu", "disk"]
    chat(loaded, ["Hello"], enable_streaming=True, recent_size=16)
    assert_one_line_error(
        capsys,
        "run",
        "--model",
        str(folder),
        "--max-memory",
        "cpu=150KB",
        match="offloads the input embeddings",
    )


def test_device_map_and_max_memory_parsing(tmp_path):
    assert parse_device_map("auto") == "auto"
    assert parse_device_map('{"": "cpu"}') == {"": "cpu"}
    f = tmp_path / "map.json"
    f.write_text('{"model": 0}')
    assert parse_device_map(str(f)) == {"model": 0}
    with pytest.raises(ConfigError, match="--device-map must be auto"):
        parse_device_map("everywhere")
    assert parse_max_memory("0=20GiB, cuda:1=10GiB,cpu=64GiB") == {0: "20GiB", 1: "10GiB", "cpu": "64GiB"}
    for bad in ("gpu=1GiB", "0=", "cpu=lots"):
        with pytest.raises(ConfigError, match="--max-memory entries look like"):
            parse_max_memory(bad)


# -- bad input: one line, exit 2, no traceback ----------------------------------------------------


def test_path_that_does_not_exist(capsys, tmp_path):
    nowhere = tmp_path / "nowhere"
    assert_one_line_error(capsys, "run", "--model", str(nowhere), match=f"no such file or folder: {nowhere}")


def test_folder_without_config(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(capsys, "run", "--model", str(tmp_path / "empty"), match="no config.json")


def test_truncated_safetensors(capsys, tmp_path, tok):
    folder = save(tmp_path, "llama", tok)
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 1000)
    line = assert_one_line_error(capsys, "run", "--model", str(folder), match="is truncated")
    assert f"({size - 1000} of {size} bytes)" in line
    weights.write_bytes(b"\x00" * 16)
    assert_one_line_error(capsys, "run", "--model", str(folder), match="is corrupt (unreadable header)")


def test_missing_shard(capsys, tmp_path, tok):
    folder = save(tmp_path, "llama", tok)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00002.safetensors"}})
    )
    assert_one_line_error(capsys, "run", "--model", str(folder), match="lacks 1 of 1 weight files")


def test_non_causal_model(capsys, tmp_path, tok):
    from transformers import BertConfig, BertModel

    folder = tmp_path / "bert"
    BertModel(
        BertConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
        )
    ).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert_one_line_error(
        capsys,
        "run",
        "--model",
        str(folder),
        match="holds a bert model (BertModel): an encoder, not a causal language model",
    )


def test_encoder_decoder_model(capsys, tmp_path, tok):
    from transformers import T5Config, T5ForConditionalGeneration

    folder = tmp_path / "t5"
    T5ForConditionalGeneration(
        T5Config(vocab_size=len(tok), d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    ).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert_one_line_error(capsys, "run", "--model", str(folder), match="an encoder-decoder model")


NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
)


def test_template_that_cannot_render_a_system_prompt(capsys, tmp_path):
    tok = make_tokenizer()
    tok.chat_template = NO_SYSTEM
    folder = tmp_path / "nosys"
    make_model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    assert_one_line_error(
        capsys,
        "run",
        "--model",
        str(folder),
        "--system",
        "Be brief.",
        match="cannot render a system prompt (System role not supported)",
    )


def test_out_of_memory_load(capsys, tmp_path, tok, monkeypatch):
    from transformers import AutoModelForCausalLM

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    folder = save(tmp_path, "llama", tok)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", oom)
    assert_one_line_error(capsys, "run", "--model", str(folder), match="not enough memory to load")
    monkeypatch.setattr(
        AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: (_ for _ in ()).throw(
            RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory")
        ),
    )
    assert_one_line_error(capsys, "run", "--model", str(folder), match="try --quantize 4bit")


def test_custom_code_needs_trust_remote_code(capsys, tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "my_secret_arch", "auto_map": {"AutoConfig": "configuration_x.XConfig"}})
    )
    assert_one_line_error(capsys, "run", "--model", str(folder), match="rerun with --trust-remote-code")


@pytest.mark.skipif(importlib.util.find_spec("optimum") is not None, reason="optimum is installed")
def test_prequantized_checkpoint_names_the_missing_package(capsys, tmp_path, tok):
    folder = save(tmp_path, "llama", tok)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False}
    (folder / "config.json").write_text(json.dumps(config))
    assert_one_line_error(
        capsys, "run", "--model", str(folder), match="is a gptq 4-bit checkpoint, which needs"
    )
    assert_one_line_error(
        capsys, "run", "--model", str(folder), "--quantize", "4bit", match="already quantized"
    )


def test_unknown_template_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert_one_line_error(
        capsys, "run", "--template", "alpaca", match="unknown template 'alpaca'; templates: auto"
    )


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    import chatbot.cli.app

    monkeypatch.setattr(chatbot.cli.app, "_DEBUG", False)  # --debug sets it for the process: undo after
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        chatbot.cli.app.main(["run", "--model", str(tmp_path / "nowhere"), "--debug"])


# -- chatbot models ---------------------------------------------------------------------------


def test_models_lists_presets_caches_and_folders(capsys, tmp_path, tok, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save(tmp_path / "mine", "qwen2", tok, "my-qwen")
    write_tiny_gguf(tmp_path / "mine" / "tiny.gguf", make_model(len(tok)), tok)
    code, out, err = cli(capsys, "models", str(tmp_path / "mine"))
    assert code == 0, err
    assert "presets (chatbot run --preset NAME):" in out
    for name in ("default", "vicuna", "colossal-llama", "llama-2-chat"):
        assert f"  {name} " in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "folder" in lines["my-qwen"] and "KB" in lines["my-qwen"]
    assert "gguf file" in lines["tiny"]


def test_models_refuses_a_folder_that_does_not_exist(capsys, tmp_path):
    """`chatbot models /nonexistent` listed nothing and exited 0; it is a bad argument."""
    line = assert_one_line_error(capsys, "models", str(tmp_path / "nonexistent"))
    assert "does not exist" in line and "nonexistent" in line
    (tmp_path / "file.txt").write_text("x")
    assert "is not a folder" in assert_one_line_error(capsys, "models", str(tmp_path / "file.txt"))
