"""The weight matrices of a GGUF file in their stored formats, for the native kernels.

A GGUF file holds each matrix in ggml's layout (Q4_K, Q6_K, Q8_0...), which the kernels read
as they are: the tensors are taken from the `gguf` package's memory-mapped reader without a
copy, so a K-quant model decodes at its native bytes per weight. One difference from the
layout transformers uses: llama.cpp's converter permutes the rows of the q and k matrices of
``llama`` files (to an interleaved rotary layout); transformers undoes it when it loads a GGUF,
and so does `matrix` here, by reordering whole rows (the blocks run along a row, so this
moves bytes and changes no weight).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatbot.engine import kernels
from chatbot.engine.gguf_table import TensorInfo, read_tensor_table  # re-exported


def unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation for `n_head` heads (as
    transformers' `_reverse_permute_weights`, applied to row indices)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


class _MappedTensor:
    """A tensor of the table with its bytes on the file's memory map (the few attributes
    of a GGUFReader tensor that `kernels.from_gguf` reads)."""

    def __init__(self, info: TensorInfo, mm: np.memmap) -> None:
        from gguf import GGMLQuantizationType

        self.name = info.name
        self.shape = info.shape
        self.tensor_type = GGMLQuantizationType[info.type_name]
        rows = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else 1
        self.data = mm[info.offset : info.offset + info.nbytes].reshape(rows, -1)


class GGUFWeights:
    """Matrices of a GGUF file by their GGUF names (``blk.0.attn_q.weight``...).

    Args:
        path: the .gguf file.

    Raises:
        ValueError: the file cannot be read as GGUF.
    """

    def __init__(self, path: str | Path) -> None:
        self.architecture, table = read_tensor_table(path)
        # "c": a copy-on-write map, so torch gets writable arrays; nothing writes to them,
        # and the pages stay shared with the page cache
        self._map = np.memmap(path, dtype=np.uint8, mode="c")
        self.tensors: dict[str, Any] = {t.name: _MappedTensor(t, self._map) for t in table}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def matrix(self, name: str, rope_heads: int | None = None) -> kernels.PackedMatrix:
        """The matrix `name` in its stored format; `rope_heads`: for q/k matrices, the head
        count whose llama.cpp permutation to undo (llama files only).

        Raises:
            KeyError: no such tensor.
            ValueError: a format the kernels do not read.
        """
        tensor = self.tensors[name]
        order = None
        if rope_heads and self.architecture == "llama":
            order = unpermute_rows(int(tensor.shape[1]), rope_heads)
        return kernels.from_gguf(tensor, order)
