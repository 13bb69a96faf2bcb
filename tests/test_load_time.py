"""What makes a GGUF load fast without changing what it loads: the collector paused while
loading, the tensor table read once per load (and again when the file changes), and the
cached tokenizer read straight from its tokenizer.json where its class only rebuilds that."""

from __future__ import annotations

import gc
import json

import pytest
from gguf import GGUFReader

from chatbot.engine.backends.native.gguf_weights import read_tensor_table
from chatbot.models.gc_pause import paused_gc
from chatbot.models.loader import cache_root, load_model
from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf

# Text where the pre-tokenizers disagree: NFC folds a decomposed accent (Qwen2's normalizer,
# none in transformers' GGUF reading), digits split one by one, upper-case contractions.
TEXTS = [
    "Hello there! How are you today? Café 🙂",
    "Cafe\u0301 cre\u0300me bru\u0302le\u0301e",
    "I DON'T know, YOU'LL see: 1234567 + 3.14159 = 1234570.14159",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  tabs\tand\n\nnewlines   ",
    "日本語のテキスト, ünïcödé, ascii",
    "",
]


@pytest.fixture(autouse=True)
def _restore_gc():
    yield
    gc.enable()
    gc.unfreeze()


def test_paused_gc_restores_the_collector():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc(freeze=True):  # nested: the outer block decides
            assert not gc.isenabled()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("a failed load")
    assert gc.isenabled()
    gc.disable()  # the host's own pause is left alone
    with paused_gc(freeze=True):
        pass
    assert not gc.isenabled() and gc.get_freeze_count() == 0
    gc.enable()
    with paused_gc(freeze=True):
        made = [[] for _ in range(10)]
    assert gc.isenabled() and gc.get_freeze_count() > len(made)


def test_load_model_pauses_the_collector_and_restores_it(tiny_gguf, monkeypatch):
    from chatbot.models import loader

    seen = []
    real = loader._load_gguf

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(loader, "_load_gguf", spy)
    path, _, _ = tiny_gguf
    load_model(str(path), device="cpu")
    assert seen == [False] and gc.isenabled()
    gc.disable()
    load_model(str(path), device="cpu")
    assert not gc.isenabled()


