"""Native CPU kernels for decoding: build `kernels.c` once, load it with ctypes, pack weights.

`load_library` gives the kernels library, built on first use with the system C compiler and
cached on disk (`chatbot.engine.backends.native.build`); where there is no compiler, or the build
fails, it raises `KernelsUnavailable` and callers fall back to torch. The C structs and
function types are in `chatbot.engine.backends.native.kernel_abi`; both modules' public names are
re-exported here.

Weight formats (`chatbot.engine.backends.native.formats`, kernels.c): float32, bfloat16, float16, and ggml's
block formats as they are stored in GGUF files: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32
weights) and the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256). `from_gguf`
takes a tensor of a GGUF file as it is (memory-mapped, no copy); `pack_q8_0` / `pack_q4_1`
quantize float weights.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from chatbot.engine.backends.native.build import (
    FLAGS,
    NO_OPENMP_FLAGS,
    SOURCE,
    arch_flags,
    build,
    build_flags,
    cache_lock,
    checksum_path,
    compile_command,
    extra_flags,
    find_compiler,
    kernels_dir,
    library_path,
    load_cached,
    open_library,
    uses_openmp,
)
from chatbot.engine.backends.native.formats import BY_GGUF_NAME, FORMATS, QK
from chatbot.engine.backends.native.kernel_abi import (
    ABI_MIRRORS,
    Group,
    KernelsUnavailable,
    Mat,
    ModelStruct,
    check_abi,
)

__all__ = [
    "ABI_MIRRORS", "FLAGS", "NO_OPENMP_FLAGS", "QK", "SOURCE", "Group", "KernelsUnavailable", "Mat",
    "ModelStruct", "arch_flags", "build", "build_flags", "check_abi", "checksum_path", "compile_command",
    "extra_flags", "find_compiler", "kernels_dir", "library_path", "open_library", "uses_openmp",
]  # fmt: skip
"""The names re-exported from `formats`, `kernel_abi` and `kernel_build` (the module's own
public names are public too)."""

FMT_F32, FMT_BF16, FMT_Q8_0, FMT_Q4_1, FMT_F16, FMT_Q4_0, FMT_Q5_0 = (
    BY_GGUF_NAME[n].code for n in ("F32", "BF16", "Q8_0", "Q4_1", "F16", "Q4_0", "Q5_0")
)
FMT_Q5_1, FMT_Q2_K, FMT_Q3_K, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_MXFP4 = (
    BY_GGUF_NAME[n].code for n in ("Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
)
ACT_F32, ACT_Q8, ACT_I16 = 0, 1, 2  # the form of activations in Q8_0/Q4_1 products (kernels.c)
# the MLP's activation (kernels.c); SWIGLU_OAI: gpt-oss's clamped SwiGLU, (up + 1) form
ACT_FN_SILU, ACT_FN_GELU_TANH, ACT_FN_SWIGLU_OAI = 0, 1, 2
# Views of `chatbot.engine.backends.native.formats.FORMATS` by enum value, for the callers that hold one.
FORMAT_NAMES = {f.code: f.name for f in FORMATS}
INT16_PRODUCTS = {f.code for f in FORMATS if f.int16_products}
"""The formats with integer products for int16 activations (ACT_I16) on AVX2 and on ARM
(NEON); the others, and every format on a CPU with neither, multiply float32 activations."""
BLOCK_SHAPES = {f.code: (f.block_weights, f.block_bytes) for f in FORMATS}
"""Weights per block and bytes per block (ggml's block structs), by enum value."""
GGUF_FORMATS = {f.gguf_name: f.code for f in FORMATS}
"""GGUF tensor type names (gguf.GGMLQuantizationType) -> kernel format."""


# --- loading -------------------------------------------------------------------------------

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def loaded() -> ctypes.CDLL | None:
    """The kernels library where `load_library` has loaded it already; else None."""
    return _library


def failure() -> str | None:
    """Why the kernels could not be loaded, once `load_library` has failed; else None."""
    return _failure


def load_library() -> ctypes.CDLL:
    """The kernels library, built on first use and cached on disk; a cached file that does
    not match the checksum recorded when it was built is built again, once, not loaded.

    Raises:
        KernelsUnavailable: no C compiler, a failed build, or a rebuilt library that still
            does not load (the message names the file).
    """
    global _library, _failure
    with _lock:
        if _library is not None:
            return _library
        if _failure is not None:
            raise KernelsUnavailable(_failure)
        try:
            if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
                raise KernelsUnavailable(f"no native kernels for {platform.machine()}")
            cc = find_compiler()
            if cc is None:
                raise KernelsUnavailable(
                    "no C compiler found (set CC, or install gcc) for the native kernels"
                )
            path = library_path(cc)
            with cache_lock(path.parent):
                lib = load_cached(cc, path, library_path(cc, openmp=False))
        except KernelsUnavailable as exc:
            _failure = str(exc)
            raise
        except OSError as exc:  # running the compiler for its version, reading kernels.c
            _failure = f"cannot load the native kernels: {exc}"
            raise KernelsUnavailable(_failure) from None
        _library = lib
        return lib


# --- packing weights ---------------------------------------------------------------------------


@dataclass
class PackedMatrix:
    """A weight matrix in one of the kernel formats; `data` owns the bytes: the rows as ggml
    lays them out, or with `x8` in tiles of 8 rows (`tile_rows`)."""

    data: torch.Tensor
    fmt: int
    rows: int
    cols: int
    x8: bool = False

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def bytes_per_weight(self) -> float:
        return self.nbytes / (self.rows * self.cols)

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.fmt]

    def as_struct(self) -> Mat:
        return Mat(self.data.data_ptr(), self.fmt, self.rows, self.cols, int(self.x8))


