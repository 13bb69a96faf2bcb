"""The weight matrices of a GGUF file in their stored formats, for the native kernels.

A GGUF file holds each matrix in ggml's layout (Q4_K, Q6_K, Q8_0...), which the kernels read
as they are: the tensors are taken from the `gguf` package's memory-mapped reader without a
copy, so a K-quant model decodes at its native bytes per weight. One difference from the
layout transformers uses: llama.cpp's converter permutes the rows of the q and k matrices of
``llama`` files (to an interleaved rotary layout); transformers undoes it when it loads a GGUF,
and so does `matrix` here, by reordering whole rows (the blocks run along a row, so this
moves bytes and changes no weight).

`check_finite` looks for NaN and infinity where they cost little to find and
would spoil every answer: the float tensors that are small (norms, biases, rope factors) and
the block scales of the embedding and output matrices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.architectures import BY_GGUF_ARCH
from chatbot.engine.backends.native.formats import FORMATS
from chatbot.gguf.table import FileStamp, TensorInfo, read_tensor_table  # re-exported

# Where the float16 scales of a block lie (block bytes, byte offsets of its scales: d, and
# dmin/m where the format has one), as in ggml's block structs.
BLOCK_SCALES = {f.gguf_name: (f.block_bytes, f.scale_at + f.min_at) for f in FORMATS if f.is_block}
# The bits of a float16/bfloat16 exponent: all set in NaN and infinity only.
_EXPONENT = {"F16": 0x7C00, "BF16": 0x7F80}
# How a float tensor is read for the check: float32, or the bits of 16-bit values
FLOATS: dict[str, Any] = {"F32": np.float32, "F16": "<u2", "BF16": "<u2"}
_SMALL_BYTES = 16 << 20  # a float tensor of at most this size is checked whole (not a bigger one)
_CHECKED_SCALES = ("token_embd.weight", "output.weight")  # quantized: their block scales


class NonFiniteWeights(ValueError):
    """A tensor of the file holds NaN or infinity (the message names it)."""


def unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation for `n_head` heads (as
    transformers' `_reverse_permute_weights`, applied to row indices)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


class FileMaps:
    """The memory maps of a GGUF file and of its split's other parts, each made when a tensor
    in it is first asked for (`mode`: numpy's memmap mode)."""

    def __init__(self, path: str | Path, mode: str = "r") -> None:
        self.path, self.mode = str(path), mode
        self._maps: dict[str, np.memmap] = {}

    def bytes_of(self, t: TensorInfo) -> np.ndarray:
        """The bytes of tensor `t` of the table, on its file's map."""
        file = t.file or self.path
        mm = self._maps.get(file)
        if mm is None:
            mm = self._maps[file] = np.memmap(file, dtype=np.uint8, mode=self.mode)  # type: ignore[call-overload]
        return mm[t.offset : t.offset + t.nbytes]


class _MappedTensor:
    """A tensor of the table with its bytes on the file's memory map (the few attributes
    of a GGUFReader tensor that `kernels.from_gguf` reads)."""

    def __init__(self, info: TensorInfo, data: np.ndarray) -> None:
        from gguf import GGMLQuantizationType

        self.name = info.name
        self.shape = info.shape
        self.tensor_type = GGMLQuantizationType[info.type_name]
        rows = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else 1
        self.data = data.reshape(rows, -1)


class GGUFWeights:
    """Matrices of a GGUF file by their GGUF names (``blk.0.attn_q.weight``...).

    Args:
        path: the .gguf file.

    Raises:
        ValueError: the file cannot be read as GGUF.
    """

    def __init__(self, path: str | Path) -> None:
        self.stamp = FileStamp.of(path)  # before the table: a change after it is noticed later
        self.architecture, table = read_tensor_table(path)
        # "c": a copy-on-write map, so torch gets writable arrays; nothing writes to them,
        # and the pages stay shared with the page cache
        self._maps = FileMaps(path, mode="c")
        self.tensors: dict[str, Any] = {t.name: _MappedTensor(t, self._maps.bytes_of(t)) for t in table}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def matrix(self, name: str, rope_heads: int | None = None) -> kernels.PackedMatrix:
        """The matrix `name` in its stored format; `rope_heads`: for q/k matrices, the head
        count whose llama.cpp permutation to undo (where the architecture's row says
        `permuted_qk`: llama files).

        Raises:
            KeyError: no such tensor.
            ValueError: a format the kernels do not read.
        """
        tensor = self.tensors[name]
        order = None
        arch = BY_GGUF_ARCH.get(self.architecture)
        if rope_heads and arch is not None and arch.permuted_qk:
            order = unpermute_rows(int(tensor.shape[1]), rope_heads)
        return kernels.from_gguf(tensor, order)

    def stacked(self, name: str) -> tuple[kernels.PackedMatrix, int]:
        """A 3-D tensor (a mixture's experts: ggml shape [cols, rows, n]) as one matrix of
        n * rows rows in its stored format, expert e's rows from e * rows, on the file's map
        (no copy, not in tiles); and n.

        Raises:
            KeyError: no such tensor.
            ValueError: not 3-D, or a format the kernels do not read.
        """
        tensor = self.tensors[name]
        shape = [int(n) for n in tensor.shape]
        if len(shape) != 3:
            raise ValueError(f"{name} is not a 3-D tensor of experts (shape {shape})")
        kind = tensor.tensor_type.name
        if kind not in kernels.GGUF_FORMATS:
            raise ValueError(f"no kernel for {kind} tensors ({name})")
        cols, rows, n = shape
        data = torch.from_numpy(tensor.data).view(torch.uint8).reshape(rows * n, -1)
        return kernels.from_raw(data, kernels.GGUF_FORMATS[kind], rows * n, cols), n


def check_finite(path: str | Path) -> None:
    """Refuse NaN or infinity in a GGUF file's small float tensors (norms, biases), and in
    the block scales of its embedding and output matrices (one float16 or two per block of
    32-256 weights, read through a strided view of the map: no copy of the blocks). Maps only
    what it reads.

    Raises:
        NonFiniteWeights: naming the first tensor that holds one.
        ValueError: the file cannot be read as GGUF.
    """
    _, table = read_tensor_table(path)
    maps = FileMaps(path)
    for t in table:
        flat = maps.bytes_of(t)
        if t.type_name in FLOATS and t.nbytes <= _SMALL_BYTES:
            bad = first_nonfinite(flat.view(FLOATS[t.type_name]), t.type_name)
            if bad is not None:
                raise NonFiniteWeights(
                    f"tensor {t.name!r} ({t.type_name}) holds NaN or infinity (value {bad:,})"
                )
        elif t.name in _CHECKED_SCALES and t.type_name in BLOCK_SCALES:
            block_bytes, at = BLOCK_SCALES[t.type_name]
            for pos in at:
                scales = np.lib.stride_tricks.as_strided(
                    flat[pos : pos + 2].view("<u2"), shape=(t.nbytes // block_bytes,), strides=(block_bytes,)
                )
                bad = first_nonfinite(scales, "F16")
                if bad is not None:
                    raise NonFiniteWeights(
                        f"tensor {t.name!r} ({t.type_name}) has a NaN or infinite block scale (block {bad:,})"
                    )


def first_nonfinite(values: np.ndarray, kind: str) -> int | None:
    """The index of the first NaN or infinity in `values` (float32, or the raw bits of F16 or
    BF16 values), or None."""
    if kind == "F32":
        ok = np.isfinite(values)
    else:
        ok = (values & _EXPONENT[kind]) != _EXPONENT[kind]
    return None if ok.all() else int(np.argmin(ok))