def _reader_table(path):
    reader = GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    rows = [
        (t.name, tuple(int(n) for n in t.shape), t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]
    return arch, rows


def _rows(table):
    return [(t.name, t.shape, t.type_name, t.offset, t.nbytes) for t in table]


def test_tensor_table_follows_the_file_it_reads(tmp_path):
    """K-quant files as gguf's reader sees them; the same path rewritten with another
    architecture and types is read again, not served from the last read."""
    path = tmp_path / "model.gguf"
    write_synthetic_gguf(path, "qwen2", SHAPES["qwen2"]["tiny"], "Q4_K_M", seed=1)
    arch, table = read_tensor_table(path)
    assert (arch, _rows(table)) == _reader_table(path)
    assert {t.type_name for t in table} >= {"Q4_K", "Q6_K"}
    again = read_tensor_table(path)
    assert _rows(again[1]) == _rows(table)
    write_synthetic_gguf(path, "llama", SHAPES["llama"]["tiny"], "Q8_0", seed=2)
    arch, table = read_tensor_table(path)
    assert arch == "llama" and (arch, _rows(table)) == _reader_table(path)
    other = tmp_path / "other.gguf"
    write_synthetic_gguf(other, "qwen3", SHAPES["qwen3"]["tiny"], "Q4_K_M", seed=3)
    assert (read_tensor_table(other)[0], _rows(read_tensor_table(other)[1])) == _reader_table(other)
    assert _rows(read_tensor_table(path)[1]) == _reader_table(path)[1]


def test_truncated_header_is_a_value_error(tmp_path):
    path = tmp_path / "model.gguf"
    write_synthetic_gguf(path, "llama", SHAPES["llama"]["tiny"], "Q8_0", seed=2)
    data = path.read_bytes()
    path.write_bytes(data[:5000])  # inside the vocabulary
    with pytest.raises(ValueError, match="truncated"):
        read_tensor_table(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensor_table(path)


def _ids(tok, text):
    return tok(text, add_special_tokens=True)["input_ids"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cached_tokenizer_is_the_first_loads_and_its_classs(tmp_path, monkeypatch, arch):
    """The first load (from the file) and the next (from the cache, read straight from
    tokenizer.json: for Qwen2Tokenizer, and for the plain backend class without AutoTokenizer
    and its AutoConfig) tokenize alike, as transformers' own class loads the cached files."""
    from transformers import AutoTokenizer, TokenizersBackend

    from chatbot.gguf.tokenizer import Tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}.gguf"
    write_synthetic_gguf(path, arch, SHAPES[arch]["tiny"], "Q8_0", seed=1)
    first = load_model(str(path), device="cpu").tokenizer
    (folder,) = (cache_root() / "gguf-meta").iterdir()
    manifest = json.loads((folder / "chatbot-manifest.json").read_text())
    assert manifest["fast_tokenizer"] is True
    again = load_model(str(path), device="cpu")
    second = again.tokenizer
    assert again.notes == []
    # the plain backend class is read by our own `Tokenizer` (no transformers import); the
    # others are transformers' classes
    assert type(second) is (Tokenizer if arch == "llama" else TokenizersBackend)
    assert (type(first) is TokenizersBackend) is (arch == "llama")
    own = AutoTokenizer.from_pretrained(str(folder))  # transformers' class, from the cache
    assert type(own).__name__ == ("Qwen2Tokenizer" if arch == "qwen2" else "TokenizersBackend")
    for text in TEXTS:
        assert _ids(first, text) == _ids(second, text) == _ids(own, text), text
        ids = _ids(own, text)
        assert first.decode(ids) == second.decode(ids) == own.decode(ids)
    if arch == "qwen2":  # Qwen2's own normalizer: a decomposed accent is folded
        assert _ids(second, "Cafe\u0301") == _ids(second, "Café")
    messages = [{"role": "user", "content": "hi"}]
    rendered = own.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert second.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    assert second.eos_token == own.eos_token and second.all_special_ids == own.all_special_ids
    assert len(second) == len(own)


def test_a_cache_of_the_plain_backend_class_is_marked_to_be_read_straight(tmp_path, monkeypatch):
    """A cache written before the plain backend class was marked `fast_tokenizer` loads once
    through AutoTokenizer, and is marked then (the next loads skip AutoTokenizer's AutoConfig)."""
    from transformers import TokenizersBackend

    from chatbot.models.manifest import publish, read_manifest, staging

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "llama.gguf"
    write_synthetic_gguf(path, "llama", SHAPES["llama"]["tiny"], "Q8_0", seed=1)
    first = load_model(str(path), device="cpu").tokenizer
    (folder,) = (cache_root() / "gguf-meta").iterdir()
    manifest = read_manifest(folder)
    assert manifest is not None
    with staging(folder) as tmp:  # the cache as an earlier version wrote it
        for name in manifest["files"]:
            (tmp / name).write_bytes((folder / name).read_bytes())
        publish(tmp, folder, gguf=manifest["gguf"], fast_tokenizer=False, added_tokens=True)
    again = load_model(str(path), device="cpu")
    assert again.notes == [] and type(again.tokenizer) is TokenizersBackend
    assert read_manifest(folder)["fast_tokenizer"] is True
    assert again.tokenizer.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()


def test_entry_point_pause_lasts_until_ready():
    from chatbot.models.gc_pause import pause_until_ready, ready

    ready()  # nothing paused: nothing to do
    assert gc.isenabled() and gc.get_freeze_count() == 0
    pause_until_ready()
    assert not gc.isenabled()
    with paused_gc():  # load_model inside the start-up pause leaves it on
        pass
    assert not gc.isenabled()
    ready()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.disable()  # a host that turned the collector off keeps it off
    pause_until_ready()
    ready()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_chatbot_run_turns_the_collector_back_on_for_the_chat(tiny_gguf, monkeypatch):
    """`chatbot run` (the process's own entry, argv from sys.argv) loads with the collector
    paused and chats with it running."""
    import io
    import sys

    from chatbot.cli import app as cli
    from chatbot.terminal import repl

    path, _, _ = tiny_gguf
    seen = []
    real_run = repl.run

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return real_run(*a, **k)

    monkeypatch.setattr(repl, "run", spy)
    monkeypatch.setattr(sys, "argv", ["chatbot", "run", "--model", str(path), "--greedy", "--no-stats",
                                      "--max-new-tokens", "5"])  # fmt: skip
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello there\n/quit\n")))
    cli.main()
    assert seen == [True] and gc.isenabled() and gc.get_freeze_count() > 0


def test_a_cached_load_does_not_import_transformers_gguf_reader(tiny_gguf, tmp_path):
    """Once a file's config and tokenizer are cached, loading it as it is reads its own tensor
    table: a fresh process must not import transformers' GGUF reader (~0.2 s of start-up)."""
    import os
    import subprocess
    import sys

    path, _, _ = tiny_gguf
    script = (
        "import sys; from chatbot.models.loader import load_model; "
        f"m = load_model({str(path)!r}); "
        "print(type(m.model.model.embed_tokens).__name__, "
        "'transformers.modeling_gguf_pytorch_utils' in sys.modules)"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:]
    # the first load reads the metadata through transformers (and caches it), the next does not
    assert [r.stdout.split() for r in runs] == [["PackedEmbedding", "True"], ["PackedEmbedding", "False"]]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_cached_tokenizer_is_read_once_in_the_tokenizers_library(tmp_path, monkeypatch, arch):
    """The cache's tokenizer_config.json lists the added tokens, so a load from the cache does not
    parse tokenizer.json in Python to find them (transformers does when the config lists none:
    0.55 s and ~150 MB at the peak for a 262k-token Gemma vocabulary). Only a class that
    rebuilds its backend from the file's vocabulary (GemmaTokenizer) still reads it, once; what
    it loads is what the same files give without that list."""
    import shutil

    from transformers import AutoTokenizer, TokenizersBackend

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}.gguf"
    write_synthetic_gguf(path, arch, SHAPES[arch]["tiny"], "Q8_0", seed=1)
    load_model(str(path), device="cpu")
    (folder,) = (cache_root() / "gguf-meta").iterdir()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]
    # The same files without the list: transformers' own way of finding the added tokens.
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    del config["added_tokens_decoder"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    reference = AutoTokenizer.from_pretrained(str(bare))

    parsed: list[str] = []
    real_load = json.load

    def load(handle, *args, **kwargs):
        parsed.append(getattr(handle, "name", "?"))
        return real_load(handle, *args, **kwargs)

    monkeypatch.setattr(json, "load", load)
    cached = load_model(str(path), device="cpu")
    monkeypatch.setattr(json, "load", real_load)
    assert cached.notes == []
    rebuilds = type(reference) is not TokenizersBackend
    assert rebuilds is (arch == "gemma3")
    assert len([name for name in parsed if name.endswith("tokenizer.json")]) == int(rebuilds), parsed
    tok = cached.tokenizer
    assert tok.added_tokens_decoder == reference.added_tokens_decoder
    assert tok.all_special_ids == reference.all_special_ids
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        reference.bos_token,
        reference.eos_token,
        reference.pad_token,
    )
    specials = " ".join(str(t) for t in reference.added_tokens_decoder.values())
    for text in [*TEXTS, specials, f"{specials} hi {specials}"]:
        assert _ids(tok, text) == _ids(reference, text), text
        assert tok.decode(_ids(reference, text)) == reference.decode(_ids(reference, text))


