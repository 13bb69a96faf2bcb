"""Gemma 2 and Gemma 3 GGUF files loaded as they are (`build_packed_model`), on tiny synthetic
files written as llama.cpp's converter writes Gemma (norms stored as 1 + w, a scaled
embedding, four norms per layer, a sentencepiece vocabulary).

The reference is transformers' own GGUF load of the same file
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`: every tensor dequantized by
the `gguf` package, its Gemma processor subtracting 1 from the norms). Where llama.cpp is
installed (a bench tool, not a dependency), it must read the file the same way too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
from helpers import full_logits, greedy_by_recompute, needs_kernels

from devtools.gguf_synthetic import GEMMA_SPECIALS, SHAPES, write_synthetic_gguf

CHATBOT = str(Path(sys.executable).with_name("chatbot"))
FILES = [("gemma2", "Q8_0"), ("gemma2", "Q4_K_M"), ("gemma3", "Q8_0"), ("gemma3", "Q4_K_M")]
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the dark woods."
# Logits are compared at this absolute tolerance (they span about ±5). Both sides compute in
# float32 with the same weights (the kernels dequantize each block exactly as the gguf
# package does); prefill multiplies with the same torch GEMM, and the single-token steps run
# the native matrix-vector kernel, whose order of additions differs: ~1e-5 measured.
ATOL = 1e-4

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_kernels]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny gemma2/gemma3 files in Q8_0 and Q4_K_M, written once for the module."""
    folder = tmp_path_factory.mktemp("gemma")
    made = {}
    for arch, kind in FILES:
        path = folder / f"{arch}-{kind}.gguf"
        write_synthetic_gguf(path, arch, SHAPES[arch]["tiny"], kind, seed=3)
        made[arch, kind] = path
    return made


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def reference(path: Path):
    """transformers' own float32 model of a GGUF file."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_files_have_llama_cpps_gemma_layout(files, arch):
    """Tensor names are those gguf-py lists for the architecture (tied: no output.weight);
    norms are stored as 1 + w; the metadata transformers and llama.cpp read is there."""
    reader = GGUFReader(str(files[arch, "Q4_K_M"]))
    shape = SHAPES[arch]["tiny"]
    names = {t.name for t in reader.tensors}
    known = MODEL_TENSORS[MODEL_ARCH.GEMMA2 if arch == "gemma2" else MODEL_ARCH.GEMMA3]
    expected = {TENSOR_NAMES[t].format(bid=i) + ".weight" for t in known for i in range(shape.layers)}
    assert names == expected - {"output.weight"}
    norms = [t for t in reader.tensors if t.name.endswith("norm.weight")]
    assert len(norms) == shape.layers * (4 if arch == "gemma2" else 6) + 1
    assert all(0.5 < float(np.mean(t.data)) < 1.5 for t in norms)  # 1 + w, w small

    def field(key: str):
        return reader.fields[f"{arch}.{key}"].contents()

    assert field("attention.sliding_window") == shape.sliding_window
    assert field("attention.key_length") == field("attention.value_length") == 256
    assert field("rope.freq_base") == shape.rope_theta
    if arch == "gemma2":
        assert (field("attn_logit_softcapping"), field("final_logit_softcapping")) == (50.0, 30.0)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    assert [tokens[i] for i in range(5)] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    assert tokens[106:110] == ["<start_of_turn>", "<end_of_turn>", "<0x00>", "<0x01>"]
    assert len(tokens) == len(reader.fields["tokenizer.ggml.scores"].contents()) == shape.vocab


@pytest.mark.parametrize(("arch", "kind"), FILES)
def test_logits_and_greedy_tokens_equal_transformers(files, arch, kind):
    """Our model over the file's blocks against transformers' dequantized float32 model: the
    logits of a 20+ token prompt (past the 16-token sliding window) and of each cached
    decode step, and a greedy continuation, token for token."""
    from chatbot.models.loader import load_model

    path = files[arch, kind]
    loaded = load_model(str(path))
    ours, ref = loaded.model, reference(path)
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    assert len(ids) >= 20 and ids[0] == GEMMA_SPECIALS["<bos>"]
    torch.testing.assert_close(full_logits(ours, ids), full_logits(ref, ids), rtol=0, atol=ATOL)
    # decode steps through the cache (single-row products on the packed rows), then greedy
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        step = ours(input_ids=torch.tensor([ids[:8]]), cache=cache, use_cache=True).logits[0, -1]
        for i in range(8, len(ids)):
            step = ours(input_ids=torch.tensor([[ids[i]]]), cache=cache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(step, full_logits(ref, ids[: i + 1])[-1], rtol=0, atol=ATOL)
        got = []
        for _ in range(12):
            got.append(int(step.argmax()))
            step = ours(input_ids=torch.tensor([[got[-1]]]), cache=cache, use_cache=True).logits[0, -1]
    assert got == greedy_by_recompute(ref, ids, 12)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_model_is_packed_with_gemmas_modules(files, arch):
    """Every matrix is a packed module over the file; the only float weights are the norms
    (minus 1); the embedding keeps Gemma's sqrt(hidden) scale; the output shares its table."""
    from chatbot.engine.backends.native.packed import PackedLinear, ScaledPackedEmbedding
    from chatbot.models.loader import load_model

    loaded = load_model(str(files[arch, "Q4_K_M"]))
    model, shape = loaded.model, SHAPES[arch]["tiny"]
    embed = model.get_input_embeddings()
    assert isinstance(embed, ScaledPackedEmbedding) and embed.packed.format_name == "q6_k"
    assert embed.embed_scale.dim() == 0 and embed.embed_scale.dtype == torch.float32
    assert float(embed.embed_scale) == pytest.approx(math.sqrt(shape.hidden))
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.packed is embed.packed
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []  # every nn.Linear was replaced
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 7 * shape.layers + 1
    qk = 2 * 256 if arch == "gemma3" else 0
    floats = sum(p.numel() for p in model.parameters())
    assert floats == shape.layers * (4 * shape.hidden + qk) + shape.hidden  # the norms only
    ref = reference(files[arch, "Q4_K_M"])
    ref_norms = {n: p for n, p in ref.named_parameters() if "norm" in n}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref_norms[name], rtol=0, atol=0)  # stored - 1, as transformers
    assert all(abs(float(p.mean())) < 0.5 for p in model.parameters())  # w, not 1 + w
    rotary = model.model.rotary_emb
    if arch == "gemma3":
        for kind, theta in [("sliding_attention", 1e4), ("full_attention", shape.rope_theta)]:
            expected = 1.0 / theta ** (torch.arange(0, 256, 2, dtype=torch.float32) / 256)
            torch.testing.assert_close(getattr(rotary, f"{kind}_inv_freq"), expected)
    else:
        torch.testing.assert_close(rotary.inv_freq, ref.model.rotary_emb.inv_freq)
    assert loaded.num_parameters == sum(p.numel() for p in ref.parameters())


