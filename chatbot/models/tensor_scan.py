"""A whole scan of a model's weights for NaN and infinity, as llama.cpp's `--check-tensors`
does: `chatbot doctor --check-model M`.

The load checks only what costs little (`gguf_weights.check_finite`: small float tensors and
the block scales of the embedding and output matrices); a NaN scale in a middle layer shows
only once it has spoilt the logits (`chatbot.engine.finite`). This reads every tensor: for a
GGUF file, each float value and each block's float16 scales (`d`, and `dmin`/`m` where the
format has one; the quants themselves are small integers, always finite), through strided
views of the memory map, so nothing is copied; for a transformers folder, every floating
tensor of its safetensors files. It reads the whole file once (~1 s per GB from the page
cache), so it is asked for, not run at each load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chatbot.engine.backends.native.gguf_weights import BLOCK_SCALES, FLOATS, FileMaps, first_nonfinite
from chatbot.gguf.table import read_tensor_table

Progress = Callable[[int, int], None]
"""Told (bytes read, bytes in all) as the scan goes."""
_CHUNK_VALUES = 1 << 22  # values of a float tensor tested at once (bounded memory for a big one)


@dataclass(frozen=True)
class ScanResult:
    """What a scan found: `bad` names the first damaged tensor (None: all finite)."""

    tensors: int
    checked_bytes: int
    unchecked: tuple[str, ...] = ()  # tensors of a type whose scales this does not know
    bad: str | None = None


def scan_gguf(path: Path, progress: Progress | None = None) -> ScanResult:
    """Test every float value and block scale of a GGUF file; stop at the first non-finite one.

    Raises:
        ValueError: the file cannot be read as GGUF.
    """
    _, table = read_tensor_table(path)
    maps = FileMaps(path)
    total = sum(t.nbytes for t in table)
    done = 0
    unchecked = []
    for t in table:
        flat = maps.bytes_of(t)
        bad = None
        if t.type_name in FLOATS:
            values = flat.view(FLOATS[t.type_name])
            for start in range(0, values.size, _CHUNK_VALUES):
                at = first_nonfinite(values[start : start + _CHUNK_VALUES], t.type_name)
                if at is not None:
                    bad = f"tensor {t.name!r} ({t.type_name}) holds NaN or infinity (value {start + at:,})"
                    break
        elif t.type_name in BLOCK_SCALES:
            block_bytes, offsets = BLOCK_SCALES[t.type_name]
            n_blocks = t.nbytes // block_bytes
            for pos in offsets:
                scales = np.lib.stride_tricks.as_strided(
                    flat[pos : pos + 2].view("<u2"), shape=(n_blocks,), strides=(block_bytes,)
                )
                at = first_nonfinite(scales, "F16")
                if at is not None:
                    which = "d" if pos == offsets[0] else "dmin"
                    bad = (
                        f"tensor {t.name!r} ({t.type_name}) has a NaN or infinite block scale "
                        f"({which} of block {at:,} of {n_blocks:,})"
                    )
                    break
        else:
            unchecked.append(t.name)
        done += t.nbytes
        if progress is not None:
            progress(done, total)
        if bad is not None:
            return ScanResult(len(table), done, tuple(unchecked), bad)
    return ScanResult(len(table), done, tuple(unchecked))


def scan_folder(folder: Path, progress: Progress | None = None) -> ScanResult:
    """Test every floating tensor of a transformers folder's safetensors files.

    Raises:
        ValueError: no safetensors file in the folder, or one that cannot be read.
    """
    import torch
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no .safetensors file (a .bin checkpoint is not scanned)")
    total = sum(f.stat().st_size for f in files)
    done = tensors = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no iteration of its own
                t = f.get_tensor(name)
                tensors += 1
                done = min(total, done + t.numel() * t.element_size())
                if progress is not None:
                    progress(done, total)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    at = int((~torch.isfinite(t.reshape(-1))).nonzero()[0])
                    bad = f"tensor {name!r} of {file.name} holds NaN or infinity (value {at:,})"
                    return ScanResult(tensors, done, (), bad)
    if progress is not None:
        progress(total, total)
    return ScanResult(tensors, total)


def scan_model(path: Path, progress: Progress | None = None) -> ScanResult:
    """`scan_gguf` for a .gguf file, `scan_folder` for a folder.

    Raises:
        ValueError: neither, or unreadable.
    """
    if path.is_dir():
        return scan_folder(path, progress)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return scan_gguf(path, progress)
    raise ValueError(f"{path} is neither a .gguf file nor a model folder")
