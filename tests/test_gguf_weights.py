"""Packing the fast path's matrices straight from a GGUF file: the tensor table, the q/k row
order of llama files, and the default model decoding from its file's own Q4_1/Q8_0 bytes with
the same greedy tokens as float32 transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import greedy_by_recompute, needs_kernels

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.gguf_weights import GGUFWeights, read_tensor_table, unpermute_rows
from chatbot.models.loader import default_gguf_path


def test_tensor_table_equals_gguf_reader():
    from gguf import GGUFReader

    path = default_gguf_path()
    reader = GGUFReader(str(path))
    arch, table = read_tensor_table(path)
    assert arch == str(reader.fields["general.architecture"].contents()) == "llama"
    expected = [
        (t.name, tuple(int(n) for n in t.shape), t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]
    assert [(t.name, t.shape, t.type_name, t.offset, t.nbytes) for t in table] == expected
    weights = GGUFWeights(path)
    for t in reader.tensors[:5]:
        assert np.array_equal(
            weights.tensors[t.name].data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)
        )


def test_unpermute_rows_is_transformers_reverse_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    w = np.arange(64 * 3).reshape(64, 3)
    for heads in (4, 2):
        expected = proc._reverse_permute_weights(w, heads, heads)
        assert np.array_equal(w[unpermute_rows(64, heads).numpy()], expected)


def test_a_q_matrix_is_packed_with_its_rows_in_transformers_order():
    """The default model's q/k rows, reordered while packing, are the file's rows in the order
    that undoes llama.cpp's permutation, byte for byte, in a copy of their own."""
    src = GGUFWeights(default_gguf_path())
    for name, heads in (("blk.0.attn_q.weight", 9), ("blk.3.attn_k.weight", 3)):
        tensor = src.tensors[name]
        stored = np.asarray(tensor.data).view(np.uint8).reshape(int(tensor.shape[1]), -1)
        packed = src.matrix(name, heads)
        order = unpermute_rows(stored.shape[0], heads).numpy()
        assert packed.data.dtype == torch.uint8 and packed.data.is_contiguous()
        assert np.array_equal(packed.data.numpy(), stored[order])
        assert not np.shares_memory(packed.data.numpy(), stored)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensor_table(bad)


@pytest.fixture(scope="module")
def dense_default():
    """The default model as transformers alone loads a GGUF: every tensor dequantized by the
    gguf package into a float32 model (the independent reference; ~540 MB)."""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval()


@pytest.mark.slow
@needs_kernels
def test_default_model_decodes_from_its_file_losslessly(default_model, dense_default):
    """The default model is loaded as its file stores it: its matrices are the file's Q4_1/Q8_0
    blocks, each equal to what transformers dequantizes; `exact` decodes from those very
    blocks (shared with the model, no copy), and the greedy tokens equal float32
    transformers' on the dequantized model."""
    from chatbot.config import SamplingConfig
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.backends.native.packed import dense_weight
    from chatbot.engine.generate import Engine

    model = default_model.model
    decoder = FastDecoder(model, "exact")
    info = decoder.info()
    assert info.source == "gguf" and set(info.formats) == {"q4_1", "q8_0"}
    assert info.bytes_per_weight < 0.75  # Q4_1: 20 bytes per 32 weights; embedding Q8_0
    layer, ref = model.model.layers[3], dense_default.model.layers[3]
    q, k, v = decoder.wqkv[3]
    assert q is layer.self_attn.q_proj.packed and decoder.embed is model.model.embed_tokens.packed
    for packed, w in [
        (q, ref.self_attn.q_proj.weight),
        (k, ref.self_attn.k_proj.weight),
        (v, ref.self_attn.v_proj.weight),
        (decoder.wdown[3][0], ref.mlp.down_proj.weight),
    ]:
        assert torch.allclose(kernels.unpack(packed), w.float(), rtol=1e-6, atol=1e-7)
    embed = dense_weight(model.model.embed_tokens)
    assert torch.allclose(embed, dense_default.model.embed_tokens.weight, rtol=1e-6, atol=1e-7)
    ids = default_model.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    engine = Engine(model, default_model.tokenizer, decoder=decoder)
    greedy = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=40)
    got = [t for c in engine.generate(engine.new_cache(), ids, greedy) for t in c.token_ids]
    assert len(got) >= 20  # the engine stops at an end-of-turn token, the reference does not
    assert got == greedy_by_recompute(dense_default, ids, len(got))


@pytest.mark.slow
@pytest.mark.parametrize("act", ["float32", "int16"])
def test_packed_model_logits_equal_the_dequantized_model(default_model, dense_default, act):
    """transformers' forward pass on the packed model equals the float32 dequantized model's.
    float32 inputs (`--opt f32`; prefill: dequantize by band + GEMM; one token: the native
    matrix-vector product): up to rounding. int16 inputs (`--opt auto`, as the decode kernels
    take them; prefill: the batched integer product): within the int16 rounding of the
    inputs, and the same next token everywhere."""
    from chatbot.engine.backends.native.packed import PackedLinear, with_activations

    form = {"float32": kernels.ACT_F32, "int16": kernels.ACT_I16}[act]
    ids = default_model.tokenizer("Tell me a story about a cat who learned to fly. " * 3)["input_ids"]
    model = with_activations(default_model.model, form)
    assert {m.act for m in model.modules() if isinstance(m, PackedLinear)} == {form}
    with torch.no_grad():
        for n in (1, 3, len(ids)):
            x = torch.tensor([ids[:n]])
            got, ref = model(x).logits, dense_default(x).logits
            tol = 1e-4 if act == "float32" else 1e-2  # logits reach ~20 here
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
            assert torch.equal(got.argmax(-1), ref.argmax(-1))


@needs_kernels
def test_opt_level_sets_the_prefill_arithmetic_without_changing_the_model(default_model):
    """`--opt auto` prefills with int16 inputs like its decode kernels (the decoder's
    `prefill_model`, a view of the model); `f32` computes in float32. The loaded model
    itself stays in float32 whatever decoders are made on it."""
    from chatbot.engine.backends.native.decoder import make_decoder
    from chatbot.engine.backends.native.packed import PackedLinear

    model = default_model.model

    def forms(m) -> set[int]:
        return {x.act for x in m.modules() if isinstance(x, PackedLinear)}

    for level, form in [("auto", kernels.ACT_I16), ("f32", kernels.ACT_F32), ("auto", kernels.ACT_I16)]:
        decoder, _ = make_decoder(model, level)
        assert decoder is not None and forms(decoder.prefill_model) == {form}, level
        assert (decoder.prefill_model is model) == (form == kernels.ACT_F32), level
        assert forms(model) == {kernels.ACT_F32}, level
    assert make_decoder(model, "off") == (None, None)
    assert forms(model) == {kernels.ACT_F32}