def test_final_logit_softcapping_stays(files):
    """gemma2's logits are soft-capped at ±30 in the model's forward (so a scaled-up output
    cannot exceed it), gemma3's are not."""
    from chatbot.models.loader import load_model

    g2 = load_model(str(files["gemma2", "Q8_0"])).model
    assert g2.config.final_logit_softcapping == 30.0 and g2.config.attn_logit_softcapping == 50.0
    g3 = load_model(str(files["gemma3", "Q8_0"])).model
    assert g3.config.final_logit_softcapping is None
    ids = torch.tensor([[2, 500, 501, 502]])
    g2.model.norm.weight.data += 200.0  # (1 + w) x 201: the raw logits would be ~±1000
    with torch.no_grad():
        assert 25 < float(g2(ids).logits.abs().max()) <= 30.0


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tokenizer_and_chat_template_through_the_loader(files, arch):
    """The loader's tokenizer (from the file's metadata, then from its cache) is Gemma's
    sentencepiece one: BOS added, byte fallback, the turn markers whole, Gemma's chat layout;
    the session stops on <end_of_turn>; a second load (from the cache) encodes the same."""
    from chatbot.errors import ConfigError
    from chatbot.models.loader import load_model
    from chatbot.models.templates import check_template, end_of_turn_ids

    loaded = load_model(str(files[arch, "Q8_0"]))
    tok = loaded.tokenizer
    assert type(tok).__name__ == "GemmaTokenizer"
    text = "Hello world, naïve café ☃ 42"
    ids = tok(text)["input_ids"]
    assert ids[0] == 2 and tok.decode(ids, skip_special_tokens=True) == text
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # ☃ by its bytes
    msgs = [{"role": "user", "content": "Hi there! "}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "How are you?"}]  # fmt: skip
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<bos><start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n"
    )
    chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat_ids[:3] == [2, 106, tok.convert_tokens_to_ids("user")]
    assert chat_ids.count(106) == 4 and chat_ids.count(107) == 3 and chat_ids.count(2) == 1
    assert loaded.template is not None and loaded.template.source == "tokenizer"
    assert end_of_turn_ids(tok) == [107]
    if arch == "gemma2":  # Gemma 2's template refuses a system prompt: one clear line
        with pytest.raises(ConfigError, match="cannot render a system prompt"):
            check_template(tok, "Be brief.")
    else:  # Gemma 3 puts it before the first user message
        check_template(tok, "Be brief.")
        sys_msgs = [{"role": "system", "content": "Be brief."}, msgs[0]]
        rendered = tok.apply_chat_template(sys_msgs, tokenize=False)
        assert "<start_of_turn>user\nBe brief.\n\nHi there!" in rendered
    again = load_model(str(files[arch, "Q8_0"])).tokenizer
    assert again(text)["input_ids"] == ids
    again_ids = again.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert again_ids == chat_ids


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_llama_cpp_reads_the_file_the_same_way(files, arch):
    """llama.cpp (a bench tool, when installed) tokenizes as our tokenizer does and computes
    about the same logits: its products take 8-bit activations, so they are near, not equal."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from chatbot.models.loader import load_model

    path = files[arch, "Q8_0"]
    loaded = load_model(str(path))
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=1, verbose=False, logits_all=True)
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                add_generation_prompt=True)  # fmt: skip
    ids = loaded.tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert llm.tokenize(chat.encode(), add_bos=False, special=True) == ids
    assert llm.tokenize(PROMPT.encode(), add_bos=True) == loaded.tokenizer(PROMPT)["input_ids"]
    llm.eval(ids)
    theirs = torch.tensor(np.array(llm.scores[: len(ids)]), dtype=torch.float32)
    ours = full_logits(loaded.model, ids)
    assert float((theirs - ours).abs().max()) < 0.1 * float(ours.abs().max())
    assert float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()) > 0.9


def test_memory_stays_near_the_file_size(tmp_path, files):
    """A larger Q4_K_M gemma2 file (128M parameters: 80 MB, 488 MB as float32) loads and
    runs a prompt with the peak RSS growing by the file's pages, one dequantized band
    (64 MB at most) and the activations: far less than its float32 size. (Measured after a
    tiny gemma2 model has loaded in the same process, so imports do not count: 184-213 MB,
    read as the process's own high-water mark, VmHWM.)"""
    shape = dataclasses.replace(SHAPES["gemma2"]["tiny"], hidden=1024, layers=6, heads=4, kv_heads=2,
                                ffn=4096, vocab=32768)  # fmt: skip
    path = tmp_path / "gemma2-mid.gguf"
    write_synthetic_gguf(path, "gemma2", shape, "Q4_K_M", seed=4)
    code = (
        "import json, sys, torch\n"
        "from chatbot.engine.stats import peak_rss_bytes\n"
        "from chatbot.models.loader import load_model\n"
        "torch.set_num_threads(1)\n"
        "warm = load_model(sys.argv[2])\n"
        "with torch.no_grad(): warm.model(input_ids=torch.tensor([[2, 500, 501, 502]]))\n"
        "del warm\n"
        "base = peak_rss_bytes() / 1024\n"
        "m = load_model(sys.argv[1])\n"
        "ids = m.tokenizer('The quick brown fox jumps over the lazy dog. ' * 4)['input_ids']\n"
        "with torch.no_grad(): m.model(input_ids=torch.tensor([ids]))\n"
        "peak = peak_rss_bytes() / 1024\n"
        "print(json.dumps({'grew_mb': (peak - base) / 1024, 'params': m.num_parameters}))\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(files["gemma2", "Q8_0"])],
                          capture_output=True, text=True, timeout=600, env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    float32_mb = got["params"] * 4 / 2**20
    file_mb = path.stat().st_size / 2**20
    assert got["params"] == shape.params() and float32_mb > 480 and file_mb < 90
    # What grows is the file's pages (80 MB), the first load's tokenizer conversion (into a
    # fresh cache), a band and the activations: 202-213 MB. A float32 copy of the weights
    # would add 488 MB to that, a bfloat16 one 244 MB.
    assert got["grew_mb"] < 0.6 * float32_mb, got


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_cli_chats_with_a_gemma_file(tmp_path, arch):
    """`chatbot run` on a gemma file: two turns, answers end on <end_of_turn> or the token
    limit, no traceback (`--opt off`: the fast path has no gemma yet; a window wider than
    the conversation, see test_turns_cross_the_sliding_window)."""
    shape = dataclasses.replace(SHAPES[arch]["tiny"], sliding_window=4096)
    path = tmp_path / f"{arch}.gguf"
    write_synthetic_gguf(path, arch, shape, "Q8_0", seed=5)
    proc = subprocess.run(
        [CHATBOT, "run", "--model", str(path), "--opt", "off", "--max-new-tokens", "6", "--temperature", "0"],
        input="Hi there!\nTell me more.\n", check=False, capture_output=True, text=True, timeout=600,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "failed" not in proc.stderr, proc.stderr
    assert proc.stderr.count("tok/s") == 2 and len(proc.stdout.strip().splitlines()) == 2, proc.stderr


def test_turns_cross_the_sliding_window(files):
    """Three turns of a chat on a model whose 16-token window the conversation passes: each
    answer is the greedy continuation of the conversation, recomputed without a cache."""
    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import load_model

    loaded = load_model(str(files["gemma3", "Q8_0"]))
    config = ChatConfig(sampling=SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=8))
    session = ChatSession(Engine(loaded.model, loaded.tokenizer), config)
    for text in ("Hello there, how are you?", "The quick brown fox", "and again"):
        answer = [t for c in session.send(text) for t in c.token_ids]
        # the cache holds the conversation the answer continued, and the answer when it kept it
        held, k = list(session.cache_ids), len(answer)
        at = [i for i in range(len(held) - k + 1) if held[i : i + k] == answer]
        prefix = held[: at[-1]] if at else held
        assert len(prefix) > 16 and answer == greedy_by_recompute(loaded.model, prefix, k)


def test_gemma3_rope_scaling_of_the_global_layers(tmp_path):
    """A Gemma-3 4B-27B file's linear rope scaling (``gemma3.rope.scaling.*``, which
    transformers' GGUF reader skips) divides the global layers' frequencies by its factor, as
    the model's config.json (``rope_scaling: linear, factor 8``) does in transformers; the
    sliding layers keep theirs. Logits equal transformers' model of that config."""
    import transformers

    from chatbot.models.loader import load_model

    assert SHAPES["gemma3"]["4B"].linear_rope == 8.0
    shape = dataclasses.replace(SHAPES["gemma3"]["tiny"], linear_rope=8.0, sliding_window=8)
    path = tmp_path / "gemma3-scaled.gguf"
    write_synthetic_gguf(path, "gemma3", shape, "Q8_0", seed=6)
    model = load_model(str(path)).model
    assert model.config.rope_parameters["full_attention"]["rope_type"] == "linear"
    # the config transformers makes of Gemma-3-4B's config.json, with the tiny sizes
    config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    scaled = transformers.Gemma3TextConfig(**{
        **config.to_dict(), "rope_parameters": None, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_theta": 1e6,
    })  # fmt: skip
    assert scaled.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 1e6}  # fmt: skip
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, config=scaled, dtype=torch.float32
    ).eval()
    rotary, theirs = model.model.rotary_emb, ref.model.rotary_emb
    for kind in ("full_attention", "sliding_attention"):
        torch.testing.assert_close(getattr(rotary, f"{kind}_inv_freq"), getattr(theirs, f"{kind}_inv_freq"))
    unscaled = reference(path).model.rotary_emb.full_attention_inv_freq
    torch.testing.assert_close(rotary.full_attention_inv_freq, unscaled / 8)
    ids = list(range(600, 640))
    torch.testing.assert_close(full_logits(model, ids), full_logits(ref, ids), rtol=0, atol=ATOL)
    assert not torch.allclose(full_logits(model, ids), full_logits(reference(path), ids), atol=1e-2)


