"""Synthetic GGUF models (`scripts/make-synthetic-gguf`): real architectures, sizes and
ggml block layouts with random weights; loaded, decoded from their own K-quant bytes on the
fast path, and checked token for token against transformers reading the same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from helpers import full_logits, greedy_by_recompute, needs_kernels

from devtools.gguf_synthetic import SHAPES, pick_shape, tensor_type, write_synthetic_gguf

ROOT = Path(__file__).resolve().parent.parent
CHATBOT = str(Path(sys.executable).with_name("chatbot"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny files of each architecture, written once for the module."""
    folder = tmp_path_factory.mktemp("synthetic")
    made = {}
    for arch, kind in [("qwen2", "Q4_K_M"), ("qwen3", "Q4_K_M"), ("llama", "Q8_0")]:
        path = folder / f"{arch}-{kind}.gguf"
        write_synthetic_gguf(path, arch, SHAPES[arch]["tiny"], kind, seed=1)
        made[arch] = path
    return made


def test_sizes_are_the_published_models():
    assert abs(pick_shape("qwen2", "0.5B").params() / 494e6 - 1) < 0.01  # Qwen2.5-0.5B: 494M
    assert abs(pick_shape("llama", "8B").params() / 8.03e9 - 1) < 0.01  # Llama-3.1-8B
    assert pick_shape("qwen3", "0.6B").name == "Qwen3-0.6B"
    assert pick_shape("qwen2", "1.6B").name == "Qwen2.5-1.5B"  # the nearest
    with pytest.raises(ValueError, match="unknown architecture"):
        pick_shape("gpt5", "1B")


def test_gemma_sizes_are_the_published_models():
    """Gemma-2-2B: 2.61B parameters; Gemma-3-1B: 1.00B; Gemma-3-4B's text model: 3.88B (the
    published 4.3B counts its vision tower, which a text GGUF does not hold)."""
    assert abs(pick_shape("gemma2", "2B").params() / 2.614e9 - 1) < 0.01
    assert abs(pick_shape("gemma3", "1B").params() / 1.000e9 - 1) < 0.01
    assert abs(pick_shape("gemma3", "4B").params() / 3.880e9 - 1) < 0.01
    g3 = pick_shape("gemma3", "1B")
    assert (g3.hidden, g3.heads, g3.kv_heads, g3.head_dim, g3.vocab, g3.sliding_window) == (
        1152,
        4,
        1,
        256,
        262144,
        512,
    )
    # 1152 columns are not whole super-blocks: llama.cpp's fallbacks, as in real 1B files
    assert tensor_type("Q4_K_M", "attn_q", 5, 26, 1152) == "Q5_0"
    assert tensor_type("Q4_K_M", "token_embd_tied", 0, 26, 1152) == "Q8_0"
    for arch in ("gemma2", "gemma3"):  # the tiny files are whole super-blocks
        tiny = SHAPES[arch]["tiny"]
        assert tiny.hidden % 256 == tiny.ffn % 256 == (tiny.heads * tiny.head_dim) % 256 == 0


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_script_writes_gemma_files(tmp_path, arch):
    script = ROOT / "scripts" / "make-synthetic-gguf"
    out = tmp_path / f"{arch}.gguf"
    proc = subprocess.run([str(script), "--arch", arch, "--params", "tiny", "--type", "Q8_0", "-o", str(out)],
                          check=False, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"{arch} shaped as tiny" in proc.stdout
    reader = GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == arch
    assert {t.tensor_type.name for t in reader.tensors} == {"Q8_0", "F32"}


@pytest.mark.slow
def test_gemma_vocabulary_of_the_real_size():
    """A real-size Gemma vocabulary (Gemma 3: 262,144) is padded with unused tokens to the
    model's size, and transformers reads it whole."""
    import dataclasses
    import tempfile

    from transformers import AutoTokenizer

    vocab = pick_shape("gemma3", "1B").vocab
    with tempfile.TemporaryDirectory() as folder:
        big = Path(folder) / "gemma3-vocab.gguf"
        shape = dataclasses.replace(SHAPES["gemma3"]["tiny"], vocab=vocab)
        write_synthetic_gguf(big, "gemma3", shape, "Q8_0")
        tokens = GGUFReader(str(big)).fields["tokenizer.ggml.tokens"].contents()
        assert len(tokens) == vocab and tokens[-1].startswith("<unused") and "\u2581the" in tokens
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=big.name)
    assert len(tok) == vocab
    assert tok.convert_ids_to_tokens(tok("Hello the world")["input_ids"])[:2] == ["<bos>", "Hello"]


