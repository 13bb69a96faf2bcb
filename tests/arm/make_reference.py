"""The x86 side of `scripts/test-arm`: inputs for the aarch64 build of the kernels and this
machine's outputs for them, in a folder that `tests/arm/driver.c` reads under qemu.

    python tests/arm/make_reference.py OUT [--no-default-model]

Writes OUT/manifest.txt, one check per line, and the binary files it names:

    product NAME FMT ACT ROWS COLS
        NAME.w (the matrix as the kernels read it), NAME.x (float32 [COLS]), NAME.y (this
        library's product, float32 [ROWS]), NAME.exact (float64 [ROWS]: the dequantized
        weights times x as the kernels hold it for this format and ACT, in float64) and
        NAME.bound (float64 [ROWS]: |w| . |x|, the scale of the rounding errors).
    decode NAME STEPS
        NAME.txt (the Model struct: its numbers, and where each array lies in NAME.bin),
        NAME.bin, NAME.tokens (int32 [STEPS]) and NAME.logits (float32 [STEPS, vocab]: this
        library's logits after each token, decoded from an empty cache).

Every product is of random valid blocks (`gguf_synthetic.random_blocks`) of one format with
each activation form; the decodes are one step after another of real architectures built
by the library's own `FastDecoder`, with their matrices replaced by random blocks of every
format, and of the default model (SmolLM2-135M, Q4_1) as `--opt exact` runs it.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.decoder import FastDecoder
from devtools.gguf_synthetic import BLOCKS, FLOAT_TYPES, random_blocks, random_floats

ROWS, COLS = 40, 512  # two K-quant super-blocks, sixteen 32-blocks per row
ACTS = {"f32": kernels.ACT_F32, "q8": kernels.ACT_Q8, "i16": kernels.ACT_I16}
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}
# the formats whose products take the integer activations (csrc/matvec.c, dot_vec)
Q8_FORMATS = {"Q8_0", "Q4_1", "MXFP4"}
I16_FORMATS = {"Q8_0", "Q4_1", "Q4_0", "Q5_0", "Q5_1", "MXFP4", *K_QUANTS}


def random_matrix(kind: str, rows: int, cols: int, rng: np.random.Generator, scale: float) -> torch.Tensor:
    """A [rows, cols] matrix of format `kind` as the kernels read it (uint8 rows, or float32)."""
    if kind in BLOCKS:
        raw = random_blocks(kind, rows * cols, rng, scale=scale)
    else:
        raw = random_floats(kind, (rows, cols), rng, scale=scale)
    return torch.from_numpy(raw.view(np.uint8) if kind != "F32" else raw).reshape(rows, -1)


def held(x: np.ndarray, kind: str, act: int) -> np.ndarray:
    """x as the kernels hold it in a product with a `kind` matrix (csrc/int_products.c,
    prepare_blocks and prepare_k): int8 or int16 per block with a float32 scale, or x itself. The K-quants
    take int8 per super-block of 256 (`--opt fast`) as they take int16."""
    if act == kernels.ACT_Q8 and kind in Q8_FORMATS:
        block, top = 32, 127.0
    elif act == kernels.ACT_Q8 and kind in K_QUANTS:
        block, top = 256, 127.0
    elif act == kernels.ACT_Q8 and kind in I16_FORMATS:  # Q4_0, Q5_0, Q5_1: the int16 products
        block, top = 32, 127.0
    elif act == kernels.ACT_I16 and kind in I16_FORMATS:
        block, top = (256 if kind in K_QUANTS else 32), 32767.0
    else:
        return x.astype(np.float64)
    b = x.reshape(-1, block).astype(np.float32)
    d = (np.abs(b).max(axis=1, keepdims=True) / np.float32(top)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(b * inv).astype(np.float64) * d).reshape(-1)


def write_products(out: Path, lines: list[str]) -> None:
    rng = np.random.default_rng(24)
    x = rng.standard_normal(COLS).astype(np.float32)
    x[64:96] *= 100.0  # blocks of very different sizes: each has its own scale
    x[256:288] = 0.0
    for kind in [*BLOCKS, *FLOAT_TYPES]:
        packed = kernels.from_raw(
            random_matrix(kind, ROWS, COLS, rng, 0.5), kernels.GGUF_FORMATS[kind], ROWS, COLS
        )
        w = kernels.unpack(packed, threads=1).numpy().astype(np.float64)
        for act_name, act in ACTS.items():
            name = f"{kind.lower()}_{act_name}"
            y = kernels.matvec(packed, torch.from_numpy(x), threads=1, act=act).numpy()
            xs = held(x, kind, act)
            packed.data.numpy().tofile(out / f"{name}.w")
            x.tofile(out / f"{name}.x")
            y.astype(np.float32).tofile(out / f"{name}.y")
            (w @ xs).tofile(out / f"{name}.exact")
            (np.abs(w) @ np.abs(xs)).tofile(out / f"{name}.bound")
            lines.append(f"product {name} {packed.fmt} {act} {ROWS} {COLS}")


# --- whole decode steps ------------------------------------------------------------------------

# the formats of the tiny models' matrices, by layer: [q, k, v], [o], [gate, up], [down]
MIXED = [
    (["Q4_K", "Q5_K", "Q6_K"], ["Q8_0"], ["Q5_0", "Q5_1"], ["Q4_1"]),
    (["Q2_K", "Q3_K", "F16"], ["BF16"], ["F32", "Q4_0"], ["MXFP4"]),
]


def tiny_model(arch: str) -> Any:
    """A random transformers model of `arch`, 256 wide (whole K-quant super-blocks)."""
    import transformers

    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in names[arch])
    settings: dict[str, Any] = dict(  # noqa: C408 - keyword form, as the configs take them
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    if arch == "gemma2":  # soft-capping, a sliding window and gelu: the other elementwise kernels
        settings.update(sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    torch.manual_seed(0)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def mixed_decoder(arch: str, act: int) -> tuple[FastDecoder, list[Any]]:
    """The library's decoder of a tiny `arch` model, its matrices replaced by random blocks in
    the formats of MIXED (every format once at least), embedding F16 and head Q6_K; `act`: the
    activation form. Also what must stay alive while the struct points into it."""
    dec = FastDecoder(tiny_model(arch), "f32", threads=2)
    rng = np.random.default_rng(7)
    keep: list[Any] = []
    s = dec.struct
    rows = {
        "wqkv": [s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_kv_heads * s.head_dim],
        "wo": [s.dim],
        "wgu": [s.ffn_dim, s.ffn_dim],
        "wdown": [s.dim],
    }
    cols = {"wqkv": s.dim, "wo": s.n_heads * s.head_dim, "wgu": s.dim, "wdown": s.ffn_dim}
    for slot, name in enumerate(rows):
        groups = []
        for layer in range(s.n_layers):
            parts = [
                kernels.from_raw(random_matrix(kind, n, cols[name], rng, 2.0 / cols[name] ** 0.5),
                                 kernels.GGUF_FORMATS[kind], n, cols[name])
                for kind, n in zip(MIXED[layer % 2][slot], rows[name], strict=True)
            ]  # fmt: skip
            keep.append(parts)
            groups.append(kernels.group_struct(parts))  # no biases in these architectures
        arr = (kernels.Group * s.n_layers)(*groups)
        keep.append(arr)
        setattr(s, name, arr)
    for field, kind, n in (("embed", "F16", s.vocab), ("lm_head", "Q6_K", s.vocab)):
        p = kernels.from_raw(random_matrix(kind, n, s.dim, rng, 1.0), kernels.GGUF_FORMATS[kind], n, s.dim)
        mat = p.as_struct()
        keep.extend([p, mat])
        setattr(s, field, ctypes.pointer(mat))
    s.act = act
    return dec, keep


class Blob:
    """Arrays laid out one after the other (64-byte aligned), with lines naming them."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.lines: list[str] = []

    def add(self, name: str, data: bytes, head: str = "a") -> None:
        pad = -self.size % 64
        self.chunks.append(b"\0" * pad)
        self.size += pad
        self.lines.append(f"{head} {name} {self.size} {len(data)}")
        self.chunks.append(data)
        self.size += len(data)

    def mat(self, name: str, m: kernels.Mat) -> None:
        per_block, block_bytes = kernels.BLOCK_SHAPES[m.fmt]
        nbytes = m.rows * (m.cols // per_block) * block_bytes
        self.add(name, ctypes.string_at(m.data, nbytes), f"m {m.fmt} {m.rows} {m.cols}")


def dump_model(dec: FastDecoder, steps: int, cap: int, out: Path, name: str) -> None:
    """The struct of `dec` (numbers, then every array it points to) into NAME.txt / NAME.bin,
    with empty caches of `cap` positions and rope tables cut to `steps` positions."""
    s, blob = dec.struct, Blob()
    L, E, D, F = s.n_layers, s.dim, s.head_dim, s.ffn_dim
    for f in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab", "act", "act_fn"):
        blob.lines.append(f"i {f} {int(getattr(s, f))}")
    for f in ("eps", "attn_scale", "embed_scale", "attn_softcap", "final_softcap"):
        blob.lines.append(f"f {f} {float(getattr(s, f)).hex()}")
    blob.lines.append(f"i rope_len {steps}")
    blob.lines.append(f"i cap {cap}")
    rope = steps * (D // 2) * 4
    for f in ("rope_cos", "rope_sin", "rope_cos2", "rope_sin2"):
        blob.add(f, ctypes.string_at(getattr(s, f), rope))
    blob.mat("embed", s.embed.contents)
    blob.mat("lm_head", s.lm_head.contents)
    blob.add("final_norm", ctypes.string_at(s.final_norm, E * 4))
    for f, n in (("attn_norm", E), ("ffn_norm", E), ("q_norm", D), ("k_norm", D),
                 ("post_attn_norm", E), ("post_ffn_norm", E)):  # fmt: skip
        ptrs = getattr(s, f)
        if ptrs:
            for layer in range(L):
                blob.add(f"{f}.{layer}", ctypes.string_at(ptrs[layer], n * 4))
    for f in ("window", "rope_sel"):
        ints = getattr(s, f)
        if ints:
            blob.add(f, ctypes.string_at(ints, L * 4))
    for f in ("wqkv", "wo", "wgu", "wdown"):
        for layer in range(L):
            g = getattr(s, f)[layer]
            blob.lines.append(f"g {f}.{layer} {g.n_parts} {g.rows}")
            for p in range(g.n_parts):
                blob.mat(f"{f}.{layer}.{p}", g.part[p])
            if g.bias:
                blob.add(f"{f}.{layer}.bias", ctypes.string_at(g.bias, g.rows * 4))
    assert F > 0
    (out / f"{name}.txt").write_text("\n".join(blob.lines) + "\n")
    with open(out / f"{name}.bin", "wb") as f:
        f.writelines(blob.chunks)


def run_steps(dec: FastDecoder, tokens: list[int], cap: int) -> np.ndarray:
    """This library's logits [steps, vocab] after each token, from empty caches."""
    s = dec.struct
    size = s.n_kv_heads * cap * s.head_dim
    caches = [torch.zeros(size) for _ in range(2 * s.n_layers)]
    ptrs = ctypes.c_void_p * s.n_layers
    kc = ptrs(*[c.data_ptr() for c in caches[: s.n_layers]])
    vc = ptrs(*[c.data_ptr() for c in caches[s.n_layers :]])
    s.kcache, s.vcache, s.cap, s.n_threads = kc, vc, cap, 2
    scratch = torch.empty(int(dec.lib.chatbot_scratch_floats(ctypes.byref(s), 2)))
    s.scratch = scratch.data_ptr()
    logits = np.zeros((len(tokens), s.vocab), dtype=np.float32)
    out = torch.empty(s.vocab)
    for pos, token in enumerate(tokens):
        assert dec.lib.chatbot_decode(ctypes.byref(s), token, pos, out.data_ptr()) == 0
        logits[pos] = out.numpy()
    return logits


def write_decode(out: Path, lines: list[str], name: str, dec: FastDecoder, tokens: list[int]) -> None:
    cap = 16
    dump_model(dec, len(tokens), cap, out, name)
    np.asarray(tokens, dtype=np.int32).tofile(out / f"{name}.tokens")
    run_steps(dec, tokens, cap).tofile(out / f"{name}.logits")
    lines.append(f"decode {name} {len(tokens)}")


def default_decoder() -> FastDecoder:
    """The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) as `--opt exact` decodes it (int16
    inputs everywhere: the driver sets the struct's `act` alone; `auto`'s per-site int8 on
    x86 is the same C as the int8 decodes of the mixed models above)."""
    from chatbot.models.loader import load_model

    loaded = load_model(None, device="cpu")
    return FastDecoder(loaded.model, "exact", threads=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--no-default-model", action="store_true", help="skip the SmolLM2 decode")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    lines: list[str] = []
    write_products(args.out, lines)
    tokens = [1, 17, 300, 42, 5, 511, 2, 99]
    for arch in ("llama", "gemma2"):
        for act_name, act in ACTS.items():
            if arch == "gemma2" and act != kernels.ACT_I16:
                continue
            dec, keep = mixed_decoder(arch, act)
            write_decode(args.out, lines, f"decode_{arch}_mixed_{act_name}", dec, tokens)
            del keep
    if not args.no_default_model:
        dec = default_decoder()
        write_decode(args.out, lines, "decode_smollm2_q4_1_exact", dec, [1, 504, 2683, 28, 314])
    (args.out / "manifest.txt").write_text("\n".join(lines) + "\n")
    print(f"make_reference: {len(lines)} checks written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
