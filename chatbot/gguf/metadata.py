"""A GGUF file's metadata checked against its tensors before a load, as llama.cpp checks it:
a file whose metadata lies is refused in one line naming the first inconsistency, instead of
answering garbage (a layer silently ignored, q/k/v biases left unused, rope or epsilon NaN).

What is checked (`check_metadata`):
- the keys name the file's own architecture: ``{arch}.block_count`` and the other sizes are
  there, and no key belongs to another architecture (``qwen2.*`` keys under
  ``general.architecture = llama``);
- ``block_count`` equals the layers present, each ``blk.N`` for N below it;
- the main tensors have the shapes the sizes give (embedding, q/k/v/o, the MLP, the norms),
  and the architecture uses every tensor (a llama file has no q/k/v biases);
- the tokenizer's arrays (scores, token types) have one entry per token, and the vocabulary
  is the embedding's length;
- rope base and scaling, RMS epsilon, soft-capping and the sizes are finite and in range.

Only the header is read (a 150k-token vocabulary is skipped, not decoded): a few ms.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatbot.gguf.table import TensorInfo, read_tensor_table

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}  # fmt: skip
_SCALAR_BYTES = {k: struct.calcsize(v) for k, v in _SCALARS.items()}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# Key prefixes that are no architecture's (llama.cpp's general/tokenizer/split/... namespaces)
_SHARED = {"general", "tokenizer", "split", "quantize", "imatrix", "adapter", "clip"}
# Per-layer tensors each architecture this project builds from blocks uses (`gguf_model`);
# another architecture's files are only checked for their sizes and keys.
_LAYER = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
          "ffn_down"]  # fmt: skip
_GEMMA = [*_LAYER, "post_attention_norm", "post_ffw_norm"]
# A mixture of experts' layer: attention as its dense family's, then a router and the experts
_MOE = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps",
        "ffn_up_exps", "ffn_down_exps"]  # fmt: skip
_EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
LAYER_TENSORS: dict[str, set[str]] = {
    "llama": {f"{n}.weight" for n in _LAYER},
    "qwen2": {f"{n}.weight" for n in _LAYER} | {"attn_q.bias", "attn_k.bias", "attn_v.bias"},
    "qwen3": {f"{n}.weight" for n in [*_LAYER, "attn_q_norm", "attn_k_norm"]},
    "gemma2": {f"{n}.weight" for n in _GEMMA},
    "gemma3": {f"{n}.weight" for n in [*_GEMMA, "attn_q_norm", "attn_k_norm"]},
    "qwen3moe": {f"{n}.weight" for n in [*_MOE, "attn_q_norm", "attn_k_norm"]},
    "qwen2moe": {
        f"{n}.weight"
        for n in [*_MOE, "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    }
    | {"attn_q.bias", "attn_k.bias", "attn_v.bias"},
    # gpt-oss: llama.cpp's post_attention_norm is its norm before the MLP; biases everywhere
    "gpt-oss": {f"{n}.weight" for n in _MOE if n != "ffn_norm"}
    | {"post_attention_norm.weight", "attn_sinks.weight"}
    | {f"{n}.bias" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", *_EXPS)},
}
_GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}


class InconsistentMetadata(ValueError):
    """The metadata disagrees with the tensors, or holds a value out of range (the message
    says which, in one line)."""


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array, summarized: its item type and length (strings are not decoded)."""

    item_type: int
    count: int
    values: tuple[Any, ...] = ()  # numbers of a short array (at most 64)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a GGUF file: scalars and strings as values, arrays as `ArrayValue`.

    Raises:
        ValueError: not a GGUF v2/v3 file, or a damaged header.
    """
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise ValueError(f"{path} is not a GGUF v2/v3 file") from None
    with buf:
        try:
            magic, version, _, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
            if magic != b"GGUF" or version not in (2, 3):
                raise ValueError(f"{path} is not a GGUF v2/v3 file")
            out: dict[str, Any] = {}
            pos = 24
            for _ in range(n_kv):
                key, pos = _string(buf, pos)
                (kind,) = struct.unpack_from("<I", buf, pos)
                out[key], pos = _value(buf, pos + 4, kind)
        except (struct.error, UnicodeDecodeError):
            raise ValueError(f"{path} has a truncated or damaged GGUF header") from None
    return out


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = _U64.unpack_from(buf, pos)
    if pos + 8 + n > len(buf):
        raise struct.error("past the end")
    return buf[pos + 8 : pos + 8 + n].decode(), pos + 8 + n


def _value(buf: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        return struct.unpack_from(_SCALARS[kind], buf, pos)[0], pos + _SCALAR_BYTES[kind]
    if kind == _STRING:
        return _string(buf, pos)
    if kind != _ARRAY:
        raise ValueError(f"a metadata value has an unknown type ({kind})")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in _SCALARS:
        size = _SCALAR_BYTES[item]
        values = struct.unpack_from(f"<{count}{_SCALARS[item][1]}", buf, pos) if count <= 64 else ()
        return ArrayValue(item, count, values), pos + size * count
    if item == _STRING:
        unpack = _U64.unpack_from
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        return ArrayValue(item, count), pos
    if item != _ARRAY:
        raise ValueError(f"a metadata array has items of an unknown type ({item})")
    for _ in range(count):
        _, pos = _value(buf, pos, _ARRAY)
    return ArrayValue(item, count), pos


def check_metadata(path: str | Path) -> None:
    """Check a GGUF file's metadata against its tensor table (see the module's docstring).

    Raises:
        InconsistentMetadata: the first inconsistency, in one line.
        ValueError: the file cannot be read as GGUF.
    """
    meta = read_metadata(path)
    _, table = read_tensor_table(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InconsistentMetadata("its metadata has no general.architecture")
    _check_keys(meta, arch)
    _check_scalars(meta, arch)
    tensors = {t.name: t for t in table}
    _check_layers(meta, arch, tensors)
    _check_tokenizer(meta, tensors)
    _check_shapes(meta, arch, tensors)


def _check_keys(meta: dict[str, Any], arch: str) -> None:
    for key in meta:
        prefix = key.split(".", 1)[0]
        if prefix != arch and prefix not in _SHARED and "." in key:
            raise InconsistentMetadata(
                f"its metadata key {key} is not of its architecture {arch} (general.architecture): "
                "the file was converted or edited wrongly"
            )
    for need in ("block_count", "embedding_length", "attention.head_count"):
        if f"{arch}.{need}" not in meta:
            raise InconsistentMetadata(f"its metadata lacks {arch}.{need}, which a {arch} model needs")


def _number(meta: dict[str, Any], key: str) -> float | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, ArrayValue):  # per-layer values (head counts of some files)
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InconsistentMetadata(f"its metadata {key} is {value!r}, not a number")
    return float(value)


# key suffix: (lowest allowed, highest allowed, lowest excluded) for finite values
_RANGES: dict[str, tuple[float, float, bool]] = {
    "block_count": (1, 4096, False),
    "embedding_length": (1, 1 << 20, False),
    "feed_forward_length": (1, 1 << 22, False),
    "context_length": (1, 1 << 26, False),
    "attention.head_count": (1, 4096, False),
    "attention.head_count_kv": (1, 4096, False),
    "attention.key_length": (1, 1 << 16, False),
    "attention.value_length": (1, 1 << 16, False),
    "rope.dimension_count": (1, 1 << 16, False),
    "rope.freq_base": (0, 1e12, True),
    "rope.scaling.factor": (0, 1e6, True),
    "attention.layer_norm_rms_epsilon": (0, 0.1, True),
    "attention.layer_norm_epsilon": (0, 0.1, True),
    "attn_logit_softcapping": (0, 1e6, True),
    "final_logit_softcapping": (0, 1e6, True),
    "attention.sliding_window": (0, 1 << 26, False),
    "expert_count": (1, 1 << 16, False),
    "expert_used_count": (1, 1 << 16, False),
    "expert_feed_forward_length": (1, 1 << 22, False),
    "expert_shared_feed_forward_length": (1, 1 << 22, False),
}


def _check_scalars(meta: dict[str, Any], arch: str) -> None:
    for suffix, (low, high, open_low) in _RANGES.items():
        key = f"{arch}.{suffix}"
        value = _number(meta, key)
        if value is None:
            continue
        if not math.isfinite(value) or value < low or (open_low and value == low) or value > high:
            bound = f"above {low:g}" if open_low else f"at least {low:g}"
            raise InconsistentMetadata(
                f"its metadata {key} is {value:g}, which is out of range ({bound}, at most {high:g})"
            )
    experts = _number(meta, f"{arch}.expert_count")
    used = _number(meta, f"{arch}.expert_used_count")
    if arch in LAYER_TENSORS and "ffn_gate_inp.weight" in LAYER_TENSORS[arch]:
        for need in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
            if _number(meta, f"{arch}.{need}") is None:
                raise InconsistentMetadata(f"its metadata lacks {arch}.{need}, which a {arch} model needs")
    if experts is not None and used is not None and used > experts:
        raise InconsistentMetadata(
            f"its metadata says {used:g} experts per token ({arch}.expert_used_count) of {experts:g} "
            f"({arch}.expert_count)"
        )
    heads = _number(meta, f"{arch}.attention.head_count")
    kv = _number(meta, f"{arch}.attention.head_count_kv")
    if heads and kv and heads % kv:
        raise InconsistentMetadata(
            f"its metadata says {heads:g} attention heads and {kv:g} key/value heads, which do not divide"
        )


_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _check_layers(meta: dict[str, Any], arch: str, tensors: dict[str, TensorInfo]) -> None:
    count = int(_number(meta, f"{arch}.block_count") or 0)
    layers: dict[int, set[str]] = {}
    for name in tensors:
        m = _BLOCK.fullmatch(name)
        if m:
            layers.setdefault(int(m.group(1)), set()).add(m.group(2))
        elif arch in LAYER_TENSORS and name not in _GLOBAL_TENSORS:
            raise InconsistentMetadata(f"it holds a tensor {name}, which a {arch} model does not use")
    extra = sorted(n for n in layers if n >= count)
    if extra:
        raise InconsistentMetadata(
            f"its metadata says {count} layers ({arch}.block_count) but it holds blk.{extra[-1]}: "
            f"{len(layers)} layers in the tensors"
        )
    missing = [n for n in range(count) if n not in layers]
    if missing:
        raise InconsistentMetadata(
            f"its metadata says {count} layers ({arch}.block_count) but it has no tensors of blk.{missing[0]}"
        )
    wanted = LAYER_TENSORS.get(arch)
    if wanted is None:
        return
    for n in range(count):
        lacks = sorted(wanted - layers[n])
        if lacks:
            raise InconsistentMetadata(f"it has no blk.{n}.{lacks[0]}, which every {arch} layer needs")
        unused = sorted(layers[n] - wanted)
        if unused:
            raise InconsistentMetadata(
                f"it holds blk.{n}.{unused[0]}, which a {arch} layer does not use "
                "(the architecture in its metadata is not the one it was converted from?)"
            )


def _check_tokenizer(meta: dict[str, Any], tensors: dict[str, TensorInfo]) -> None:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, ArrayValue):
        return
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        value = meta.get(key)
        if isinstance(value, ArrayValue) and value.count != tokens.count:
            raise InconsistentMetadata(
                f"its metadata {key} has {value.count:,} entries for {tokens.count:,} tokens"
            )
    embd = tensors.get("token_embd.weight")
    if embd is not None and len(embd.shape) == 2 and embd.shape[1] < tokens.count:
        raise InconsistentMetadata(
            f"its vocabulary has {tokens.count:,} tokens but token_embd.weight has {embd.shape[1]:,} rows"
        )
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and not 0 <= value < tokens.count:
            raise InconsistentMetadata(
                f"its metadata tokenizer.ggml.{key} is {value}, outside its {tokens.count:,} tokens"
            )


def _check_shapes(meta: dict[str, Any], arch: str, tensors: dict[str, TensorInfo]) -> None:
    """The main tensors' shapes (ggml order: columns first) against the sizes."""
    hidden = int(_number(meta, f"{arch}.embedding_length") or 0)
    heads = int(_number(meta, f"{arch}.attention.head_count") or 0)
    kv = int(_number(meta, f"{arch}.attention.head_count_kv") or heads)
    ffn = int(_number(meta, f"{arch}.feed_forward_length") or 0)
    head_dim = int(_number(meta, f"{arch}.attention.key_length") or (hidden // heads if heads else 0))
    value_dim = int(_number(meta, f"{arch}.attention.value_length") or head_dim)
    experts = int(_number(meta, f"{arch}.expert_count") or 0)
    expert_ffn = int(_number(meta, f"{arch}.expert_feed_forward_length") or 0)
    shared_ffn = int(_number(meta, f"{arch}.expert_shared_feed_forward_length") or 0)
    want: dict[str, tuple[int, ...]] = {"output_norm.weight": (hidden,)}
    embd = tensors.get("token_embd.weight")
    if embd is not None:
        want["token_embd.weight"] = (hidden, embd.shape[-1])
    count = int(_number(meta, f"{arch}.block_count") or 0)
    for n in range(count if arch in LAYER_TENSORS else 0):
        b = f"blk.{n}."
        want |= {
            b + "attn_norm.weight": (hidden,),
            b + "attn_q.weight": (hidden, heads * head_dim),
            b + "attn_k.weight": (hidden, kv * head_dim),
            b + "attn_v.weight": (hidden, kv * value_dim),
            b + "attn_output.weight": (heads * value_dim, hidden),
        }
        if experts:
            want |= {b + "ffn_gate_inp.weight": (hidden, experts),
                     b + "ffn_gate_exps.weight": (hidden, expert_ffn, experts),
                     b + "ffn_up_exps.weight": (hidden, expert_ffn, experts),
                     b + "ffn_down_exps.weight": (expert_ffn, hidden, experts)}  # fmt: skip
            if arch == "gpt-oss":
                want |= {b + "attn_sinks.weight": (heads,), b + "ffn_gate_inp.bias": (experts,),
                         b + "ffn_gate_exps.bias": (expert_ffn, experts),
                         b + "ffn_up_exps.bias": (expert_ffn, experts),
                         b + "ffn_down_exps.bias": (hidden, experts)}  # fmt: skip
            if shared_ffn:
                want |= {b + "ffn_gate_inp_shexp.weight": (hidden,),
                         b + "ffn_gate_shexp.weight": (hidden, shared_ffn),
                         b + "ffn_up_shexp.weight": (hidden, shared_ffn),
                         b + "ffn_down_shexp.weight": (shared_ffn, hidden)}  # fmt: skip
        elif ffn:
            want |= {b + "ffn_gate.weight": (hidden, ffn), b + "ffn_up.weight": (hidden, ffn),
                     b + "ffn_down.weight": (ffn, hidden)}  # fmt: skip
    for name, shape in want.items():
        t = tensors.get(name)
        if t is not None and tuple(t.shape) != shape:
            have, need = "x".join(map(str, t.shape)), "x".join(map(str, shape))
            raise InconsistentMetadata(f"its tensor {name} is {have}, the metadata's sizes give {need}")