def test_the_tokenizer_source_is_read_again_once_it_changes(tmp_path):
    """Synthetic files take their tokenizer from a GGUF file read once per process
    (`_tokenizer_fields`): a source rewritten since is read again, and a caller's changes to
    what it got do not reach the next caller."""
    import dataclasses

    from devtools.gguf_synthetic import _tokenizer_fields

    source = tmp_path / "source.gguf"
    shape = SHAPES["llama"]["tiny"]
    write_synthetic_gguf(source, "llama", shape, "Q8_0")
    first = _tokenizer_fields(source)
    assert len(first["tokens"]) == shape.vocab
    first["tokens"] = ()
    assert len(_tokenizer_fields(source)["tokens"]) == shape.vocab
    write_synthetic_gguf(source, "llama", dataclasses.replace(shape, vocab=shape.vocab + 48), "Q8_0")
    again = _tokenizer_fields(source)
    assert len(again["tokens"]) == shape.vocab + 48 and again["tokens"][-1].startswith("<|unused_")
    assert GGUFReader(str(source)).fields["tokenizer.ggml.tokens"].contents() == list(again["tokens"])


def test_q4_k_m_tensor_types_follow_llama_cpp():
    assert tensor_type("Q4_K_M", "attn_q", 5, 24, 1536) == "Q4_K"
    assert tensor_type("Q4_K_M", "output", 0, 24, 1536) == "Q6_K"
    assert tensor_type("Q4_K_M", "attn_v", 0, 24, 1536) == "Q6_K"  # first eighth: more bits
    assert tensor_type("Q4_K_M", "ffn_down", 10, 24, 1536) == "Q4_K"
    assert tensor_type("Q4_K_M", "ffn_down", 23, 24, 1536) == "Q6_K"
    # Qwen2.5-0.5B's 896 columns are not whole super-blocks: llama.cpp falls back
    assert tensor_type("Q4_K_M", "attn_q", 5, 24, 896) == "Q5_0"
    assert tensor_type("Q4_K_M", "ffn_down", 0, 24, 896) == "Q8_0"
    assert tensor_type("Q8_0", "attn_q", 5, 24, 896) == "Q8_0"
    assert tensor_type("Q5_K_M", "attn_q", 5, 24, 1536) == "Q5_K"
    assert tensor_type("Q5_K_M", "attn_q", 5, 24, 896) == "Q5_1"
    assert tensor_type("Q6_K", "ffn_up", 5, 24, 1536) == "Q6_K"


