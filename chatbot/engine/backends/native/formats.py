"""The weight formats of the native kernels: one row per format, the single source for Python.

Each row says what kernels.c calls the format (its ``FMT_*`` enum value), what GGUF calls it
(the ggml type's name and id), and how ggml lays out one block: how many weights, how many
bytes, where its float16 scales lie. Everything else in Python that knows about a format
(`chatbot.engine.backends.native.kernels`, the GGUF readers, the synthetic GGUF writer) reads this table;
tests/test_kernel_formats.py checks kernels.c's enum and block sizes against it.

A new format is one row here plus its code in kernels.c (the enum value, `block_len`,
`block_bytes`, its dequantization and products).

MXFP4 (gpt-oss's experts) is the one format whose scale is not a float16: one E8M0 byte, a
power of two (`e8m0_at`), over 4-bit E2M1 codes; csrc/formats.c has its layout.
"""

from __future__ import annotations

from dataclasses import dataclass

QK = 32
"""Weights per block of the 32-weight formats (ggml's ``QK4_0``... ``QK8_0``)."""
QK_K = 256
"""Weights per K-quant super-block (ggml's ``QK_K``)."""


@dataclass(frozen=True)
class KernelFormat:
    """One weight format the kernels read.

    Attributes:
        name: the kernels' short name (``q4_k``), shown in banners.
        gguf_name: the ggml type's name in GGUF files (``Q4_K``, `gguf.GGMLQuantizationType`).
        ggml_type: the ggml type id stored in a GGUF tensor table.
        code: the value of kernels.c's ``FMT_*`` enum constant (``FMT_Q4_K``).
        block_weights: weights per block (1 for the float formats).
        block_bytes: bytes per block, as ggml's block struct.
        scale_at: byte offsets in a block of its float16 scales ``d``.
        min_at: byte offsets of its float16 mins (``m`` of Q4_1/Q5_1, ``dmin`` of K-quants).
        scale_top: the largest integer a block's ``d`` multiplies (0 for the float formats):
            random blocks with ``d = scale / scale_top`` hold weights of about ``scale``
            (MXFP4: the largest E2M1 value, 6, that its scale ``2^(e - 127)`` multiplies).
        e8m0_at: byte offsets of its E8M0 scales, a biased exponent ``e`` for ``2^(e - 127)``
            (MXFP4), where the other block formats have float16 ones.
        int16_products: kernels.c has integer products with int16 activations (``ACT_I16``)
            for it on AVX2 and NEON; the others multiply float32 activations.
        tiled: `kernels.tile_rows` lays its rows out in tiles of 8 (kernels.c's "8-row tiles").
    """

    name: str
    gguf_name: str
    ggml_type: int
    code: int
    block_weights: int
    block_bytes: int
    scale_at: tuple[int, ...] = ()
    min_at: tuple[int, ...] = ()
    scale_top: float = 0.0
    int16_products: bool = False
    tiled: bool = False
    e8m0_at: tuple[int, ...] = ()

    @property
    def is_block(self) -> bool:
        """A quantized block format (not float32, float16 or bfloat16)."""
        return self.block_weights > 1

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` weights (a multiple of `block_weights`)."""
        return cols // self.block_weights * self.block_bytes


# fmt: off
FORMATS: tuple[KernelFormat, ...] = (
    KernelFormat("f32", "F32", 0, 0, 1, 4),
    KernelFormat("bf16", "BF16", 30, 1, 1, 2),
    KernelFormat("q8_0", "Q8_0", 8, 2, QK, 34, (0,), (), 127.0, int16_products=True),
    KernelFormat("q4_1", "Q4_1", 3, 3, QK, 20, (0,), (2,), 15.0, int16_products=True),
    KernelFormat("f16", "F16", 1, 4, 1, 2),
    KernelFormat("q4_0", "Q4_0", 2, 5, QK, 18, (0,), (), 8.0, int16_products=True),
    KernelFormat("q5_0", "Q5_0", 6, 6, QK, 22, (0,), (), 16.0, int16_products=True),
    KernelFormat("q5_1", "Q5_1", 7, 7, QK, 24, (0,), (2,), 31.0, int16_products=True),
    KernelFormat("q2_k", "Q2_K", 10, 8, QK_K, 84, (80,), (82,), 15.0 * 3),
    KernelFormat("q3_k", "Q3_K", 11, 9, QK_K, 110, (108,), (), 32.0 * 4),
    KernelFormat("q4_k", "Q4_K", 12, 10, QK_K, 144, (0,), (2,), 63.0 * 15, int16_products=True, tiled=True),
    KernelFormat("q5_k", "Q5_K", 13, 11, QK_K, 176, (0,), (2,), 63.0 * 31, int16_products=True),
    KernelFormat("q6_k", "Q6_K", 14, 12, QK_K, 210, (208,), (), 128.0 * 32, int16_products=True, tiled=True),
    KernelFormat("mxfp4", "MXFP4", 39, 13, QK, 17, (), (), 6.0, int16_products=True, e8m0_at=(0,)),
)
# fmt: on

BY_CODE: dict[int, KernelFormat] = {f.code: f for f in FORMATS}
"""The formats by kernels.c's enum value."""
BY_GGUF_NAME: dict[str, KernelFormat] = {f.gguf_name: f for f in FORMATS}
"""The formats by their GGUF type name (``Q4_K``)."""
