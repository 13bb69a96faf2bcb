"""The weights of the fast decode path: the model's matrices packed for the native kernels.

`FastDecoder` (`chatbot.engine.backends.native.decoder`) takes its matrices from one of three
places: the packed modules of a GGUF model loaded as it is (`from_packed`), the GGUF file a dequantized model
was loaded from (`from_gguf`), or the model's own float weights packed in the format of the
optimization level (`from_model`, `packer`). Each returns (embed, lm_head, then per layer the
row blocks of qkv, o, gate/up, down).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from chatbot.config import FILE_LEVELS
from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.gguf_weights import GGUFWeights
from chatbot.engine.backends.native.packed import PackedEmbedding, PackedExperts, PackedLinear, dense_weight


def is_packed(model: Any) -> bool:
    """Every matrix of the model is a packed module (a GGUF model loaded as it is); False for a
    model not laid out as the Llama family is (gpt2...)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        return False
    mods = [model.get_input_embeddings(), model.get_output_embeddings()]
    for layer in inner.layers:
        att, mlp = layer.self_attn, layer.mlp
        mods += [att.q_proj, att.k_proj, att.v_proj, att.o_proj]
        experts = getattr(mlp, "experts", None)
        mods += [experts] if experts is not None else [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        shared = getattr(mlp, "shared_expert", None)
        mods += [shared.gate_proj, shared.up_proj, shared.down_proj] if shared is not None else []
    return all(isinstance(m, (PackedLinear, PackedEmbedding, PackedExperts)) for m in mods)


def tied(model: Any) -> bool:
    """The output matrix is the input embedding (as packed matrices or as tensors)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embed, PackedEmbedding) or isinstance(head, PackedLinear):
        return getattr(embed, "packed", None) is getattr(head, "packed", 0)
    return bool(head.weight.data_ptr() == embed.weight.data_ptr())


def packer(level: str) -> Any:
    """pack(role, *row_blocks) -> one packed matrix in the level's format."""

    def pack(role: str, *parts: torch.Tensor) -> kernels.PackedMatrix:
        parts = tuple(w.detach() for w in parts)
        if level in FILE_LEVELS:  # the same weights; the inputs differ (fast.choose_inputs)
            return kernels.pack_lossless(*parts)
        if level == "f32" or any(w.shape[1] % kernels.QK for w in parts):
            return kernels.stack([kernels.pack_f32(w) for w in parts])
        fmt = kernels.FMT_Q8_0 if level == "int8" or role == "embed" else kernels.FMT_Q4_1
        return kernels.quantize_rows(list(parts), fmt)[0]

    return pack


def from_model(model: Any, level: str) -> tuple[Any, ...]:
    """(embed, lm_head, then per layer the row blocks of qkv, o, gate/up, down), packed
    from the model's float weights in the level's format."""
    pack = packer(level)
    w = dense_weight  # a packed module's weights are dequantized, one matrix at a time
    embed = pack("embed", w(model.get_input_embeddings()))
    lm_head = embed if tied(model) else pack("embed", w(model.get_output_embeddings()))
    wqkv, wo, wgu, wdown = [], [], [], []
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        wqkv.append([pack("layer", w(att.q_proj), w(att.k_proj), w(att.v_proj))])
        wo.append([pack("layer", w(att.o_proj))])
        wgu.append([pack("layer", w(mlp.gate_proj), w(mlp.up_proj))])
        wdown.append([pack("layer", w(mlp.down_proj))])
    return embed, lm_head, wqkv, wo, wgu, wdown


def from_packed(model: Any) -> tuple[Any, ...] | None:
    """The same matrices as `from_model`, shared with a model whose modules hold them
    packed already (`chatbot.models.gguf_model`: a GGUF file's blocks); None otherwise."""
    if not is_packed(model):
        return None
    embed = model.get_input_embeddings().packed
    lm_head = model.get_output_embeddings().packed
    wqkv, wo, wgu, wdown = [], [], [], []
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        wqkv.append([att.q_proj.packed, att.k_proj.packed, att.v_proj.packed])
        wo.append([att.o_proj.packed])
        experts = getattr(mlp, "experts", None)
        if isinstance(experts, PackedExperts):  # every expert's rows, as the file holds them
            wgu.append([experts.gate, experts.up])
            wdown.append([experts.down])
            continue
        wgu.append([mlp.gate_proj.packed, mlp.up_proj.packed])
        wdown.append([mlp.down_proj.packed])
    return embed, lm_head, wqkv, wo, wgu, wdown


def from_gguf(model: Any, path: str | Path, heads: int, kv_heads: int) -> tuple[Any, ...] | None:
    """The same matrices as `from_model`, taken from the GGUF file the model was loaded
    from, in their stored formats (no copy). None where the file does not hold the
    model's weights as expected (then the model's own weights are packed instead)."""
    try:
        src = GGUFWeights(path)
        embed = src.matrix("token_embd.weight")
        lm_head = embed if tied(model) else src.matrix("output.weight")
        wqkv, wo, wgu, wdown = [], [], [], []
        for i in range(len(model.model.layers)):
            b = f"blk.{i}."
            wqkv.append([
                src.matrix(b + "attn_q.weight", heads), src.matrix(b + "attn_k.weight", kv_heads),
                src.matrix(b + "attn_v.weight"),
            ])  # fmt: skip
            wo.append([src.matrix(b + "attn_output.weight")])
            wgu.append([src.matrix(b + "ffn_gate.weight"), src.matrix(b + "ffn_up.weight")])
            wdown.append([src.matrix(b + "ffn_down.weight")])
    except (KeyError, ValueError, OSError):
        return None
    # Same shapes as the model's, and the same weights where it is cheap to look: the
    # first layer's q and k (which would show a wrong row order) and the embedding's
    # first rows. Float32 rounding of the dequantization may differ in the last bit.
    layer0 = model.model.layers[0]
    pairs = [
        (embed, model.get_input_embeddings().weight),
        (lm_head, model.get_output_embeddings().weight),
    ]
    for i, layer in enumerate(model.model.layers):
        att, mlp = layer.self_attn, layer.mlp
        mods = [(wqkv[i], [att.q_proj, att.k_proj, att.v_proj]), (wo[i], [att.o_proj]),
                (wgu[i], [mlp.gate_proj, mlp.up_proj]), (wdown[i], [mlp.down_proj])]  # fmt: skip
        for parts, ms in mods:
            pairs += [(p, m.weight) for p, m in zip(parts, ms, strict=True)]
    if any((p.rows, p.cols) != tuple(w.shape) for p, w in pairs):
        return None
    checks = [(wqkv[0][0], layer0.self_attn.q_proj.weight), (wqkv[0][1], layer0.self_attn.k_proj.weight)]
    for p, w in checks:
        if not torch.allclose(kernels.unpack(p, threads=1), w.detach().float(), rtol=1e-5, atol=1e-7):
            return None
    return embed, lm_head, wqkv, wo, wgu, wdown