def test_files_are_valid_gguf_with_real_blocks(files):
    reader = GGUFReader(str(files["qwen2"]))
    assert reader.fields["general.architecture"].contents() == "qwen2"
    assert reader.fields["qwen2.embedding_length"].contents() == 256
    names = {t.name: t for t in reader.tensors}
    assert "blk.1.attn_q.bias" in names and "output.weight" not in names  # tied, with q/k/v bias
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_K", "Q6_K", "F32"} == kinds
    for t in reader.tensors:
        w = dequantize(np.asarray(t.data), GGMLQuantizationType[t.tensor_type.name])
        assert np.isfinite(w).all() and 0 < np.abs(w).max() < 2, t.name
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152
    qwen3 = {t.name for t in GGUFReader(str(files["qwen3"])).tensors}
    assert "blk.0.attn_q_norm.weight" in qwen3


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_fast_path_decodes_the_files_own_blocks_like_transformers(files, arch):
    """transformers dequantizes the file into its float32 model; our decoder reads the file's
    Q4_K/Q6_K (or Q8_0) bytes. Logits after each native step match a full float32 recompute
    (within the int16 rounding of the activations),
    and the greedy tokens are equal."""
    from chatbot.config import SamplingConfig
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import load_model

    loaded = load_model(str(files[arch]))
    model = loaded.model
    decoder = FastDecoder(model, "exact")
    info = decoder.info()
    assert info.source == "gguf"
    expected = {"q8_0"} if arch == "llama" else {"q4_k", "q6_k"}
    assert set(info.formats) == expected
    before = FastDecoder(model, "auto", use_gguf=False).info()  # packed from the float32 model
    # the tiny model is mostly its Q6_K (0.82 B/weight) or Q8_0 (1.06) embedding; the weights
    # packed from the float32 model are float32 (the K-quant grids are no format of theirs)
    assert info.bytes_per_weight < (0.85 if arch != "llama" else 1.07)
    assert before.bytes_per_weight > (3.9 if arch != "llama" else 1.0)
    assert info.activations == "int16"  # the block products take int16 activations (2^-16 steps)
    atol = 1e-3
    ids = list(range(100, 130))
    cache = decoder.new_cache()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:10]]), cache=cache, use_cache=True)
    for i in range(10, 30):
        assert torch.allclose(decoder.decode(cache, ids[i]), full_logits(model, ids[: i + 1])[-1], atol=atol)
    engine = Engine(model, loaded.tokenizer, decoder=decoder)
    greedy = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=24)
    got = [t for c in engine.generate(engine.new_cache(), ids[:12], greedy) for t in c.token_ids]
    assert len(got) >= 8 and got == greedy_by_recompute(model, ids[:12], len(got))


