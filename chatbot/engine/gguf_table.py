"""The tensor table of a GGUF file, read without torch: what is checked before a model loads
(`chatbot.models.source.check_gguf`) and what the weights are mapped from
(`chatbot.engine.gguf_weights`)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF metadata value types: byte sizes of the fixed-size ones (8: string, 9: array)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)  # shared by the reads of one file (`read_tensor_table`)
class TensorInfo:
    """One entry of a GGUF tensor table (shape in ggml order: columns first)."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int  # from the start of the file
    nbytes: int


def _skip_value(buf: mmap.mmap, pos: int, kind: int) -> int:
    """The position after the metadata value of type `kind` at `pos`."""
    if kind == _STRING:
        return pos + 8 + _U64.unpack_from(buf, pos)[0]
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _SCALAR_BYTES:
            return pos + _SCALAR_BYTES[item] * count
        if item == _STRING:  # a vocabulary: 50-150k strings, the bulk of the header
            unpack = _U64.unpack_from
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            return pos
        for _ in range(count):
            pos = _skip_value(buf, pos, item)
        return pos
    return pos + _SCALAR_BYTES[kind]


# The last table read, with the header bytes it was read from: a load reads the table three
# times (checking the file, keying the tokenizer cache, mapping the weights), and the header
# of a 150k vocabulary takes ~35 ms to walk, against ~1 ms to compare.
_last_table: tuple[str, bytes, tuple[str, list[TensorInfo]]] | None = None


def read_tensor_table(path: str | Path) -> tuple[str, list[TensorInfo]]:
    """The architecture and tensor table of a GGUF file (v2/v3), reading nothing else.

    `gguf.GGUFReader` parses every metadata value into numpy views, which takes seconds on
    a 150k-token vocabulary; decoding needs only the tensor table, so it is read here (the
    tests check it against GGUFReader).

    Raises:
        ValueError: not a GGUF v2/v3 file, or a tensor type gguf does not know.
    """
    global _last_table
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path} is not a GGUF v2/v3 file") from None
    with buf:
        last = _last_table
        if last is not None and last[0] == str(path) and buf[: len(last[1])] == last[1]:
            arch, table = last[2]
            return arch, list(table)
        try:
            header_end, arch, table = _parse_header(buf, path)
        except struct.error:
            raise ValueError(f"{path} is truncated inside its GGUF header") from None
        _last_table = (str(path), buf[:header_end], (arch, table))
    return arch, list(table)


def _parse_header(buf: mmap.mmap, path: str | Path) -> tuple[int, str, list[TensorInfo]]:
    """(where the header ends, architecture, tensor table) of a mapped GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    magic, version = struct.unpack_from("<4sI", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a GGUF v2/v3 file")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24
    arch, alignment = "", 32
    for _ in range(n_kv):
        (n,) = _U64.unpack_from(buf, pos)
        key = buf[pos + 8 : pos + 8 + n]
        (kind,) = struct.unpack_from("<I", buf, pos + 8 + n)
        pos += 12 + n
        if key == b"general.architecture" and kind == _STRING:
            (n,) = _U64.unpack_from(buf, pos)
            arch = buf[pos + 8 : pos + 8 + n].decode()
        elif key == b"general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", buf, pos)
        pos = _skip_value(buf, pos, kind)
    raw = []
    for _ in range(n_tensors):
        (n,) = _U64.unpack_from(buf, pos)
        name = buf[pos + 8 : pos + 8 + n].decode()
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 16 + 8 * n_dims
        raw.append((name, shape, kind, offset))
    if pos > len(buf):
        raise struct.error("past the end")
    start = -(-pos // alignment) * alignment
    table = []
    for name, shape, kind, offset in raw:
        qtype = GGMLQuantizationType(kind)
        per_block, block_bytes = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(shape))
        table.append(
            TensorInfo(name, tuple(shape), qtype.name, start + offset, count // per_block * block_bytes)
        )
    return pos, arch, table
