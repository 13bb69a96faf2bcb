"""Split a GGUF file into parts as llama.cpp's gguf-split does (the metadata in the first
part; `split.no`, `split.count` and `split.tensors.count` in each), through gguf-py's writer:
the split files of the tests' stand-in hub.

    python -m devtools.gguf_split IN.gguf OUT.gguf --parts 2   # OUT-00001-of-00002.gguf, ...
"""

from __future__ import annotations

import argparse
from pathlib import Path


def split_gguf(src: Path, out: Path, parts: int) -> list[Path]:
    """Write `src` as `parts` files named after `out` (`OUT-0000i-of-0000N.gguf`): the same
    metadata and tensors, byte for byte, spread evenly over the parts.

    Returns:
        The parts' paths, in order.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    arch = reader.fields["general.architecture"].contents()
    per_part = -(-len(reader.tensors) // parts)
    writer = GGUFWriter(out, arch, split_max_tensors=per_part)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's own fields, and what the writer adds itself
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub)
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
    args = parser.parse_args(argv)
    for path in split_gguf(args.src, args.out, args.parts):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
