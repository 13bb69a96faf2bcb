"""Random but valid GGUF tensors and files: every byte laid out as ggml lays it out.

Used by the tests of the kernels (random blocks of every format) and by
`scripts/make-synthetic-gguf`, which writes models of a real architecture and size with
random weights, to measure memory and speed at scales that cannot be downloaded here.
"""

from __future__ import annotations

import numpy as np

# block (weights, bytes) and where the fp16 scale fields sit, with the largest integer a
# weight's scale multiplies (so random blocks get weights of about the size asked for)
BLOCKS: dict[str, tuple[int, int, tuple[int, ...], tuple[int, ...], float]] = {
    # name: (weights, bytes, offsets of the fp16 scales `d`, offsets of fp16 mins, d's multiplier)
    "Q8_0": (32, 34, (0,), (), 127.0),
    "Q4_0": (32, 18, (0,), (), 8.0),
    "Q4_1": (32, 20, (0,), (2,), 15.0),
    "Q5_0": (32, 22, (0,), (), 16.0),
    "Q5_1": (32, 24, (0,), (2,), 31.0),
    "Q2_K": (256, 84, (80,), (82,), 15.0 * 3),
    "Q3_K": (256, 110, (108,), (), 32.0 * 4),
    "Q4_K": (256, 144, (0,), (2,), 63.0 * 15),
    "Q5_K": (256, 176, (0,), (2,), 63.0 * 31),
    "Q6_K": (256, 210, (208,), (), 128.0 * 32),
}
FLOAT_TYPES = ("F32", "F16", "BF16")


def random_blocks(kind: str, n_weights: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """`n_weights` weights of block type `kind` as random valid bytes (uint8 [n_blocks, bytes]):
    every quant and sub-block scale random, the fp16 scales finite and chosen so that weights
    stay within about ±`scale` (as a trained model's, whose weights are small)."""
    per_block, nbytes, d_at, m_at, top = BLOCKS[kind]
    if n_weights % per_block:
        raise ValueError(f"{kind} needs a multiple of {per_block} weights, got {n_weights}")
    n = n_weights // per_block
    out = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    d = (scale / top * rng.uniform(0.25, 1.0, size=n)).astype(np.float16)
    for at in d_at:
        out[:, at : at + 2] = d.view(np.uint8).reshape(n, 2)
    for at in m_at:
        # Q4_1/Q5_1 add m; the K-quants subtract dmin * (6-bit min): both about -scale / 2
        mins = scale * rng.uniform(0.1, 0.5, size=n) / (1.0 if kind in ("Q4_1", "Q5_1") else 63.0)
        sign = -1.0 if kind in ("Q4_1", "Q5_1") else 1.0
        out[:, at : at + 2] = (sign * mins).astype(np.float16).view(np.uint8).reshape(n, 2)
    return out


def random_floats(kind: str, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random weights of a float type: F32 / F16 as such, BF16 as its raw uint16 bits."""
    w = (rng.standard_normal(shape) * scale / 3).astype(np.float32)
    if kind == "F32":
        return w
    if kind == "F16":
        return w.astype(np.float16)
    if kind == "BF16":
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    raise ValueError(f"not a float type: {kind}")
