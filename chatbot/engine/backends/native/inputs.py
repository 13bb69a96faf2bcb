"""How the inputs of the native kernels' block-format products are held, per product site:
float32, int16 per block (``exact``), int8 as llama.cpp rounds them (``fast``), or int8 where
this build's int8 product is faster and int16 elsewhere (``auto``). `FastDecoder`
(`chatbot.engine.backends.native.decoder`) asks `choose_inputs` once per model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.model import NativeModel

SITES = ("qkv", "o", "gate/up", "down", "head")
"""The products of a layer and the head, in the order of kernels.c's ``SITE_*`` (each site's
matrices share one input vector, so its inputs have one form)."""


@dataclass(frozen=True)
class Inputs:
    """How the inputs of the block-format products are held.

    Attributes:
        act: the kernels' form (`kernels.ACT_*`) of every product's inputs...
        int16_sites: ...but with ``act`` int8, the products of the sites whose bit is set here
            (1 << index in `SITES`) take int16 ones.
        label: short, for banners: ``int16``, ``int8``, ``int8+int16`` or ``float32``.
        why: what is held how, and why, in a few words.
    """

    act: int
    int16_sites: int = 0
    label: str = "float32"
    why: str = ""


def choose_inputs(level: str, native: NativeModel, lib: Any) -> Inputs:
    """The form of the inputs of each product for `level`.

    - ``exact``: int16 per block of 32 (2^-16 of the block's largest value: 258x finer than
      int8), into every product: the integer products of the block formats, near float32's.
    - ``fast``, ``int8``, ``int4``: int8, as llama.cpp rounds them (per 32 values, per 256
      into the K-quants: ggml's Q8_1/Q8_0 and Q8_K), into every product.
    - ``auto``: int8 into the products whose int8 form is faster in this build
      (``chatbot_int8_faster``: Q4_1, and Q4_K/Q6_K in 8-row tiles, on AVX2), int16 into the
      rest. So no product's inputs are coarser than llama.cpp's on the same file (its own
      int8 where we take int8, finer elsewhere), and with the KV cache in float32
      (llama.cpp's is float16) the next-token distributions sit at or below llama.cpp's
      distance from float32's: measured on the default model and on a K-quant file of real
      weights (docs/benchmarks.md, "The default chooses its inputs"). Where no product
      gains, ``auto`` is ``exact``; where all do, ``fast``.
    """
    mats = [native.embed, native.lm_head, *native.layer_matrices()]
    if level == "f32" or not any(p.fmt in kernels.INT16_PRODUCTS for p in mats):
        return Inputs(kernels.ACT_F32, 0, "float32", "")
    if level in ("fast", "int8", "int4"):
        return Inputs(kernels.ACT_Q8, 0, "int8", "int8 inputs as llama.cpp's, into every product")
    int16 = "int16 inputs, 2^-16 steps"
    if level == "exact":
        return Inputs(kernels.ACT_I16, 0, "int16", int16)
    faster = [
        all(lib.chatbot_int8_faster(p.fmt, int(p.x8)) for layer in site for p in layer)
        for site in native.sites()
    ]
    if not any(faster):
        return Inputs(kernels.ACT_I16, 0, "int16", f"{int16}: no product of this file is faster in int8")
    int16_sites = sum(1 << i for i, fast in enumerate(faster) if not fast)
    where = ", ".join(n for n, fast in zip(SITES, faster, strict=True) if fast)
    if all(faster):
        return Inputs(kernels.ACT_Q8, 0, "int8", "int8 as llama.cpp's, faster in every product here")
    if all(faster[:4]):
        where = "the layers"
    why = f"int8 as llama.cpp's into {where}, faster there; int16 elsewhere"
    return Inputs(kernels.ACT_Q8, int16_sites, "int8+int16", why)