@pytest.mark.slow
@needs_kernels
def test_cli_chats_and_benches_a_synthetic_file(files, tmp_path):
    env = {**os.environ}
    proc = subprocess.run(
        [CHATBOT, "run", "--model", str(files["qwen2"]), "--max-new-tokens", "8", "--temperature", "0"],
        input="Hi\n", check=False, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "fast decode off" not in proc.stderr
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            CHATBOT,
            "bench",
            "decode",
            "--model",
            str(files["qwen2"]),
            "--setups",
            "chatbot-auto,chatbot-auto-model",
            "--rounds",
            "1",
            "--decode-tokens",
            "8",
            "--json",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    auto, model = results["chatbot-auto"], results["chatbot-auto-model"]
    assert auto["weights_from"] == "gguf" and model["weights_from"] == "model"
    assert auto["bytes_per_weight"] < 0.85 and model["bytes_per_weight"] > 3.9  # K-quants were float32
    assert auto["decode_tps"] > 0 and "B/" in proc.stdout


def test_script_help_and_bad_size():
    script = ROOT / "scripts" / "make-synthetic-gguf"
    proc = subprocess.run([str(script), "--help"], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--arch" in proc.stdout
    proc = subprocess.run(
        [str(script), "--params", "huge"], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "--params takes a size" in proc.stderr.splitlines()[-1]


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_streaming_on_the_files_own_blocks_equals_plain_engine(files, arch):
    """`--enable-streaming` on the fast path (K-quant matrices from the file; `exact`: int16
    activations, as the default's int8 ones would part from float32's greedy tokens on a random
    model by their rounding alone): evicting and re-rotating with the model's rope, two turns
    give the plain transformers engine's tokens and evictions."""
    from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import load_model

    loaded = load_model(str(files[arch]))
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=100)
    config = ChatConfig(
        sampling=sampling, engine=EngineConfig(enable_streaming=True, start_size=4, recent_size=48)
    )
    results = {}
    for name, decoder in [("plain", None), ("fast", FastDecoder(loaded.model, "exact"))]:
        session = ChatSession(Engine(loaded.model, loaded.tokenizer, decoder=decoder), config)
        got = [
            [t for c in session.send(text) for t in c.token_ids] for text in ("Hello there!", "The quick fox")
        ]
        results[name] = (got, list(session.cache_ids), session.evicted_total)
        assert session.evicted_total > 0
    assert results["fast"] == results["plain"]


def test_llama3_files_carry_their_rope_scaling(tmp_path, monkeypatch):
    """Llama-3.x shapes get llama.cpp's ``rope_freqs.weight``; loaded, the model's rotary
    frequencies are transformers' own llama3 ones for the same settings."""
    import dataclasses

    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from chatbot.models.loader import load_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert pick_shape("llama", "8B").llama3_rope == (8.0, 1.0, 4.0, 8192)
    shape = dataclasses.replace(SHAPES["llama"]["tiny"], rope_theta=5e5, llama3_rope=(32.0, 1.0, 4.0, 64))
    path = tmp_path / "llama3.gguf"
    write_synthetic_gguf(path, "llama", shape, "Q8_0", seed=2)
    assert "rope_freqs.weight" in {t.name for t in GGUFReader(str(path)).tensors}
    loaded = load_model(str(path), device="cpu")
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(loaded.model.model.rotary_emb.inv_freq, expected.float(), rtol=1e-6, atol=0)


@needs_kernels
def test_a_tiled_file_decodes_in_batches_as_alone_and_as_untiled(files, monkeypatch):
    """The file's Q4_K / Q6_K matrices in 8-row tiles (`kernels.tile_rows`): batched steps
    (`chatbot serve`) give each conversation the logits it gets alone, bit for bit, and the
    tiles give the greedy tokens of the rows as stored."""
    from test_decode_batch import _check

    from chatbot.config import SamplingConfig
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import load_model

    loaded = load_model(str(files["qwen2"]))
    decoder = FastDecoder(loaded.model, "auto")
    mats = [decoder.lm_head, *decoder._parts()]
    if not any(p.x8 for p in mats):
        pytest.skip("no tile kernels on this CPU (AVX2 and up)")
    assert all(p.x8 for p in mats if p.format_name in ("q4_k", "q6_k") and p.rows % 8 == 0)
    info = decoder.info()
    assert info.tiled == sum(p.x8 for p in {id(p): p for p in [decoder.embed, *mats]}.values())
    assert f"matrices ({info.tiled} in 8-row tiles), " in info.label()
    _check(loaded.model, "auto", steps=4, rows=3)
    greedy = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=16)
    prompt = list(range(100, 112))

    def answer(model, dec: FastDecoder) -> list[int]:
        engine = Engine(model, loaded.tokenizer, decoder=dec)
        return [t for c in engine.generate(engine.new_cache(), prompt, greedy) for t in c.token_ids]

    tiled = answer(loaded.model, decoder)
    monkeypatch.setenv("CHATBOT_TILES", "0")
    rows = load_model(str(files["qwen2"])).model
    untiled = FastDecoder(rows, "auto")
    assert untiled.info().source == "gguf" and not any(p.x8 for p in [untiled.lm_head, *untiled._parts()])
    assert len(tiled) >= 8 and answer(rows, untiled) == tiled


@needs_kernels
def test_a_tiled_files_rows_of_every_size_equal_steps(files):
    """Q4_K tiles with int8 inputs (`--opt auto`): a verification pass of 2..16 rows (the
    tile unpacked once for up to 4 inputs) gives each row's logits as decoding alone."""
    from test_decode_batch import rows_equal_steps

    from chatbot.models.loader import load_model

    rows_equal_steps(load_model(str(files["qwen2"])).model, "auto")


@needs_kernels
def test_fast_decodes_the_files_own_blocks_with_int8_inputs(files):
    """`--opt fast`: the same matrices as `exact` and `auto` (the file's blocks, not
    repacked), inputs rounded to int8 (the products themselves are checked exactly in
    test_tiles). Against the logits of a full recompute (prefill's int16 products), `exact`
    is within float rounding; `fast` is further off, by int8's rounding; `auto` (int8 into
    the layers' tiles, int16 into the head) between them."""
    from chatbot.engine.backends.native import kernels
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.models.loader import load_model

    model = load_model(str(files["qwen2"])).model
    ids = list(range(100, 124))
    errors = {}
    lib = kernels.load_library()
    labels = {"exact": "int16", "fast": "int8"}
    int16_sites = {}
    for level in ("exact", "auto", "fast"):
        decoder = FastDecoder(model, level, threads=1)
        info = decoder.info()
        assert info.source == "gguf" and info.activations == labels.get(level, info.activations)
        int16_sites[level] = decoder.inputs.int16_sites
        if level == "auto":  # int8 into the sites whose every matrix has a faster int8 product
            sites = [decoder.wqkv, decoder.wo, decoder.wgu, decoder.wdown, [[decoder.lm_head]]]
            faster = [
                all(lib.chatbot_int8_faster(p.fmt, int(p.x8)) for layer in s for p in layer) for s in sites
            ]
            assert decoder.inputs.int16_sites == sum(1 << i for i, f in enumerate(faster) if not f)
            assert info.activations == ("int8" if all(faster) else "int8+int16" if any(faster) else "int16")
        errors[level] = info.weight_bytes, []
        cache = decoder.new_cache()
        with torch.no_grad():
            model(input_ids=torch.tensor([ids[:8]]), cache=cache, use_cache=True)
        for i in range(8, len(ids)):
            got = decoder.decode(cache, ids[i])
            ref = full_logits(model, ids[: i + 1])[-1]
            errors[level][1].append(float((got - ref).abs().max() / ref.std()))
    assert errors["exact"][0] == errors["auto"][0] == errors["fast"][0]  # the very same matrices
    from test_decode_batch import _check

    _check(model, "fast", steps=4, rows=3)  # batched steps (chatbot serve): each row as alone
    exact, auto, fast = (max(errors[level][1]) for level in ("exact", "auto", "fast"))
    # here 4e-4 and 0.1: the random tiny model has no real model's margins, so a loose bound
    assert exact < 1e-3 and 10 * exact < fast < 0.4, (exact, fast)
    assert exact <= auto <= fast, (exact, auto, fast)
    if 0 < int16_sites["auto"] < 31:  # some products int8, some int16
        assert exact < auto < fast, (exact, auto, fast)


@needs_kernels
def test_auto_prefills_with_the_inputs_its_decode_step_takes(files):
    """`auto` prefills as its step decodes: int8 inputs (the batched int8 product) into the
    tiled matrices of the sites whose step takes int8, int16 into the others; `exact` int16
    into all. So a prompt's logits from one prefill pass are the step-decoded ones up to the
    float rounding of the attention, far closer than `exact`'s prefill, whose inputs are finer
    than auto's step's."""
    from chatbot.engine.backends.native import kernels
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.backends.native.packed import PackedLinear
    from chatbot.models.loader import load_model

    model = load_model(str(files["qwen2"])).model
    auto, exact = FastDecoder(model, "auto", threads=1), FastDecoder(model, "exact", threads=1)
    if not any(p.x8 for p in auto._parts()):
        pytest.skip("no tile kernels on this CPU (AVX2 and up)")
    assert (auto.inputs.act, auto.inputs.int16_sites) == (kernels.ACT_Q8, 0)  # every site int8 here
    for decoder, tiled_form in ((auto, kernels.ACT_Q8), (exact, kernels.ACT_I16)):
        linears = [m for m in decoder.prefill_model.modules() if isinstance(m, PackedLinear)]
        assert len(linears) >= 7 and all(
            m.act == (tiled_form if m.packed.x8 else kernels.ACT_I16) for m in linears
        )
    assert not any(isinstance(m, PackedLinear) and m.act != kernels.ACT_F32 for m in model.modules())
    ids = list(range(100, 124))
    cache = auto.new_cache()
    with torch.no_grad():
        auto.prefill_model(input_ids=torch.tensor([ids[:4]]), cache=cache, use_cache=True)
        stepped = torch.stack([auto.decode(cache, t) for t in ids[4:]])
        prefilled = {
            name: d.prefill_model(input_ids=torch.tensor([ids])).logits[0, 4:]
            for name, d in (("auto", auto), ("exact", exact))
        }
    gap = {name: float((logits - stepped).abs().max() / stepped.std()) for name, logits in prefilled.items()}
    assert gap["auto"] < 1e-4 and gap["exact"] > 100 * gap["auto"], gap
