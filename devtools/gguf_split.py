"""Rewrite a GGUF file through gguf-py's writer: split into parts as llama.cpp's gguf-split
does (the metadata in the first part; `split.no`, `split.count` and `split.tensors.count` in
each), the split files of the tests' stand-in hub; or dequantized to float32, the input
llama.cpp's quantizer takes to make real-weights K-quant files of a model shipped quantized.

    python -m devtools.gguf_split IN.gguf OUT.gguf --parts 2       # OUT-00001-of-00002.gguf, ...
    python -m devtools.gguf_split IN.gguf OUT-F32.gguf --dequantize
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np


def _copy_metadata(reader: Any, writer: Any) -> None:
    from gguf import GGUFValueType

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # the header's own fields, and what the writer adds itself
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub)


def dequantize_gguf(src: Path, out: Path) -> Path:
    """Write `src` with every tensor as float32 (the same metadata)."""
    from gguf import GGUFReader, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    writer = GGUFWriter(out, reader.fields["general.architecture"].contents())
    _copy_metadata(reader, writer)
    writer.add_file_type(0)  # ALL_F32
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape([int(n) for n in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def split_gguf(src: Path, out: Path, parts: int) -> list[Path]:
    """Write `src` as `parts` files named after `out` (`OUT-0000i-of-0000N.gguf`): the same
    metadata and tensors, byte for byte, spread evenly over the parts.

    Returns:
        The parts' paths, in order.
    """
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    arch = reader.fields["general.architecture"].contents()
    per_part = -(-len(reader.tensors) // parts)
    writer = GGUFWriter(out, arch, split_max_tensors=per_part)
    _copy_metadata(reader, writer)
    if "general.file_type" in reader.fields:
        writer.add_file_type(int(reader.fields["general.file_type"].contents()))
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    names = writer.format_shard_names(out)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--dequantize", action="store_true", help="write float32 instead of splitting")
    args = parser.parse_args(argv)
    if args.dequantize:
        print(dequantize_gguf(args.src, args.out))
        return 0
    for path in split_gguf(args.src, args.out, args.parts):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
