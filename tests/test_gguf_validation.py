"""Damaged GGUF files are refused at load with one line naming the tensor, as llama.cpp
refuses them: a tensor table whose offsets leave a gap, overlap, are misaligned or point past
the end, a tensor whose type and shape do not fill its span, NaN in a norm's weights and an
infinite block scale of the embedding. Each case runs `chatbot run --model FILE` in its own
process (a damaged file must not take the test run down with it).

The damage is made by patching bytes of a good file: the tensor table's fields are found
with the `gguf` package's reader (an independent parser of the table)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_model, make_tokenizer, write_tiny_gguf

from chatbot.gguf.table import read_tensor_table
from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf

NORM = "blk.0.attn_norm.weight"


def _fields(path: Path) -> dict[str, dict[str, int]]:
    """Where each tensor's fields lie in the file: `dims`, `type` and `offset` (of its
    table entry), `data` (its bytes), and `n_dims`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        pos = int(t.field.offset) + 8 + len(t.name.encode())
        n_dims = int(t.field.parts[2][0])
        out[t.name] = {
            "n_dims": n_dims,
            "dims": pos + 4,
            "type": pos + 4 + 8 * n_dims,
            "offset": pos + 8 + 8 * n_dims,
            "data": int(t.data_offset),
        }
    del reader
    return out


def _patch(path: Path, at: int, fmt: str, value: float) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))


def _shift_offset(path: Path, name: str, delta: int) -> None:
    at = _fields(path)[name]["offset"]
    (offset,) = struct.unpack_from("<Q", path.read_bytes(), at)
    _patch(path, at, "<Q", offset + delta)


def _run(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "XDG_DATA_HOME": str(tmp_path / "data"),
    }
    return subprocess.run(
        [sys.executable, "-m", "chatbot.cli", "run", "--model", str(path)],
        input="hello\n",
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _assert_refused(result: subprocess.CompletedProcess[str], path: Path, *words: str) -> str:
    """Exit code 2 and one line `chatbot: error: ...` naming the file and holding `words`;
    no dequantized copy written (the damage is the file's, not the block-format model's)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr + result.stdout
    assert len(lines) == 1 and lines[0].startswith("chatbot: error: "), result.stderr
    assert str(path) in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    assert not (path.parent / "cache" / "chatbot" / "gguf").exists()
    return lines[0]


@pytest.fixture
def tiny(tmp_path) -> Path:
    tok = make_tokenizer()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, make_model(len(tok)), tok)
    return path


def _damage_gap(path: Path) -> None:
    _shift_offset(path, NORM, 32)


def _damage_overlap(path: Path) -> None:
    _shift_offset(path, NORM, -32)


def _damage_misaligned(path: Path) -> None:
    _shift_offset(path, NORM, 4)


def _damage_past_the_end(path: Path) -> None:
    _, table = read_tensor_table(path)
    _shift_offset(path, table[-1].name, 4 * path.stat().st_size)


def _damage_shape(path: Path) -> None:
    # blk.0.attn_q.weight is 64x64 F32: as 64x32 it would fill half its span
    at = _fields(path)["blk.0.attn_q.weight"]["dims"] + 8
    _patch(path, at, "<Q", 32)


def _damage_type(path: Path) -> None:
    # F32 -> F16: half the bytes of its span
    _patch(path, _fields(path)["blk.0.attn_q.weight"]["type"], "<I", 1)


def _damage_nan_norm(path: Path) -> None:
    _patch(path, _fields(path)[NORM]["data"] + 4 * 5, "<f", float("nan"))


DAMAGE = {
    "gap": (_damage_gap, NORM, ("gap",)),
    "overlap": (_damage_overlap, NORM, ("overlapping",)),
    "misaligned": (_damage_misaligned, NORM, ("alignment",)),
    "past the end": (_damage_past_the_end, None, ("past the end",)),
    "shape": (_damage_shape, "blk.0.attn_q.weight", ("64x32",)),
    "type": (_damage_type, "blk.0.attn_q.weight", ("F16",)),
    "nan in a norm": (_damage_nan_norm, NORM, ("NaN",)),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_tensor_table_or_norm_is_one_line_naming_the_tensor(tiny, tmp_path, case):
    damage, name, words = DAMAGE[case]
    if name is None:
        name = read_tensor_table(tiny)[1][-1].name
    damage(tiny)
    _assert_refused(_run(tiny, tmp_path), tiny, repr(name), *words)


def test_infinite_block_scale_of_the_embedding(tmp_path):
    """A Q6_K embedding (its scale d is the last 2 bytes of each 210-byte block) with one
    block's scale set to infinity."""
    path = tmp_path / "qwen2.gguf"
    write_synthetic_gguf(path, "qwen2", SHAPES["qwen2"]["tiny"], "Q4_K_M", seed=1)
    _, table = read_tensor_table(path)
    embd = next(t for t in table if t.name == "token_embd.weight")
    assert embd.type_name == "Q6_K"
    _patch(path, embd.offset + 7 * 210 + 208, "<H", 0x7C00)  # block 7's d: +inf in float16
    line = _assert_refused(_run(path, tmp_path), path, "'token_embd.weight'", "block scale (block 7)")
    assert "Q6_K" in line
