"""Random but valid GGUF tensors and files: every byte laid out as ggml lays it out.

Used by the tests of the kernels (random blocks of every format) and by
`scripts/make-synthetic-gguf`, which writes models of a real architecture and size with
random weights, to measure memory and speed at scales that cannot be downloaded here.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from chatbot.engine.backends.native.architectures import ARCHITECTURES, BY_GGUF_ARCH
from chatbot.engine.backends.native.formats import FORMATS

# block (weights, bytes) and where the scale fields sit, with the largest integer a weight's
# scale multiplies (so random blocks get weights of about the size asked for)
BLOCKS: dict[str, tuple[int, int, tuple[int, ...], tuple[int, ...], float, tuple[int, ...]]] = {
    # name: (weights, bytes, offsets of the fp16 scales `d`, offsets of fp16 mins, d's
    # multiplier, offsets of the E8M0 scales of MXFP4)
    f.gguf_name: (f.block_weights, f.block_bytes, f.scale_at, f.min_at, f.scale_top, f.e8m0_at)
    for f in FORMATS
    if f.is_block
}
FLOAT_TYPES = tuple(f.gguf_name for f in FORMATS if not f.is_block)


def random_blocks(kind: str, n_weights: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """`n_weights` weights of block type `kind` as random valid bytes (uint8 [n_blocks, bytes]):
    every quant and sub-block scale random, the fp16 scales finite and chosen so that weights
    stay within about ±`scale` (as a trained model's, whose weights are small); MXFP4's E8M0
    scales the power of two 2^(e - 127) at or below that float16 scale would be."""
    per_block, nbytes, d_at, m_at, top, e8m0_at = BLOCKS[kind]
    if n_weights % per_block:
        raise ValueError(f"{kind} needs a multiple of {per_block} weights, got {n_weights}")
    n = n_weights // per_block
    out = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    d64 = scale / top * rng.uniform(0.25, 1.0, size=n)
    d = d64.astype(np.float16)
    for at in e8m0_at:
        out[:, at] = np.clip(np.floor(np.log2(np.maximum(d64, 2.0**-127))) + 127, 0, 254).astype(np.uint8)
    for at in d_at:
        out[:, at : at + 2] = d.view(np.uint8).reshape(n, 2)
    for at in m_at:
        # Q4_1/Q5_1 add m; the K-quants subtract dmin * (6-bit min): both about -scale / 2
        mins = scale * rng.uniform(0.1, 0.5, size=n) / (1.0 if kind in ("Q4_1", "Q5_1") else 63.0)
        sign = -1.0 if kind in ("Q4_1", "Q5_1") else 1.0
        out[:, at : at + 2] = (sign * mins).astype(np.float16).view(np.uint8).reshape(n, 2)
    return out


def random_floats(
    kind: str, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1.0
) -> np.ndarray:
    """Random weights of a float type: F32 / F16 as such, BF16 as its raw uint16 bits."""
    w = (rng.standard_normal(shape) * scale / 3).astype(np.float32)
    if kind == "F32":
        return w
    if kind == "F16":
        return w.astype(np.float16)
    if kind == "BF16":
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    raise ValueError(f"not a float type: {kind}")


# --- synthetic model files ---------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The dimensions of a published model (from its config.json)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    head_dim: int = 0  # 0: hidden // heads
    rope_theta: float = 10000.0
    # Llama-3.1/3.2 rope scaling: (factor, low_freq_factor, high_freq_factor, original context)
    llama3_rope: tuple[float, float, float, int] | None = None
    sliding_window: int = 0  # gemma: the window of the sliding-attention layers
    context: int = 32768
    linear_rope: float = 0.0  # Gemma-3 4B+: the global layers' positions divided by this
    yarn: tuple[float, int] | None = None  # YaRN rope scaling: (factor, original context)
    # mixtures of experts: `experts` experts of width `expert_ffn`, `experts_used` per token
    # (then `ffn` is unused); qwen2moe also a shared expert of width `shared_ffn`
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0

    def params(self) -> int:
        d = self.head_dim or self.hidden // self.heads
        attn = self.hidden * d * (2 * self.heads + 2 * self.kv_heads)
        norms = 4 if self.sliding_window else 2  # gemma: a norm before and after each block
        if self.experts:
            mlp = self.experts * (3 * self.hidden * self.expert_ffn + self.hidden)
            mlp += 3 * self.hidden * self.shared_ffn + (self.hidden if self.shared_ffn else 0)
        else:
            mlp = 3 * self.hidden * self.ffn
        per_layer = attn + mlp + norms * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def active_params(self) -> int:
        """The parameters one token reads (the chosen experts' only)."""
        if not self.experts:
            return self.params()
        idle = self.layers * (self.experts - self.experts_used) * 3 * self.hidden * self.expert_ffn
        return self.params() - idle


# Real shapes by architecture; "tiny" is for tests (every matrix whole K-quant super-blocks).
SHAPES: dict[str, dict[str, Shape]] = {
    "qwen2": {
        "tiny": Shape("tiny", 256, 2, 4, 2, 512, 49152, True, rope_theta=1e6),
        "0.5B": Shape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True, rope_theta=1e6),
        "1.5B": Shape("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True, rope_theta=1e6),
        "3B": Shape("Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True, rope_theta=1e6),
        "7B": Shape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, rope_theta=1e6),
    },
    "llama": {
        "tiny": Shape("tiny", 256, 2, 4, 2, 512, 49152, True),
        "135M": Shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, rope_theta=1e5),
        "0.4B": Shape("SmolLM2-360M", 960, 32, 15, 5, 2560, 49152, True, rope_theta=1e5),
        "1B": Shape(
            "Llama-3.2-1B",
            2048,
            16,
            32,
            8,
            8192,
            128256,
            True,
            rope_theta=5e5,
            llama3_rope=(32.0, 1.0, 4.0, 8192),
        ),
        "3B": Shape(
            "Llama-3.2-3B",
            3072,
            28,
            24,
            8,
            8192,
            128256,
            True,
            rope_theta=5e5,
            llama3_rope=(32.0, 1.0, 4.0, 8192),
        ),
        "8B": Shape(
            "Llama-3.1-8B",
            4096,
            32,
            32,
            8,
            14336,
            128256,
            False,
            rope_theta=5e5,
            llama3_rope=(8.0, 1.0, 4.0, 8192),
        ),
    },
    "qwen3": {
        # transformers reads no head size from a qwen3 GGUF and takes its default, 128
        "tiny": Shape("tiny", 256, 2, 4, 2, 512, 49152, True, head_dim=128, rope_theta=1e6),
        "0.6B": Shape("Qwen3-0.6B", 1024, 28, 16, 8, 3072, 151936, True, head_dim=128, rope_theta=1e6),
        "1.7B": Shape("Qwen3-1.7B", 2048, 28, 16, 8, 6144, 151936, True, head_dim=128, rope_theta=1e6),
        "4B": Shape("Qwen3-4B", 2560, 36, 32, 8, 9728, 151936, True, head_dim=128, rope_theta=1e6),
        "8B": Shape("Qwen3-8B", 4096, 36, 32, 8, 12288, 151936, False, head_dim=128, rope_theta=1e6),
    },
    # Mixtures of experts. Qwen3-30B-A3B: 48 layers (`--layers` writes a slice of a few).
    "qwen3moe": {
        "tiny": Shape("tiny", 256, 2, 4, 2, 512, 49152, True, head_dim=64, rope_theta=1e6,
                      experts=8, experts_used=2, expert_ffn=256),
        "30B-A3B": Shape("Qwen3-30B-A3B", 2048, 48, 32, 4, 6144, 151936, False, head_dim=128,
                         rope_theta=1e6, experts=128, experts_used=8, expert_ffn=768, context=40960),
    },
    "qwen2moe": {
        # untied, as llama.cpp's qwen2moe needs an output.weight
        "tiny": Shape("tiny", 256, 2, 4, 2, 512, 49152, False, rope_theta=1e6,
                      experts=8, experts_used=2, expert_ffn=256, shared_ffn=512),
        "A2.7B": Shape("Qwen1.5-MoE-A2.7B", 2048, 24, 16, 16, 5632, 151936, False, rope_theta=1e6,
                       experts=60, experts_used=4, expert_ffn=1408, shared_ffn=5632, context=8192),
    },
    # gpt-oss: MXFP4 experts with biases, attention sinks, a window on every other layer
    # (the tiny file's small, so tests cross it), YaRN rope; `ffn` is the experts' width too;
    # the vocabulary has room for harmony's control tokens (`HARMONY_SPECIALS`)
    "gpt-oss": {
        "tiny": Shape("tiny", 256, 2, 4, 2, 256, 49280, False, head_dim=64, rope_theta=150000.0,
                      sliding_window=16, context=2048, experts=8, experts_used=2, expert_ffn=256,
                      yarn=(8.0, 256)),
        "20b": Shape("gpt-oss-20b", 2880, 24, 64, 8, 2880, 201088, False, head_dim=64, rope_theta=150000.0,
                     sliding_window=128, context=131072, experts=32, experts_used=4, expert_ffn=2880,
                     yarn=(32.0, 4096)),
    },
    # Gemma: heads of 256 (transformers scales the scores by 1/16, the query_pre_attn_scalar
    # it does not read from the file, as llama.cpp does by the head size: so the tiny files
    # have 256-wide heads too); small windows in the tiny files, so tests cross them;
    # gemma3's every sixth layer is global, so its tiny file has six.
    "gemma2": {
        "tiny": Shape("tiny", 256, 2, 2, 1, 512, 16384, True, head_dim=256, sliding_window=16, context=8192),
        "2B": Shape("Gemma-2-2B", 2304, 26, 8, 4, 9216, 256000, True, head_dim=256, sliding_window=4096,
                    context=8192),
    },
    "gemma3": {
        "tiny": Shape("tiny", 256, 6, 2, 1, 512, 16384, True, head_dim=256, rope_theta=1e6,
                      sliding_window=16),
        "270M": Shape("Gemma-3-270M", 640, 18, 4, 1, 2048, 262144, True, head_dim=256, rope_theta=1e6,
                      sliding_window=512),
        "1B": Shape("Gemma-3-1B", 1152, 26, 4, 1, 6912, 262144, True, head_dim=256, rope_theta=1e6,
                    sliding_window=512),
        "4B": Shape("Gemma-3-4B", 2560, 34, 8, 4, 10240, 262144, True, head_dim=256, rope_theta=1e6,
                    sliding_window=1024, context=131072, linear_rope=8.0),
    },
}  # fmt: skip
GEMMA = tuple(a.gguf_arch for a in ARCHITECTURES if a.gguf_arch and a.sentencepiece)
"""The architectures whose files hold a sentencepiece vocabulary and Gemma's chat template."""
FILE_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "F16")
# llama.cpp's fallback when a row is not whole 256-weight super-blocks (llama_tensor_get_type)
_K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def pick_shape(arch: str, params: str) -> Shape:
    """The preset of `arch` named `params` ("0.5B"), or else the one nearest in size.

    Raises:
        ValueError: an unknown architecture or size.
    """
    if arch not in SHAPES:
        raise ValueError(f"unknown architecture {arch!r}: choose from {', '.join(SHAPES)}")
    shapes = SHAPES[arch]
    if params in shapes:
        return shapes[params]
    try:
        want = float(params.upper().removesuffix("B")) * (1e9 if params.upper().endswith("B") else 1)
    except ValueError:
        raise ValueError(f"--params takes a size such as 0.5B or one of {', '.join(shapes)}") from None
    if params.upper().endswith("M"):
        want = float(params.upper().removesuffix("M")) * 1e6
    return min((s for k, s in shapes.items() if k != "tiny"), key=lambda s: abs(s.params() - want))


