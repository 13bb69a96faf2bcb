"""Rewrite a GGUF file with its metadata or tensors changed, for the tests of files whose
metadata lies: read with the `gguf` package's reader, written with its writer (both
independent of the project's own header parsing)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    arch: str | None = None,
    rename: Callable[[str], str] = lambda key: key,
    values: dict[str, Any] | None = None,
    keep_tensor: Callable[[str], bool] = lambda name: True,
    tensor_data: dict[str, Callable[[np.ndarray], np.ndarray]] | None = None,
) -> None:
    """Copy `src` to `dst` with: another `general.architecture`; keys renamed by `rename`;
    `values` (key -> new value, of the same GGUF type as before) set; only the tensors
    `keep_tensor` accepts; the bytes of some tensors changed by `tensor_data` (name -> a
    function of their array as the reader gives it)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    own = reader.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch or own)
    values = values or {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        value = values.get(name, field.contents())
        sub = field.types[1] if kind == GGUFValueType.ARRAY and len(field.types) > 1 else None
        w.add_key_value(rename(name), value, kind, sub_type=sub)
    edits = tensor_data or {}
    for t in reader.tensors:
        if not keep_tensor(t.name):
            continue
        data = np.array(t.data)
        if t.name in edits:
            data = edits[t.name](data)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