def test_llama_cpp_scales_the_global_layers_rope_as_we_do(tmp_path):
    """llama.cpp (when installed) reads a gemma3 file's linear rope scaling: its logits
    are near ours (F16 weights: ~4e-3 apart) and far from transformers' GGUF load, which
    skips the scaling (~0.5 apart over 100 tokens past an 8-token window)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from chatbot.models.loader import load_model

    shape = dataclasses.replace(SHAPES["gemma3"]["tiny"], linear_rope=8.0, sliding_window=8)
    path = tmp_path / "gemma3-scaled.gguf"
    write_synthetic_gguf(path, "gemma3", shape, "F16", seed=6)
    ids = [2, *range(600, 699)]
    ours, unscaled = full_logits(load_model(str(path)).model, ids), full_logits(reference(path), ids)
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=1, verbose=False, logits_all=True)
    llm.eval(ids)
    theirs = torch.tensor(np.array(llm.scores[: len(ids)]), dtype=torch.float32)
    assert float((theirs - ours).abs().max()) < 0.02
    assert float((theirs - unscaled).abs().max()) > 0.2


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen2", "qwen3"])
def test_tokenizer_named_by_type_is_autotokenizers_own(tmp_path, arch):
    """The loader names the tokenizer class by the model type (sparing AutoTokenizer a second
    full parse of the file's metadata); the tokenizer is the one AutoTokenizer picks itself."""
    from transformers import AutoConfig, AutoTokenizer

    from chatbot.models.gguf_model import _tokenizer_type

    path = tmp_path / f"{arch}.gguf"
    write_synthetic_gguf(path, arch, SHAPES[arch]["tiny"], "Q8_0", seed=7)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    typed = _tokenizer_type(path, config)
    assert typed == {"tokenizer_type": config.model_type}
    ours = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name, **typed)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.chat_template == theirs.chat_template and ours.special_tokens_map == theirs.special_tokens_map
    assert ours.add_bos_token == theirs.add_bos_token
    (tmp_path / "tokenizer_config.json").write_text("{}")  # a folder's own class may differ: not named
    assert _tokenizer_type(path, config) == {}
