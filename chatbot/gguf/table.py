"""The tensor table of a GGUF file, read without torch: what is checked before a model loads
(`chatbot.models.source.check_gguf`) and what the weights are mapped from
(`chatbot.engine.backends.native.gguf_weights`).

The table is checked as strictly as llama.cpp's `gguf_init_from_file` checks it: each
tensor's data starts where the one before it ends, padded to the file's alignment (no gap,
no overlap, no misaligned offset), its type is known and its rows hold whole blocks, and it
lies inside the file. A file that fails is refused with one line naming the tensor, instead
of being mapped and answering garbage.

`FileStamp` remembers which file a model was mapped from, so that a chat can refuse a turn
when the file changed under its memory map (a truncated file kills the process with SIGBUS
at the first page read past its new end; one rewritten in place answers garbage).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from chatbot.errors import ChatbotError

# GGUF metadata value types: byte sizes of the fixed-size ones (8: string, 9: array)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
"""A part of a split GGUF file's name: (stem, part number, number of parts)."""


@dataclass(frozen=True)  # shared by the reads of one file (`read_tensor_table`)
class TensorInfo:
    """One entry of a GGUF tensor table (shape in ggml order: columns first)."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int  # from the start of the file
    nbytes: int
    file: str | None = None  # the part of a split that holds it (None: the file read)


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
        if item != _ARRAY:
            raise ValueError(f"a metadata array has items of an unknown type ({item})")
        for _ in range(count):
            pos = _skip_value(buf, pos, item)
        return pos
    if kind not in _SCALAR_BYTES:
        raise ValueError(f"a metadata value has an unknown type ({kind})")
    return pos + _SCALAR_BYTES[kind]


# The last table read, with the file size and header bytes it was read from: a load reads the
# table three times (checking the file, keying the tokenizer cache, mapping the weights), and
# comparing the header bytes is much cheaper than walking a large vocabulary again. (The size
# is part of the key: a table is checked against the end of its file.)
_last_table: tuple[str, int, bytes, tuple[str, list[TensorInfo], int]] | None = None


class SplitPartError(ValueError):
    """A part of a split GGUF file given instead of its first, or a part that is missing."""


def read_tensor_table(path: str | Path) -> tuple[str, list[TensorInfo]]:
    """The architecture and tensor table of a GGUF file (v2/v3), reading nothing else.

    `gguf.GGUFReader` parses every metadata value into numpy views, slow on a large
    vocabulary; decoding needs only the tensor table, so it is read here (the tests check it
    against GGUFReader). The first part of a split (`-00001-of-0000N.gguf`, as llama.cpp's
    gguf-split writes it: the metadata in the first part, tensors in all) gives the table of
    all its parts, each entry naming the part that holds it (`TensorInfo.file`).

    Raises:
        ValueError: not a GGUF v2/v3 file, a damaged tensor table (`_check_tensor`): one
            line that names the tensor.
        SplitPartError: a split's part that is missing, or not the first.
    """
    arch, table, parts = _read_one(path)
    if parts <= 1:
        return arch, table
    m = SPLIT.match(Path(path).name)
    if not m or int(m.group(2)) != 1 or int(m.group(3)) != parts:
        first = f"{m.group(1) if m else 'the one named '}-00001-of-{parts:05d}.gguf"
        raise SplitPartError(f"it is a part of a split of {parts} files: give the first part, {first}")
    names = {t.name for t in table}
    for n, part in enumerate(split_parts(Path(path))[1:], start=2):
        if not part.is_file():
            raise SplitPartError(f"part {n} of its {parts} parts is missing ({part.name})")
        _, more, _ = _read_one(part)
        for t in more:
            if t.name in names:
                raise ValueError(f"tensor {t.name!r} appears in two parts of the split {Path(path).name}")
            names.add(t.name)
            table.append(TensorInfo(t.name, t.shape, t.type_name, t.offset, t.nbytes, str(part)))
    return arch, table


def split_parts(path: Path) -> list[Path]:
    """The files of the split whose part `path` is, in order, by its name
    (`-0000i-of-0000N.gguf`); `[path]` for a name that is not a split's."""
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m.group(3))
    return [path.with_name(f"{m.group(1)}-{n:05d}-of-{count:05d}.gguf") for n in range(1, count + 1)]


def _read_one(path: str | Path) -> tuple[str, list[TensorInfo], int]:
    """(architecture, tensor table, number of split parts: 1 for a whole file) of one file."""
    global _last_table
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path} is not a GGUF v2/v3 file") from None
    with buf:
        last = _last_table
        if last is not None and last[:2] == (str(path), len(buf)) and buf[: len(last[2])] == last[2]:
            arch, table, parts = last[3]
            return arch, list(table), parts
        try:
            header_end, arch, table, parts = _parse_header(buf, path)
        except struct.error:
            raise ValueError(f"{path} is truncated inside its GGUF header") from None
        except UnicodeDecodeError:  # not the codec's words: they name no tensor
            raise ValueError(f"{path} has a name in its GGUF header that is not UTF-8 text") from None
        _last_table = (str(path), len(buf), buf[:header_end], (arch, table, parts))
    return arch, list(table), parts