def tensor_type(file_type: str, role: str, layer: int, n_layers: int, cols: int) -> str:
    """The type llama.cpp's quantizer gives a tensor in a `file_type` file (its main rules:
    Q4_K_M / Q5_K_M keep the output matrix and about half the v / ffn_down matrices in Q6_K)."""
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}.get(file_type)
    if base is None:
        kind = file_type
    elif role in ("output", "token_embd_tied"):
        kind = "Q6_K"
    elif role in ("attn_v", "ffn_down"):
        # llama.cpp's use_more_bits: the first and last eighth of the layers, and every third
        more = layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2
        kind = "Q6_K" if more else base
    else:
        kind = base
    if kind in _K_FALLBACK and cols % 256:
        kind = _K_FALLBACK[kind]
    return kind


def llama3_rope_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> np.ndarray:
    """The ``rope_freqs.weight`` tensor llama.cpp's converter writes for a Llama-3.1+ model
    (``rope_type: llama3``): per rotary frequency, the number its angle is divided by (1 for
    short wavelengths, `factor` for long ones, a smooth blend between)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / freqs
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blend = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original_context / high_freq_factor, 1.0,
                   np.where(wavelen > original_context / low_freq_factor, factor, blend))  # fmt: skip
    return out.astype(np.float32)


def _tokenizer_fields(source: Path) -> dict[str, Any]:
    """The tokenizer metadata of a GGUF file (the default model's: a 49k BPE with ChatML).

    `gguf.GGUFReader` takes ~2.3 s to parse that vocabulary, and every synthetic file (a
    test writes several) takes its tokenizer from it: the fields are read once per process
    and file version (path, size, modification time); lists come back as tuples, in a dict
    of the caller's own."""
    st = Path(source).stat()
    return dict(_read_tokenizer_fields(str(source), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _read_tokenizer_fields(source: str, size: int, mtime_ns: int) -> dict[str, Any]:
    from gguf import GGUFReader

    del size, mtime_ns  # the cache's key only
    reader = GGUFReader(source)
    keys = ["model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
            "unknown_token_id", "padding_token_id"]  # fmt: skip
    out = {
        k: reader.fields[f"tokenizer.ggml.{k}"].contents()
        for k in keys
        if f"tokenizer.ggml.{k}" in reader.fields
    }
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}
    out["chat_template"] = reader.fields["tokenizer.chat_template"].contents()
    return out


# Gemma's turn layout: "<start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n", the
# messages trimmed. Gemma 2 refuses a system message; Gemma 3 puts it before the first user
# message.
_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "SYSTEM"
    "{%- else -%}{%- set prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
GEMMA_TEMPLATES = {
    "gemma2": _GEMMA_TEMPLATE.replace("SYSTEM", "{{ raise_exception('System role not supported') }}"),
    "gemma3": _GEMMA_TEMPLATE.replace(
        "SYSTEM",
        "{%- set prefix = messages[0]['content'] | trim + '\\n\\n' -%}"
        "{%- set loop_messages = messages[1:] -%}",
    ),
}
GEMMA_SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4,
                  "<start_of_turn>": 106, "<end_of_turn>": 107}  # fmt: skip
"""Gemma's special tokens where its vocabulary has them (5-105 are unused)."""


def sentencepiece_vocab(vocab: int, source: Path) -> dict[str, Any]:
    """A sentencepiece ("llama") vocabulary of `vocab` tokens laid out as Gemma's: the special
    tokens (`GEMMA_SPECIALS`), the 256 byte tokens ``<0x00>``..``<0xFF>``, then text pieces
    ("\u2581" for a space) best first, then ``<unused N>`` to the size. The pieces are the
    byte-level BPE vocabulary of `source` (a GGUF file) spelled as text, in its order, so
    that each is two earlier ones joined (as the merges transformers and llama.cpp derive
    from a Gemma vocabulary, which lists none, expect); their scores fall with the position.

    Returns:
        tokens, scores, token_type (gguf.TokenType values) and the special ids.
    """
    import gguf

    fields = _tokenizer_fields(source)
    bpe, bpe_types = fields["tokens"], fields["token_type"]
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # byte-level BPE spells each byte as a printable character (GPT-2's table)
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    tokens = [f"<unused{i - 5}>" for i in range(108)]
    types = [int(gguf.TokenType.UNUSED)] * 108
    for text, i in GEMMA_SPECIALS.items():
        tokens[i] = text
        types[i] = int(gguf.TokenType.UNKNOWN if text == "<unk>" else gguf.TokenType.CONTROL)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [int(gguf.TokenType.BYTE)] * 256
    seen = set(tokens)
    n_fixed = len(tokens)
    for piece, kind in zip(bpe, bpe_types, strict=True):
        if len(tokens) >= vocab:
            break
        try:
            text = bytes(to_byte[c] for c in piece).decode("utf-8")
        except (KeyError, UnicodeDecodeError):  # a piece of a character: bytes cover it
            continue
        if kind != int(gguf.TokenType.NORMAL) or any(ord(c) < 32 and c not in "\n\t" for c in text):
            continue
        text = text.replace(" ", "\u2581")
        if text not in seen:
            seen.add(text)
            tokens.append(text)
            types.append(int(gguf.TokenType.NORMAL))
    scores = [0.0] * n_fixed + [-float(i) for i in range(len(tokens) - n_fixed)]
    pad = vocab - len(tokens)
    tokens += [f"<unused{101 + i}>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    scores += [0.0] * pad
    return {"tokens": tokens, "scores": scores, "token_type": types}


HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>",
                    "<|return|>", "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|reserved_200009|>", "<|reserved_200010|>",
                    "<|reserved_200011|>", "<|call|>")  # fmt: skip
"""gpt-oss's control tokens, from id 199998 on in its vocabulary (o200k_harmony)."""
GPT_OSS_TEMPLATE = Path(__file__).parent / "data" / "gpt-oss-chat-template.jinja"
"""gpt-oss's chat template as OpenAI publishes it (openai/gpt-oss-20b, Apache-2.0)."""


def _add_bpe_tokenizer(
    w: Any, vocab: int, source: Path, chat_template: bool = True, harmony: bool = False
) -> None:
    """The tokenizer of `source` (a byte-level BPE), padded with unused tokens to `vocab`;
    with `harmony`, gpt-oss's control tokens in the padding (at their own ids where the
    vocabulary is gpt-oss's size, else at its end), its EOS and its chat template."""
    import gguf

    tok = _tokenizer_fields(source)
    tokens = list(tok["tokens"])
    room = len(HARMONY_SPECIALS) if harmony else 0
    if len(tokens) + room > vocab:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than the vocabulary {vocab}")
    types = list(tok["token_type"])
    tokens += [f"<|unused_{i}|>" for i in range(vocab - len(tokens))]
    types += [int(gguf.TokenType.UNUSED)] * (vocab - len(types))
    if harmony:
        first = min(199998, vocab - room)
        for i, special in enumerate(HARMONY_SPECIALS):
            if special in tokens[:first]:  # the base vocabulary's <|endoftext|>: no token twice
                special = f"<|reserved_{first + i}|>"
            tokens[first + i], types[first + i] = special, int(gguf.TokenType.CONTROL)
        tok["eos_token_id"] = first + HARMONY_SPECIALS.index("<|return|>")
        tok["chat_template"] = GPT_OSS_TEMPLATE.read_text(encoding="utf-8")
    w.add_tokenizer_model(str(tok["model"]))
    if "pre" in tok:
        w.add_tokenizer_pre(str(tok["pre"]))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(tok["merges"]))
    for key, add in [
        ("bos_token_id", w.add_bos_token_id),
        ("eos_token_id", w.add_eos_token_id),
        ("unknown_token_id", w.add_unk_token_id),
        ("padding_token_id", w.add_pad_token_id),
    ]:
        if key in tok:
            add(int(tok[key]))
    if chat_template:
        w.add_chat_template(str(tok["chat_template"]))


