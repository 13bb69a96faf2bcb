"""Packing the fast path's matrices straight from a GGUF file: the tensor table, the q/k row
order of llama files, and the default model decoding from its file's own Q4_1/Q8_0 bytes with
the same greedy tokens as float32 transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import greedy_by_recompute, needs_kernels

from chatbot.engine import kernels
from chatbot.engine.gguf_weights import GGUFWeights, read_tensor_table, unpermute_rows
from chatbot.models.loader import default_gguf_path


def test_tensor_table_equals_gguf_reader():
    from gguf import GGUFReader

    path = default_gguf_path()
    reader = GGUFReader(str(path))
    arch, table = read_tensor_table(path)
    assert arch == str(reader.fields["general.architecture"].contents()) == "llama"
    expected = [(t.name, tuple(int(n) for n in t.shape), t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
                for t in reader.tensors]  # fmt: skip
    assert [(t.name, t.shape, t.type_name, t.offset, t.nbytes) for t in table] == expected
    weights = GGUFWeights(path)
    for t in reader.tensors[:5]:
        assert np.array_equal(weights.tensors[t.name].data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_unpermute_rows_is_transformers_reverse_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    w = np.arange(64 * 3).reshape(64, 3)
    for heads in (4, 2):
        expected = proc._reverse_permute_weights(w, heads, heads)
        assert np.array_equal(w[unpermute_rows(64, heads).numpy()], expected)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensor_table(bad)


@pytest.mark.slow
@needs_kernels
def test_default_model_decodes_from_its_file_losslessly(default_model):
    """`auto` on the default model takes the file's Q4_1/Q8_0 matrices as they are (no copy of
    the layer weights): each equals the float32 model's weight, and the greedy tokens equal
    float32 transformers'."""
    from chatbot.config import SamplingConfig
    from chatbot.engine.fast import FastDecoder
    from chatbot.engine.generate import Engine

    model = default_model.model
    decoder = FastDecoder(model, "auto")
    info = decoder.info()
    assert info.source == "gguf" and set(info.formats) == {"q4_1", "q8_0"}
    assert info.bytes_per_weight < 0.75  # Q4_1: 20 bytes per 32 weights; embedding Q8_0
    layer = model.model.layers[3]
    q, k, v = decoder.wqkv[3]
    for packed, w in [(q, layer.self_attn.q_proj.weight), (k, layer.self_attn.k_proj.weight),
                      (v, layer.self_attn.v_proj.weight), (decoder.wdown[3][0], layer.mlp.down_proj.weight)]:  # fmt: skip
        assert torch.allclose(kernels.unpack(packed), w.float(), rtol=1e-6, atol=1e-7)
    ids = default_model.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    engine = Engine(model, default_model.tokenizer, decoder=decoder)
    greedy = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=40)
    got = [t for c in engine.generate(engine.new_cache(), ids, greedy) for t in c.token_ids]
    assert len(got) >= 20  # the engine stops at an end-of-turn token, the reference does not
    assert got == greedy_by_recompute(model, ids, len(got))