def test_a_cache_written_without_the_added_tokens_gets_them_once(tmp_path, monkeypatch):
    """A tokenizer cache from before the list (no added_tokens_decoder, no manifest field)
    loads as it is and is republished with the list, once."""
    from chatbot.models.manifest import MANIFEST, publish, read_manifest, staging

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "llama.gguf"
    write_synthetic_gguf(path, "llama", SHAPES["llama"]["tiny"], "Q8_0", seed=1)
    first = load_model(str(path), device="cpu").tokenizer
    (folder,) = (cache_root() / "gguf-meta").iterdir()
    old = read_manifest(folder)
    with staging(folder) as tmp:  # the cache as an older chatbot wrote it
        for name in old["files"]:
            (tmp / name).write_bytes((folder / name).read_bytes())
        config = json.loads((tmp / "tokenizer_config.json").read_text())
        del config["added_tokens_decoder"]
        (tmp / "tokenizer_config.json").write_text(json.dumps(config))
        publish(tmp, folder, gguf=old["gguf"], fast_tokenizer=old["fast_tokenizer"])
    assert "added_tokens" not in json.loads((folder / MANIFEST).read_text())
    again = load_model(str(path), device="cpu")
    assert again.notes == []
    assert again.tokenizer.added_tokens_decoder == first.added_tokens_decoder
    upgraded = read_manifest(folder)
    assert upgraded is not None and upgraded["added_tokens"] is True
    assert json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    for text in TEXTS:
        assert _ids(again.tokenizer, text) == _ids(first, text)