def _parse_header(buf: mmap.mmap, path: str | Path) -> tuple[int, str, list[TensorInfo], int]:
    """(where the header ends, architecture, tensor table, split parts) of a mapped GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    magic, version = struct.unpack_from("<4sI", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a GGUF v2/v3 file")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24
    arch, alignment, parts = "", 32, 1
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
        elif key == b"split.count" and kind == 2:
            (parts,) = struct.unpack_from("<H", buf, pos)
        pos = _skip_value(buf, pos, kind)
    raw = []
    for _ in range(n_tensors):
        (n,) = _U64.unpack_from(buf, pos)
        name = buf[pos + 8 : pos + 8 + n].decode()
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (a GGUF tensor has 1 to 4)")
        shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 16 + 8 * n_dims
        raw.append((name, shape, kind, offset))
    if pos > len(buf):
        raise struct.error("past the end")
    if alignment == 0 or alignment & (alignment - 1):
        raise ValueError(f"its general.alignment ({alignment}) is not a power of two")
    start = -(-pos // alignment) * alignment
    table: list[TensorInfo] = []
    names: set[str] = set()
    for name, shape, kind, offset in raw:
        try:
            qtype = GGMLQuantizationType(kind)
            per_block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has an unknown type ({kind})") from None
        info = TensorInfo(name, tuple(shape), qtype.name, start + offset, 0)
        _check_tensor(info, per_block, names, table[-1] if table else None, start, alignment, len(buf))
        nbytes = math.prod(shape) // per_block * block_bytes
        if info.offset + nbytes > len(buf):
            raise ValueError(
                f"tensor {name!r} ({_describe(info)}, {nbytes:,} bytes from byte {info.offset:,}) "
                f"runs past the end of the file ({len(buf):,} bytes)"
            )
        names.add(name)
        table.append(TensorInfo(name, info.shape, info.type_name, info.offset, nbytes))
    return pos, arch, table, parts


def _describe(t: TensorInfo) -> str:
    return f"{t.type_name} {'x'.join(str(n) for n in t.shape)}"


def _check_tensor(
    t: TensorInfo,
    per_block: int,
    names: set[str],
    before: TensorInfo | None,
    start: int,
    alignment: int,
    size: int,
) -> None:
    """Refuse an entry of the tensor table as llama.cpp's `gguf_init_from_file` does (its
    `nbytes` is not known yet; its 1-4 dimensions were checked as the table was read): its
    name is new, no dimension is empty, its rows hold whole blocks; its data starts inside
    the file, on the file's alignment, right where the data of `before` ends, padded (the
    first: where the data section starts).

    Raises:
        ValueError: one line naming the tensor.
    """
    name = t.name
    if name in names:
        raise ValueError(f"tensor {name!r} appears twice in the tensor table")
    if 0 in t.shape or math.prod(t.shape) >= 1 << 63:
        raise ValueError(f"tensor {name!r} has the shape {'x'.join(map(str, t.shape))}, with no data")
    if t.shape[0] % per_block:
        raise ValueError(
            f"tensor {name!r} ({_describe(t)}) has rows of {t.shape[0]} values, not whole "
            f"{t.type_name} blocks of {per_block}"
        )
    if t.offset >= size:
        raise ValueError(
            f"tensor {name!r} starts at byte {t.offset:,}, past the end of the file ({size:,} bytes)"
        )
    if (t.offset - start) % alignment:
        raise ValueError(
            f"tensor {name!r} starts at byte {t.offset:,}, not on the file's {alignment}-byte alignment"
        )
    expected = start if before is None else before.offset + -(-before.nbytes // alignment) * alignment
    if t.offset == expected:
        return
    if before is None:
        raise ValueError(
            f"tensor {name!r}, the first, starts at byte {t.offset:,}, not where the data begins ({start:,})"
        )
    what = (
        f"a gap of {t.offset - expected:,}"
        if t.offset > expected
        else f"overlapping it by {expected - t.offset:,}"
    )
    raise ValueError(
        f"tensor {name!r} starts at byte {t.offset:,}, but {before.name!r} before it ({_describe(before)}, "
        f"{before.nbytes:,} bytes) ends at {expected:,}: {what} bytes"
    )


class ModelFileChanged(ChatbotError):
    """The file a model's weights are mapped from changed on disk since it was loaded: the
    process's fault to report (a server answers 500), not the request's."""


@dataclass(frozen=True)
class FileStamp:
    """What identifies a file's contents cheaply (size, modification and change times, inode):
    taken when a model maps the file, compared before each turn (`check`)."""

    path: str
    key: tuple[int, ...]

    @classmethod
    def of(cls, path: str | Path) -> FileStamp:
        """The stamp of `path` now.

        Raises:
            OSError: the file cannot be read.
        """
        return cls(str(path), cls._key(path))

    @staticmethod
    def _key(path: str | Path) -> tuple[int, ...]:
        st = os.stat(path)
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def check(self) -> None:
        """Raise unless the file is as it was when stamped (one `stat`).

        Raises:
            ModelFileChanged: the file was changed, truncated, replaced or removed.
        """
        try:
            same = self._key(self.path) == self.key
        except OSError:
            same = False
        if not same:
            raise ModelFileChanged(
                f"the model file {self.path} changed on disk since it was loaded; restart to load it again"
            )
