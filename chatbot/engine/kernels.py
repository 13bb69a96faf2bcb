"""Native CPU kernels for decoding: build `kernels.c` once, load it with ctypes, pack weights.

The library is compiled with the system C compiler (``cc -O3 -march=native -fopenmp``; on
64-bit ARM ``-mcpu=native``, `arch_flags`) the first time it is needed (4.0 s of CPU time
with gcc 12 on an EPYC Zen 4, 2026-12-02: `time gcc -O3 -march=native -fopenmp -shared -fPIC
kernels.c`; the chat's prompt is up meanwhile),
and kept in ``$XDG_CACHE_HOME/chatbot/kernels`` under a key made of the source, the flags,
the compiler and the CPU, so later runs load it at once. A compiler without OpenMP (clang
without libomp, as Apple ships it) builds it with ``-pthread`` instead: kernels.c then runs
on a thread pool of its own, with the same work on the same threads (`uses_openmp` tells
which a library has).
Beside it, ``<name>.so.sha256`` records the checksum and size of what was built: a cached file
that does not match it (cut short, zeroed pages, another library, a directory in its place) is
never handed to the dynamic loader, which would crash the process on some of these (SIGBUS,
SIGSEGV), but built again. Where there is no compiler, or the build fails, `load_library`
raises `KernelsUnavailable` and callers fall back to torch.

Weight formats (see kernels.c): float32, bfloat16, float16, and ggml's block formats as they
are stored in GGUF files: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32 weights) and the K-quants
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256). `from_gguf` takes a tensor of a GGUF file
as it is (memory-mapped, no copy); `pack_q8_0` / `pack_q4_1` quantize float weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatbot.errors import ChatbotError

SOURCE = Path(__file__).with_name("kernels.c")
QK = 32  # weights per quantization block

QK_K = 256  # weights per K-quant super-block

FMT_F32, FMT_BF16, FMT_Q8_0, FMT_Q4_1, FMT_F16, FMT_Q4_0, FMT_Q5_0 = 0, 1, 2, 3, 4, 5, 6
FMT_Q5_1, FMT_Q2_K, FMT_Q3_K, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K = 7, 8, 9, 10, 11, 12
ACT_F32, ACT_Q8, ACT_I16 = 0, 1, 2  # the form of activations in Q8_0/Q4_1 products (kernels.c)
ACT_FN_SILU, ACT_FN_GELU_TANH = 0, 1  # the MLP's activation (kernels.c)
FORMAT_NAMES = {
    FMT_F32: "f32", FMT_BF16: "bf16", FMT_Q8_0: "q8_0", FMT_Q4_1: "q4_1", FMT_F16: "f16",
    FMT_Q4_0: "q4_0", FMT_Q5_0: "q5_0", FMT_Q5_1: "q5_1", FMT_Q2_K: "q2_k", FMT_Q3_K: "q3_k",
    FMT_Q4_K: "q4_k", FMT_Q5_K: "q5_k", FMT_Q6_K: "q6_k",
}  # fmt: skip
# formats with integer products for int16 activations (ACT_I16) on AVX2 and on ARM (NEON); the
# others, and every format on a CPU with neither, multiply float32 activations
INT16_PRODUCTS = {FMT_Q8_0, FMT_Q4_1, FMT_Q4_0, FMT_Q5_0, FMT_Q5_1, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K}
# weights per block and bytes per block (ggml's block structs)
BLOCK_SHAPES = {
    FMT_F32: (1, 4), FMT_BF16: (1, 2), FMT_F16: (1, 2), FMT_Q8_0: (32, 34), FMT_Q4_1: (32, 20),
    FMT_Q4_0: (32, 18), FMT_Q5_0: (32, 22), FMT_Q5_1: (32, 24), FMT_Q2_K: (256, 84),
    FMT_Q3_K: (256, 110), FMT_Q4_K: (256, 144), FMT_Q5_K: (256, 176), FMT_Q6_K: (256, 210),
}  # fmt: skip
# GGUF tensor type names (gguf.GGMLQuantizationType) -> kernel format
GGUF_FORMATS = {
    "F32": FMT_F32, "BF16": FMT_BF16, "F16": FMT_F16, "Q8_0": FMT_Q8_0, "Q4_1": FMT_Q4_1,
    "Q4_0": FMT_Q4_0, "Q5_0": FMT_Q5_0, "Q5_1": FMT_Q5_1, "Q2_K": FMT_Q2_K, "Q3_K": FMT_Q3_K,
    "Q4_K": FMT_Q4_K, "Q5_K": FMT_Q5_K, "Q6_K": FMT_Q6_K,
}  # fmt: skip


class KernelsUnavailable(ChatbotError):
    """The native kernels cannot be built or loaded here (no compiler, unsupported CPU...)."""


# --- ctypes mirrors of the C structs -------------------------------------------------------


class Mat(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("fmt", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
        ("x8", ctypes.c_int32),
    ]


class Group(ctypes.Structure):
    """Row blocks of one product, each in its own format, and an optional bias."""

    _fields_ = [
        ("part", Mat * 3),
        ("bias", ctypes.c_void_p),
        ("n_parts", ctypes.c_int32),
        ("rows", ctypes.c_int32),
    ]


class ModelStruct(ctypes.Structure):
    _fields_ = [
        ("n_layers", ctypes.c_int32),
        ("dim", ctypes.c_int32),
        ("n_heads", ctypes.c_int32),
        ("n_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("ffn_dim", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("n_threads", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("attn_scale", ctypes.c_float),
        ("rope_len", ctypes.c_int32),
        ("cap", ctypes.c_int32),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("embed", ctypes.POINTER(Mat)),
        ("lm_head", ctypes.POINTER(Mat)),
        ("final_norm", ctypes.c_void_p),
        ("attn_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("ffn_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("wqkv", ctypes.POINTER(Group)),
        ("wo", ctypes.POINTER(Group)),
        ("wgu", ctypes.POINTER(Group)),
        ("wdown", ctypes.POINTER(Group)),
        ("kcache", ctypes.POINTER(ctypes.c_void_p)),
        ("vcache", ctypes.POINTER(ctypes.c_void_p)),
        ("scratch", ctypes.c_void_p),
        ("act", ctypes.c_int32),
        ("pad_", ctypes.c_int32),
        ("q_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("k_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("post_attn_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("post_ffn_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("window", ctypes.POINTER(ctypes.c_int32)),
        ("rope_sel", ctypes.POINTER(ctypes.c_int32)),
        ("rope_cos2", ctypes.c_void_p),
        ("rope_sin2", ctypes.c_void_p),
        ("embed_scale", ctypes.c_float),
        ("attn_softcap", ctypes.c_float),
        ("final_softcap", ctypes.c_float),
        ("act_fn", ctypes.c_int32),
    ]


ABI_MIRRORS: dict[str, type[ctypes.Structure]] = {"mat": Mat, "group": Group, "model": ModelStruct}
"""The C structs by the suffix of their exported size function (``chatbot_sizeof_<name>``)."""


def check_abi(lib: Any, mirrors: dict[str, type[ctypes.Structure]] | None = None) -> None:
    """Compare the size of every ctypes mirror with the C compiler's `sizeof` of its struct.

    A field added or retyped on one side only shifts the fields after it, and the kernels
    would then follow garbage pointers; a size check catches that before any call.

    Raises:
        KernelsUnavailable: a mirror whose size differs from the C struct's (names both).
    """
    for name, mirror in (mirrors or ABI_MIRRORS).items():
        fn = getattr(lib, f"chatbot_sizeof_{name}")
        fn.argtypes, fn.restype = [], ctypes.c_long
        c_size, py_size = int(fn()), ctypes.sizeof(mirror)
        if c_size != py_size:
            raise KernelsUnavailable(
                f"the native kernels do not match their Python side: struct {name} is {c_size} bytes "
                f"in kernels.c but {py_size} in kernels.py's {mirror.__name__}; update both together"
            )


# --- building and loading --------------------------------------------------------------------

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def kernels_dir() -> Path:
    """`$XDG_CACHE_HOME/chatbot/kernels` (default `~/.cache/chatbot/kernels`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "chatbot" / "kernels"


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, gcc or clang (None: none)."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


# the lines of /proc/cpuinfo that name the CPU and its features: x86, then ARM
_CPUINFO_KEYS = ("model name", "flags", "CPU implementer", "CPU part", "Features")


def _cpu_identity() -> str:
    """What -march=native (-mcpu=native) depends on: the CPU model and its features."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() + platform.machine()
    first: dict[str, str] = {}
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in _CPUINFO_KEYS:
            first.setdefault(key, line)
    return "\n".join(first.values()) or platform.processor() + platform.machine()


def arch_flags(machine: str | None = None, system: str | None = None) -> list[str]:
    """The compiler flags that pick this CPU's instructions for the kernels.

    x86-64 (and anything else): ``-march=native``. 64-bit ARM: ``-mcpu=native`` (GCC and
    clang on Linux: NEON, and the int8 dot products where the core has them), or
    ``-mcpu=apple-m1`` on macOS (older Apple clang has no native; every M chip has them).
    """
    machine = (machine or platform.machine()).lower()
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=apple-m1"] if (system or platform.system()) == "Darwin" else ["-mcpu=native"]
    return ["-march=native"]


FLAGS = ["-O3", *arch_flags(), "-fopenmp", "-shared", "-fPIC", "-std=c11"]
NO_OPENMP_FLAGS = [flag for flag in FLAGS if flag != "-fopenmp"] + ["-pthread"]
"""The build where the compiler has no OpenMP: kernels.c's own thread pool (pthreads)."""


def extra_flags() -> list[str]:
    """``$CHATBOT_KERNEL_FLAGS``, added to every build: e.g. ``-mno-avx512f`` builds the AVX2
    kernels on an AVX-512 machine, to measure or test what such CPUs run (the cache keeps
    each set of flags apart)."""
    return shlex.split(os.environ.get("CHATBOT_KERNEL_FLAGS", ""))


def build_flags(openmp: bool = True) -> list[str]:
    """The compiler flags of the OpenMP build, or of the build on kernels.c's own pool."""
    return [*(FLAGS if openmp else NO_OPENMP_FLAGS), *extra_flags()]


def library_path(cc: str, openmp: bool = True) -> Path:
    """Where the library built by `cc` (with OpenMP or without) is cached for this source
    and CPU: the two builds have their own names."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(build_flags(openmp)), version, _cpu_identity()]).encode()
    ).hexdigest()[:16]
    return kernels_dir() / f"chatbot_kernels-{key}.so"


def uses_openmp(lib: Any) -> bool:
    """Whether a loaded kernels library runs its threads on OpenMP (else on its own pool)."""
    return int(lib.chatbot_openmp()) != 0


def checksum_path(library: Path) -> Path:
    """Where the checksum of a built library is kept: beside it, ``<name>.so.sha256``."""
    return library.with_name(library.name + ".sha256")


def _digest(path: Path | str) -> tuple[str, int]:
    """The sha256 and size of a file, read with read(): a damaged file mapped into memory
    (as the dynamic loader maps it) can kill the process, reading it cannot."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def _write_atomically(path: Path, text: str) -> None:
    """Write `path` by renaming a complete, synced temporary file over it."""
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # as readable as the library (mkstemp makes it 0600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_MISSING = "is missing"  # what `_untrusted` says of a library not built yet


def _untrusted(library: Path) -> str | None:
    """Why the cached `library` must not be loaded (it says what the file is), or None when
    it is the file that `build` made there: the size and sha256 its checksum file records."""
    if not os.path.lexists(library):
        return _MISSING
    try:
        recorded = checksum_path(library).read_text().split()
        digest, size = recorded[0], int(recorded[1])
    except (OSError, ValueError, IndexError):
        return "has no checksum (it was not built by this version, or was changed since)"
    try:
        actual, actual_size = _digest(library)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if actual_size != size:
        return f"is damaged: {actual_size:,} bytes where {size:,} were built"
    if actual != digest:
        return "is damaged: its sha256 differs from the one recorded when it was built"
    return None


@contextlib.contextmanager
def _cache_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on the kernel cache while one process checks, builds and loads the
    library: a second process started at the same moment waits, then loads the first one's
    build instead of compiling beside it, and never reads a library and checksum that do not
    belong together. Where locks are not available (no fcntl, a read-only or network
    folder) it goes on without: the checksum still keeps a damaged file out."""
    fd: int | None = None
    try:
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def compile_command(cc: str, flags: list[str], target: str | Path, source: Path = SOURCE) -> list[str]:
    """The compiler's command line that builds `source` (kernels.c, or a copy of it) into the
    shared library `target` with `flags` (`build_flags`)."""
    return [cc, *flags, "-o", str(target), str(source), "-lm"]


def build(cc: str, target: Path, openmp: bool = True) -> None:
    """Compile kernels.c into `target` (with OpenMP, or on its own thread pool), then record
    its checksum (`checksum_path`).

    Both files are written atomically (a half-written file never has its name), the
    library first: a checksum is always that of a complete build, so a reader that finds
    the library matching it has that build, whatever other processes did in between.

    Raises:
        KernelsUnavailable: the compiler failed (the message holds its first error lines),
            or the cache folder cannot be written (the message names what to delete or fix).
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        raise KernelsUnavailable(
            f"cannot write the native kernels into {target.parent}: {exc.strerror or exc}"
        ) from None
    try:
        proc = subprocess.run(
            compile_command(cc, build_flags(openmp), tmp),
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            first = " ".join((proc.stderr or proc.stdout).strip().splitlines()[:3])
            raise KernelsUnavailable(f"building the native kernels with {cc} failed: {first}")
        try:
            digest, size = _digest(tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)  # on disk before its name is: no zeroed pages after a power cut
            finally:
                os.close(fd)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)  # a file cannot be renamed over a directory
            os.replace(tmp, target)
            _write_atomically(checksum_path(target), f"{digest} {size}\n")
        except OSError as exc:
            raise KernelsUnavailable(
                f"cannot write the native kernels to {target} ({exc.strerror or exc}); delete {target}"
            ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def loaded() -> ctypes.CDLL | None:
    """The kernels library where `load_library` has loaded it already; else None."""
    return _library


def failure() -> str | None:
    """Why the kernels could not be loaded, once `load_library` has failed; else None."""
    return _failure


def _declare(lib: ctypes.CDLL) -> None:
    """The argument and result types of the kernels' functions."""
    lib.chatbot_decode.argtypes = [
        ctypes.POINTER(ModelStruct),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.chatbot_decode.restype = ctypes.c_int
    lib.chatbot_scratch_floats.argtypes = [ctypes.POINTER(ModelStruct), ctypes.c_int]
    lib.chatbot_decode_batch.argtypes = [
        ctypes.POINTER(ModelStruct),
        ctypes.c_int,
        ctypes.c_void_p,  # tokens [B] int32
        ctypes.c_void_p,  # positions [B] int32
        ctypes.c_void_p,  # cache capacities [B] int32
        ctypes.c_void_p,  # key caches [B * n_layers] pointers
        ctypes.c_void_p,  # value caches
        ctypes.c_void_p,  # scratch
        ctypes.c_void_p,  # logits [B, vocab], or [vocab] with last_only
        ctypes.c_int,  # last_only: the last row's logits alone
        ctypes.c_int,  # threads
    ]
    lib.chatbot_decode_batch.restype = ctypes.c_int
    lib.chatbot_batch_scratch_floats.argtypes = [
        ctypes.POINTER(ModelStruct),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.chatbot_batch_scratch_floats.restype = ctypes.c_long
    lib.chatbot_max_batch.argtypes = []
    lib.chatbot_max_batch.restype = ctypes.c_long
    lib.chatbot_scratch_floats.restype = ctypes.c_long
    lib.chatbot_matvec.argtypes = [
        ctypes.POINTER(Mat),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.chatbot_matvec.restype = None
    lib.chatbot_matmul.argtypes = [
        ctypes.POINTER(Mat),
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.chatbot_matmul.restype = ctypes.c_int
    lib.chatbot_matvec_scratch.argtypes = [ctypes.c_int]
    lib.chatbot_matvec_scratch.restype = ctypes.c_long
    lib.chatbot_dequantize.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p, ctypes.c_int]
    lib.chatbot_dequantize.restype = None
    lib.chatbot_rows.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.chatbot_rows.restype = None
    lib.chatbot_repack.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p]
    lib.chatbot_repack.restype = ctypes.c_int
    lib.chatbot_quantize.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.chatbot_quantize.restype = None
    lib.chatbot_openmp.argtypes, lib.chatbot_openmp.restype = [], ctypes.c_int


def open_library(path: Path) -> ctypes.CDLL:
    """Load a library that passed its checksum, and check that it is these kernels (a build
    of another kind, e.g. without OpenMP, can be loaded beside the one `load_library` gives).

    Raises:
        KernelsUnavailable: the dynamic loader refused it, or it is another library or
            another version of the kernels (`check_abi`).
    """
    try:
        # torch is imported already, so an OpenMP build's libgomp resolves to the copy torch
        # loaded: one OpenMP runtime, one thread pool.
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelsUnavailable(f"cannot load the native kernels: {exc}") from None
    try:
        check_abi(lib)
        _declare(lib)
    except (KernelsUnavailable, AttributeError) as exc:
        with contextlib.suppress(AttributeError, OSError):
            # unloaded, so that a library rebuilt under the same name is loaded afresh
            # (the dynamic loader hands back a library still loaded under that name)
            import _ctypes

            _ctypes.dlclose(lib._handle)
        if isinstance(exc, KernelsUnavailable):
            raise
        raise KernelsUnavailable(f"the native kernels lack {exc}") from None
    return lib


def _open_trusted(path: Path) -> tuple[ctypes.CDLL | None, str]:
    """The library at `path` where it matches its checksum and loads, else None and what is
    wrong with it."""
    problem = _untrusted(path)
    if problem is None:
        try:
            return open_library(path), ""
        except KernelsUnavailable as exc:
            problem = f"does not load ({exc})"
    return None, problem


def _load_cached(cc: str, path: Path, pool_path: Path) -> ctypes.CDLL:
    """The OpenMP build at `path` where it matches its checksum and loads; else the build
    without OpenMP at `pool_path`, where an earlier start found that `cc` has none (there
    is no OpenMP build then); otherwise built again, once: with OpenMP, and where that fails,
    without (what a compiler without OpenMP builds; the two builds' names differ).

    Raises:
        KernelsUnavailable: the build failed both ways (the message is the OpenMP build's),
            or what it built does not load either; the message says what happened to which
            file.
    """
    lib, problem = _open_trusted(path)
    if lib is not None:
        return lib
    if problem == _MISSING:
        lib, _ = _open_trusted(pool_path)
        if lib is not None:
            return lib
    try:
        build(cc, path)
    except KernelsUnavailable as exc:
        try:
            build(cc, pool_path, openmp=False)
        except KernelsUnavailable:
            if problem == _MISSING:
                raise exc from None
            raise KernelsUnavailable(
                f"{exc}; the cached {path} {problem}, so it was not used (delete it)"
            ) from None
        path = pool_path
    lib, problem = _open_trusted(path)
    if lib is not None:
        return lib
    raise KernelsUnavailable(
        f"the native kernels just rebuilt in {path} {problem}; delete {path} and "
        f"{checksum_path(path).name} beside it if this persists"
    )


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
            with _cache_lock(path.parent):
                lib = _load_cached(cc, path, library_path(cc, openmp=False))
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


BLOCK_BYTES = {FMT_Q8_0: 34, FMT_Q4_1: 20}


def _quantize(
    w: torch.Tensor, fmt: int, out: torch.Tensor | None = None
) -> tuple[PackedMatrix, float, float]:
    """Pack `w` in a block format (into `out`, uint8 [rows, bytes per row], when given); also
    return the largest rounding error and the largest |w|.

    One thread: packing runs once per model load and takes well under a second, while
    OpenMP threads on a busy machine can make it ten times slower.
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
    stored = data = torch.from_numpy(np.ascontiguousarray(tensor.data)).view(torch.uint8).reshape(rows, -1)
    if row_order is not None:
        data = data.reshape(rows, -1)[row_order].contiguous()
    packed = tile_rows(from_raw(data, GGUF_FORMATS[kind], rows, cols))
    if packed.data.data_ptr() != stored.data_ptr() and isinstance(tensor.data, np.memmap):
        _let_go(stored)  # the file's pages: tiles or rows in another order hold the same bytes
    return packed


TILED_FORMATS = {FMT_Q4_K, FMT_Q6_K}
"""The formats that `tile_rows` lays out in tiles of 8 rows (kernels.c, "8-row tiles")."""


def tile_rows(p: PackedMatrix) -> PackedMatrix:
    """`p` with its rows in tiles of 8 (a copy, as many bytes) where the kernels have tile
    products for its format on this CPU (Q4_K and Q6_K, AVX2 and up; rows a multiple of 8,
    columns of 256): one thread's products run 1.15-2x faster so with the matrix in cache,
    less when it streams from memory (docs/benchmarks.md). Everything that reads
    a matrix takes either layout. Returns `p` itself otherwise, without the kernels, or with
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


def matmul_i16(p: PackedMatrix, x: torch.Tensor, threads: int | None = None) -> torch.Tensor | None:
    """x @ W.T ([n, cols] -> [n, rows]) with x as int16 per block, exact integer products (the
    batched form of `act=ACT_I16`, kernels.c); None where the kernels have no batched product
    for this format or CPU (AVX-512 and a block format): the caller multiplies otherwise."""
    lib = load_library()
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], p.rows, dtype=torch.float32)
    mat = p.as_struct()
    threads = threads or torch.get_num_threads()
    if lib.chatbot_matmul(ctypes.byref(mat), x.data_ptr(), x.shape[0], y.data_ptr(), threads) != 0:
        return None
    return y


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