def pack_f32(w: torch.Tensor) -> PackedMatrix:
    w = w.detach().to(torch.float32).contiguous()
    return PackedMatrix(w, FMT_F32, *w.shape)


def pack_bf16(w: torch.Tensor) -> PackedMatrix:
    w16 = w.detach().to(torch.bfloat16).contiguous()
    return PackedMatrix(w16, FMT_BF16, *w16.shape)


BLOCK_BYTES = {code: BLOCK_SHAPES[code][1] for code in (FMT_Q8_0, FMT_Q4_1)}
"""Bytes per block of the formats `pack_q8_0` and `pack_q4_1` quantize into."""


def _quantize(
    w: torch.Tensor, fmt: int, out: torch.Tensor | None = None
) -> tuple[PackedMatrix, float, float]:
    """Pack `w` in a block format (into `out`, uint8 [rows, bytes per row], when given); also
    return the largest rounding error and the largest |w|.

    Raises:
        ValueError: `w` has a column count that is not a multiple of the block size (QK).

    Runs on one thread: packing runs once per model load, and OpenMP threads on a busy
    machine stall one another at its barriers (`chatbot.engine.backends.native.threads`).
    """
    rows, cols = w.shape
    if cols % QK:
        raise ValueError(f"a block format needs columns in multiples of {QK}, got {cols}")
    w = w.detach().to(torch.float32).contiguous()
    if out is None:
        out = torch.empty(rows, cols // QK * BLOCK_BYTES[fmt], dtype=torch.uint8)
    assert out.is_contiguous() and out.shape == (rows, cols // QK * BLOCK_BYTES[fmt])
    stats = torch.zeros(2, dtype=torch.float32)
    load_library().chatbot_quantize(w.data_ptr(), rows, cols, fmt, out.data_ptr(), 1, stats.data_ptr())
    return PackedMatrix(out, fmt, rows, cols), float(stats[0]), float(stats[1])


def quantize_rows(parts: list[torch.Tensor], fmt: int) -> tuple[PackedMatrix, float]:
    """Row blocks (q, k, v) packed one after the other into one matrix; also the largest
    rounding error relative to each block's largest |w|."""
    cols = parts[0].shape[1]
    rows = sum(w.shape[0] for w in parts)
    out = torch.empty(rows, cols // QK * BLOCK_BYTES[fmt], dtype=torch.uint8)
    start, worst = 0, 0.0
    for w in parts:
        _, err, biggest = _quantize(w, fmt, out[start : start + w.shape[0]])
        worst = max(worst, err / (biggest or 1.0))
        start += w.shape[0]
    return PackedMatrix(out, fmt, rows, cols), worst


def pack_q8_0(w: torch.Tensor) -> PackedMatrix:
    """ggml Q8_0: per block of 32, d = absmax / 127 (fp16) and q = round(w / d)."""
    return _quantize(w, FMT_Q8_0)[0]


def pack_q4_1(w: torch.Tensor) -> PackedMatrix:
    """ggml Q4_1: per block of 32, m = min, d = (max - min) / 15 (both fp16), q = round((w - m) / d)."""
    return _quantize(w, FMT_Q4_1)[0]


def stack(parts: list[PackedMatrix]) -> PackedMatrix:
    """Row blocks of one format as one matrix (q, k and v as one QKV matrix)."""
    if len(parts) == 1:
        return parts[0]
    fmt, cols, x8 = parts[0].fmt, parts[0].cols, parts[0].x8
    assert all(p.fmt == fmt and p.cols == cols and p.x8 == x8 for p in parts)
    return PackedMatrix(torch.cat([p.data for p in parts], dim=0), fmt, sum(p.rows for p in parts), cols, x8)


PACKERS = {"f32": pack_f32, "bf16": pack_bf16, "q8_0": pack_q8_0, "q4_1": pack_q4_1}


def from_raw(data: torch.Tensor, fmt: int, rows: int, cols: int) -> PackedMatrix:
    """A matrix whose rows are stored in `fmt` exactly as ggml lays them out (`data`: its
    bytes, [rows, bytes per row], or float32 [rows, cols] for F32); no copy is made.

    Raises:
        ValueError: `cols` is not whole blocks, or `data` has the wrong size.
    """
    per_block, block_bytes = BLOCK_SHAPES[fmt]
    if cols % per_block:
        raise ValueError(f"{FORMAT_NAMES[fmt]} rows need a multiple of {per_block} columns, got {cols}")
    nbytes = rows * (cols // per_block) * block_bytes
    if data.numel() * data.element_size() != nbytes:
        raise ValueError(f"{FORMAT_NAMES[fmt]} [{rows}, {cols}] takes {nbytes} bytes, got {data.nbytes}")
    if fmt == FMT_F32:
        data = data.view(torch.float32).reshape(rows, cols)
    elif data.dtype != torch.uint8:
        data = data.view(torch.uint8).reshape(rows, -1)
    assert data.is_contiguous()
    return PackedMatrix(data, fmt, rows, cols)


def rows_of(p: PackedMatrix, start: int, n: int) -> PackedMatrix:
    """Rows [start, start + n) of `p` as a matrix on the same bytes (no copy): one expert's
    matrix of a mixture's 3-D tensor, which the loader keeps as stored (not in tiles)."""
    if p.x8 or not 0 <= start <= start + n <= p.rows:
        raise ValueError(
            f"rows {start}..{start + n} of a [{p.rows}, {p.cols}]{' tiled' if p.x8 else ''} matrix"
        )
    return PackedMatrix(p.data[start : start + n], p.fmt, n, p.cols)


def from_gguf(tensor: Any, row_order: torch.Tensor | None = None) -> PackedMatrix:
    """A 2-D tensor of a `gguf.GGUFReader` in its stored format, on the reader's memory map
    (no copy, unless `row_order` reorders the rows: a new tensor of the same bytes).

    Raises:
        ValueError: a tensor type the kernels do not read (the name says which), or not 2-D.
    """
    kind = tensor.tensor_type.name
    if kind not in GGUF_FORMATS:
        raise ValueError(f"no kernel for {kind} tensors ({tensor.name})")
    shape = [int(n) for n in tensor.shape]  # ggml order: columns first
    if len(shape) != 2:
        raise ValueError(f"{tensor.name} is not a matrix (shape {shape})")
    cols, rows = shape
    raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1)
    stored = data = torch.from_numpy(raw)
    if row_order is not None:
        # numpy's gather of whole rows: torch's indexing of uint8 rows by a LongTensor took
        # ~12 ms a matrix (0.7 s of the default model's 2.2 s load), numpy's 0.3 ms
        data = torch.from_numpy(raw[row_order.numpy()])
    packed = tile_rows(from_raw(data, GGUF_FORMATS[kind], rows, cols))
    if packed.data.data_ptr() != stored.data_ptr() and isinstance(tensor.data, np.memmap):
        _let_go(stored)  # the file's pages: tiles or rows in another order hold the same bytes
    return packed


TILED_FORMATS = {f.code for f in FORMATS if f.tiled}
"""The formats that `tile_rows` lays out in tiles of 8 rows (kernels.c, "8-row tiles")."""


def tile_rows(p: PackedMatrix) -> PackedMatrix:
    """`p` with its rows in tiles of 8 (a copy, as many bytes) where the kernels have tile
    products for its format on this CPU (Q4_K and Q6_K, AVX2 and up; rows a multiple of 8,
    columns of 256), whose products do the per-super-block work once for 8 rows (kernels.c,
    "8-row tiles"; docs/benchmarks.md has figures). Everything that reads a matrix takes
    either layout. Returns `p` itself otherwise, without the kernels, or with
    ``CHATBOT_TILES=0`` in the environment."""
    if p.fmt not in TILED_FORMATS or p.x8 or p.rows % 8 or p.cols % 256:
        return p
    if os.environ.get("CHATBOT_TILES", "1") == "0":
        return p
    try:
        lib = load_library()
    except KernelsUnavailable:
        return p
    out = torch.empty_like(p.data)
    mat = p.as_struct()
    if lib.chatbot_repack(ctypes.byref(mat), out.data_ptr()) != 0:
        return p
    return PackedMatrix(out, p.fmt, p.rows, p.cols, x8=True)


def _let_go(data: torch.Tensor) -> None:
    """Drop the whole pages of `data`, which lies on a file's read-only or copy-on-write
    map that nothing wrote to, from this process (Linux): they stay in the page cache, and a
    later read maps them again. Copied to tiles, a GGUF file's matrix is thus not held twice."""
    if not sys.platform.startswith("linux"):
        return
    page = mmap.PAGESIZE
    start = data.data_ptr()
    lo, hi = (start + page - 1) // page * page, (start + data.numel()) // page * page
    if hi > lo:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


def group_struct(parts: list[PackedMatrix], bias: torch.Tensor | None = None) -> Group:
    """The C view of row blocks that one product stacks (q, k, v), with an optional bias."""
    if not 1 <= len(parts) <= 3 or len({p.cols for p in parts}) != 1:
        raise ValueError("a group holds 1 to 3 row blocks with the same number of columns")
    mats = [p.as_struct() for p in parts] + [Mat() for _ in range(3 - len(parts))]
    return Group(
        (Mat * 3)(*mats), 0 if bias is None else bias.data_ptr(), len(parts), sum(p.rows for p in parts)
    )


def unpack(p: PackedMatrix, threads: int | None = None) -> torch.Tensor:
    """The float32 weights a packed matrix stands for ([rows, cols])."""
    if p.fmt == FMT_F32:
        return p.data
    out = torch.empty(p.rows, p.cols, dtype=torch.float32)
    lib = load_library()
    mat = p.as_struct()
    lib.chatbot_dequantize(ctypes.byref(mat), out.data_ptr(), threads or torch.get_num_threads())
    return out


def matvec_scratch(cols: int) -> torch.Tensor:
    """A scratch buffer for `chatbot_matvec` on a matrix of `cols` columns."""
    return torch.empty(int(load_library().chatbot_matvec_scratch(cols)), dtype=torch.float32)


def matvec(
    p: PackedMatrix, x: torch.Tensor, threads: int | None = None, act: int = ACT_F32, lib: Any = None
) -> torch.Tensor:
    """W x with the native kernel (x: float32 [cols]); for tests and micro-benchmarks.
    `act`: the form x takes in the block formats' products (`ACT_F32`, `ACT_Q8`, `ACT_I16`);
    `lib`: another build of the kernels (`open_library`) than the one `load_library` gives."""
    lib = lib or load_library()
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty(p.rows, dtype=torch.float32)
    scratch = matvec_scratch(p.cols)
    mat = p.as_struct()
    lib.chatbot_matvec(
        ctypes.byref(mat),
        x.data_ptr(),
        scratch.data_ptr(),
        y.data_ptr(),
        threads or torch.get_num_threads(),
        int(act),
    )
    return y


def _batched(name: str, p: PackedMatrix, x: torch.Tensor, threads: int | None) -> torch.Tensor | None:
    """x @ W.T by the batched product `name` of kernels.c; None where it returns -1."""
    lib = load_library()
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], p.rows, dtype=torch.float32)
    mat = p.as_struct()
    threads = threads or torch.get_num_threads()
    if getattr(lib, name)(ctypes.byref(mat), x.data_ptr(), x.shape[0], y.data_ptr(), threads) != 0:
        return None
    return y


def matmul_i16(p: PackedMatrix, x: torch.Tensor, threads: int | None = None) -> torch.Tensor | None:
    """x @ W.T ([n, cols] -> [n, rows]) with x as int16 per block, exact integer products (the
    batched form of `act=ACT_I16`, kernels.c `chatbot_matmul`); None where the kernels have no
    batched product for this format or CPU (AVX2 and up, block formats): the caller
    multiplies otherwise."""
    return _batched("chatbot_matmul", p, x, threads)


def matmul_x8(p: PackedMatrix, x: torch.Tensor, threads: int | None = None) -> torch.Tensor | None:
    """x @ W.T ([n, cols] -> [n, rows]) with x as int8 per super-block of 256 (ggml's Q8_K,
    as `act=ACT_Q8` decodes the K-quants and llama.cpp prefills), for a matrix in 8-row tiles
    (Q4_K, Q6_K on AVX2 and up: kernels.c `chatbot_matmul_x8`); None where there is no such
    product: the caller multiplies otherwise."""
    return _batched("chatbot_matmul_x8", p, x, threads)


def pack_lossless(*parts: torch.Tensor, rtol: float = 2e-6) -> PackedMatrix:
    """The smallest format that holds the row blocks `parts` exactly (up to float32 rounding),
    stacked: Q4_1, Q8_0, bf16 or float32. A model converted from a Q4_1/Q8_0 GGUF, or from
    bfloat16, thus decodes with the weights it already had, at a fraction of the memory
    traffic."""
    ws = [w.detach().to(torch.float32) for w in parts]
    if all(w.shape[1] % QK == 0 for w in ws) and len({w.shape[1] for w in ws}) == 1:
        for fmt in (FMT_Q4_1, FMT_Q8_0):
            packed, worst = quantize_rows(ws, fmt)
            if worst <= rtol:
                return packed
    if all(torch.equal(w.to(torch.bfloat16).to(torch.float32), w) for w in ws):
        return stack([pack_bf16(w) for w in ws])
    return stack([pack_f32(w) for w in ws])


def experts(
    mats: tuple[PackedMatrix, PackedMatrix, PackedMatrix],
    n_experts: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    acts: tuple[int, int, int],
    threads: int,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """A mixture's routed experts for n tokens (kernels.c `chatbot_experts`, llama.cpp's
    mul_mat_id): ``out[t] = sum_j weights[t, j] * down_e(act(gate_e x[t]) * up_e x[t])`` for
    e = ids[t, j], `mats` every expert's gate, up and down rows (not in tiles), each expert's
    rows read once for all its tokens. `acts`: the inputs' forms of gate/up and of down
    (`ACT_*`), and the activation (`ACT_FN_*`). `biases` (gpt-oss): the experts' gate/up
    biases [n_experts, 2 width] (each expert's gate bias, then its up bias) and their down
    biases [n_experts, hidden], added to each product's output. None where the kernels
    refuse (an id out of range, matrices of other shapes, memory)."""
    lib = load_library()
    x = x.detach().to(torch.float32).contiguous()
    n, k = ids.shape
    ids32 = ids.to(torch.int32).contiguous()
    w = weights.detach().to(torch.float32).contiguous()
    out = torch.empty(n, mats[0].cols, dtype=torch.float32)
    gate, up, down = (m.as_struct() for m in mats)
    bias_ptrs: tuple[int | None, int | None] = (None, None)
    if biases is not None:
        gu_bias, down_bias = (b.detach().to(torch.float32).contiguous() for b in biases)
        if (gu_bias.numel(), down_bias.numel()) != (2 * mats[0].rows, mats[2].rows):
            return None
        bias_ptrs = (gu_bias.data_ptr(), down_bias.data_ptr())
    status = lib.chatbot_experts(
        ctypes.byref(gate), ctypes.byref(up), ctypes.byref(down), n_experts, x.data_ptr(), n,
        ids32.data_ptr(), w.data_ptr(), k, *acts, *bias_ptrs, out.data_ptr(), threads,
    )  # fmt: skip
    return out if status == 0 else None