def _add_sentencepiece_tokenizer(
    w: Any, arch: str, vocab: int, source: Path, chat_template: bool = True
) -> None:
    """A Gemma-like sentencepiece vocabulary, written as llama.cpp's converter writes Gemma's
    (no merges, BOS added, no space prefix)."""
    sp = sentencepiece_vocab(vocab, source)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(sp["tokens"])
    w.add_token_scores(sp["scores"])
    w.add_token_types(sp["token_type"])
    w.add_bos_token_id(GEMMA_SPECIALS["<bos>"])
    w.add_eos_token_id(GEMMA_SPECIALS["<eos>"])
    w.add_unk_token_id(GEMMA_SPECIALS["<unk>"])
    w.add_pad_token_id(GEMMA_SPECIALS["<pad>"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    if chat_template:
        w.add_chat_template(GEMMA_TEMPLATES[arch])


def write_synthetic_gguf(
    path: Path,
    arch: str,
    shape: Shape,
    file_type: str,
    seed: int = 0,
    tokenizer_from: Path | None = None,
    chat_template: bool = True,
) -> dict[str, Any]:
    """Write a GGUF model file of `arch` with `shape`, random weights (fixed `seed`) in the
    tensor types llama.cpp gives a `file_type` file, and a tokenizer: for llama/qwen the
    default model's (its vocabulary padded with unused tokens to the shape's size), for
    gemma a sentencepiece vocabulary made from it (`sentencepiece_vocab`) with Gemma's
    chat template. Gemma files hold what llama.cpp's converter writes: four norms per layer
    (gemma3: and q/k norms), each stored as 1 + the weight transformers' RMSNorm holds, and
    the sliding window (and gemma2's soft-capping) in the metadata. `chat_template=False`
    leaves `tokenizer.chat_template` out (a file whose template must be guessed).

    Returns:
        A summary: parameters, bytes, tensor types and their counts.
    """
    import gguf

    from chatbot.models.loader import default_gguf_path

    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown type {file_type!r}: choose from {', '.join(FILE_TYPES)}")
    rng = np.random.default_rng(seed)
    head_dim = shape.head_dim or shape.hidden // shape.heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"synthetic {shape.name}")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    row = BY_GGUF_ARCH[arch]
    if row.rope_dims_in_metadata:
        w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    if row.logit_softcapping:
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    if shape.linear_rope:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(shape.linear_rope)
    if shape.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(shape.yarn[0])
        w.add_rope_scaling_orig_ctx_len(shape.yarn[1])
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
        if shape.shared_ffn:
            w.add_expert_shared_feed_forward_length(shape.shared_ffn)
    w.add_vocab_size(shape.vocab)
    if arch in GEMMA:
        _add_sentencepiece_tokenizer(
            w, arch, shape.vocab, tokenizer_from or default_gguf_path(), chat_template
        )
    else:
        _add_bpe_tokenizer(
            w, shape.vocab, tokenizer_from or default_gguf_path(), chat_template, harmony=arch == "gpt-oss"
        )

    # (name, rows, cols, role, layer); 1-D tensors have rows == 0
    plan: list[tuple[str, int, int, str, int]] = [
        ("token_embd.weight", shape.vocab, shape.hidden, "token_embd_tied" if shape.tied else "token_embd", 0)
    ]
    q_rows, kv_rows = shape.heads * head_dim, shape.kv_heads * head_dim
    norm_names = {tensor for _, _, tensor in row.norms}
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", 0, shape.hidden, "norm", i)]
        plan += [(b + "attn_q.weight", q_rows, shape.hidden, "attn_q", i),
                 (b + "attn_k.weight", kv_rows, shape.hidden, "attn_k", i),
                 (b + "attn_v.weight", kv_rows, shape.hidden, "attn_v", i)]  # fmt: skip
        if row.qkv_bias:
            plan += [(b + "attn_q.bias", 0, q_rows, "bias", i), (b + "attn_k.bias", 0, kv_rows, "bias", i),
                     (b + "attn_v.bias", 0, kv_rows, "bias", i)]  # fmt: skip
        if row.qk_norm:
            plan += [
                (b + "attn_q_norm.weight", 0, head_dim, "norm", i),
                (b + "attn_k_norm.weight", 0, head_dim, "norm", i),
            ]
        plan += [(b + "attn_output.weight", shape.hidden, q_rows, "attn_output", i)]
        if row.gpt_oss:  # the output's bias, each head's sink logit
            plan += [(b + "attn_output.bias", 0, shape.hidden, "bias", i),
                     (b + "attn_sinks.weight", 0, shape.heads, "sink", i)]  # fmt: skip
        if "post_attention_norm" in norm_names:  # gemma: a norm after attention and the MLP too
            plan += [(b + "post_attention_norm.weight", 0, shape.hidden, "norm", i)]
        if "ffn_norm" in norm_names:  # (gpt-oss: post_attention_norm is its norm before the MLP)
            plan += [(b + "ffn_norm.weight", 0, shape.hidden, "norm", i)]
        if row.gpt_oss:  # biases of the router and of each expert's gate, up and down
            n, f = shape.experts, shape.expert_ffn
            plan += [(b + "ffn_gate_inp.bias", 0, n, "bias", i),
                     (b + "ffn_gate_exps.bias", n, f, "exp_bias", i),
                     (b + "ffn_up_exps.bias", n, f, "exp_bias", i),
                     (b + "ffn_down_exps.bias", n, shape.hidden, "exp_bias", i)]  # fmt: skip
        if shape.experts:
            # the router in float32 (llama.cpp's quantizer leaves it), then the experts'
            # matrices as 3-D tensors: `rows` counts the rows of all experts together
            n, f = shape.experts, shape.expert_ffn
            plan += [(b + "ffn_gate_inp.weight", n, shape.hidden, "router", i),
                     (b + "ffn_gate_exps.weight", n * f, shape.hidden, "ffn_gate", i),
                     (b + "ffn_up_exps.weight", n * f, shape.hidden, "ffn_up", i),
                     (b + "ffn_down_exps.weight", n * shape.hidden, f, "ffn_down", i)]  # fmt: skip
            if shape.shared_ffn:
                sf = shape.shared_ffn
                plan += [(b + "ffn_gate_inp_shexp.weight", 0, shape.hidden, "shexp_gate", i),
                         (b + "ffn_gate_shexp.weight", sf, shape.hidden, "ffn_gate", i),
                         (b + "ffn_up_shexp.weight", sf, shape.hidden, "ffn_up", i),
                         (b + "ffn_down_shexp.weight", shape.hidden, sf, "ffn_down", i)]  # fmt: skip
        else:
            plan += [(b + "ffn_gate.weight", shape.ffn, shape.hidden, "ffn_gate", i),
                     (b + "ffn_up.weight", shape.ffn, shape.hidden, "ffn_up", i),
                     (b + "ffn_down.weight", shape.hidden, shape.ffn, "ffn_down", i)]  # fmt: skip
        if "post_ffw_norm" in norm_names:
            plan += [(b + "post_ffw_norm.weight", 0, shape.hidden, "norm", i)]
    plan.append(("output_norm.weight", 0, shape.hidden, "norm", 0))
    if shape.llama3_rope is not None:
        plan.append(("rope_freqs.weight", 0, head_dim // 2, "rope_freqs", 0))
    if not shape.tied:
        plan.append(("output.weight", shape.vocab, shape.hidden, "output", 0))

    counts: dict[str, int] = {}
    kinds = []
    for name, rows, cols, role, layer in plan:
        if rows == 0:
            kind = "F32"
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        elif role in ("router", "exp_bias"):
            kind = "F32"
            w.add_tensor_info(name, (rows, cols), np.dtype(np.float32), rows * cols * 4)
        else:
            kind = tensor_type(file_type, role, layer, shape.layers, cols)
            if row.gpt_oss and name.endswith("_exps.weight"):
                kind = "MXFP4"  # gpt-oss's experts, as published and as llama.cpp keeps them
            per_block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            nbytes = rows * cols // per_block * block_bytes
            # the writer takes quantized shapes in bytes per row; experts' tensors are 3-D
            byte_shape: tuple[int, ...] = (rows, nbytes // rows)
            if name.endswith("_exps.weight"):
                byte_shape = (shape.experts, rows // shape.experts, nbytes // rows)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, gguf.GGMLQuantizationType[kind])
            counts[kind] = counts.get(kind, 0) + 1
        kinds.append(kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # Weights of about a trained model's size: |w| up to ~0.1 in the matrices (so the logits
    # are neither flat nor saturated), norms near 1, small biases.
    for (name, rows, cols, role, _), kind in zip(plan, kinds, strict=True):
        if role == "rope_freqs":
            assert shape.llama3_rope is not None
            w.write_tensor_data(llama3_rope_factors(head_dim, shape.rope_theta, *shape.llama3_rope))
        elif role == "router":
            w.write_tensor_data(random_floats("F32", (rows, cols), rng, scale=1.0))
        elif role == "exp_bias":
            w.write_tensor_data((0.1 * rng.standard_normal((rows, cols))).astype(np.float32))
        elif role == "sink":  # about the size of a head's scores, so the sink takes a real share
            w.write_tensor_data(rng.standard_normal(cols).astype(np.float32))
        elif rows == 0:
            arr = 1.0 + 0.1 * rng.standard_normal(cols) if role == "norm" else 0.1 * rng.standard_normal(cols)
            if role == "shexp_gate":  # the shared expert's gate: sigmoid(w . x) of about 0.5 +- 0.4
                arr = rng.standard_normal(cols) / np.sqrt(cols)
            w.write_tensor_data(arr.astype(np.float32))
        elif kind in BLOCKS:
            w.write_tensor_data(random_blocks(kind, rows * cols, rng, scale=0.1).reshape(rows, -1))
        else:
            w.write_tensor_data(random_floats(kind, (rows, cols), rng, scale=0.1).view(np.uint8))
    w.close()
    return {"params": shape.params(), "bytes": path.stat().st_size, "types": counts, "shape": shape.name}


# --- command line (scripts/make-synthetic-gguf) ---------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make-synthetic-gguf",
        description="Write a GGUF model file with random weights in a real architecture and size.",
        epilog="sizes: " + "; ".join(f"{a}: {', '.join(s)}" for a, s in SHAPES.items()),
    )
    parser.add_argument("--arch", choices=sorted(SHAPES), default="qwen2")
    parser.add_argument(
        "--params", default="0.5B", help="a size such as 0.5B (the nearest real model), or tiny"
    )
    parser.add_argument("--type", dest="file_type", choices=FILE_TYPES, default="Q4_K_M")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layers", type=int, help="write only this many layers (a slice of a large model, for benches)"
    )
    parser.add_argument(
        "-o", "--out", type=Path, help="output file (default: synthetic-ARCH-PARAMS-TYPE.gguf)"
    )
    args = parser.parse_args(argv)
    try:
        shape = pick_shape(args.arch, args.params)
    except ValueError as exc:
        parser.error(str(exc))  # exits
    if args.layers is not None:
        if not 1 <= args.layers <= shape.layers:
            parser.error(f"--layers takes 1 to {shape.layers} for {shape.name}")
        name = f"{shape.name} ({args.layers} of {shape.layers} layers)"
        shape = replace(shape, layers=args.layers, name=name)
    out = args.out or Path(f"synthetic-{args.arch}-{args.params}-{args.file_type}.gguf")
    start = time.perf_counter()
    try:
        summary = write_synthetic_gguf(out, args.arch, shape, args.file_type, seed=args.seed)
    except (OSError, ValueError) as exc:
        print(f"make-synthetic-gguf: error: {exc}", file=sys.stderr)
        return 2
    types = ", ".join(f"{n} {k}" for k, n in sorted(summary["types"].items(), key=lambda kv: -kv[1]))
    print(
        f"{out}: {args.arch} shaped as {shape.name}, {summary['params'] / 1e9:.2f}B parameters, "
        f"{summary['bytes'] / 2**20:.0f} MiB ({types} matrices) in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
