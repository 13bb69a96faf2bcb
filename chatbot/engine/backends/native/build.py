"""Building the native kernels and keeping them in the user's cache.

The source is the folder `csrc/`: ``kernels.h`` and one ``.c`` file per concern (formats,
integer products, tiles, thread pool, ops, decode, batched decode, prefill), which
``csrc/kernels.c`` includes in order, so that they compile as one translation unit and the
compiler inlines across them. It is compiled with the system C compiler
(``cc -O3 -march=native -fopenmp``; on 64-bit ARM ``-mcpu=native``, `arch_flags`) and kept in
``$XDG_CACHE_HOME/chatbot/kernels`` under a key made of every file of `csrc/`, the flags, the
compiler and the CPU (`library_path`). A compiler without OpenMP (clang without libomp, as
Apple ships it) builds it with ``-pthread`` instead: the kernels then run on a thread pool of
their own (csrc/pool.c), with the same work on the same threads (`uses_openmp` tells which a
library has). Beside each library,
``<name>.so.sha256`` records the checksum and size of what was built: a cached file that does
not match it (cut short, zeroed pages, another library, a directory in its place) is never
handed to the dynamic loader, which would crash the process on some of these (SIGBUS,
SIGSEGV), but built again (`load_cached`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chatbot.engine.backends.native.kernel_abi import KernelsUnavailable, check_abi, declare_functions
from chatbot.progress import waiting

SOURCE_DIR = Path(__file__).with_name("csrc")
"""The kernels' C source: kernels.h and the parts that csrc/kernels.c includes."""
SOURCE = SOURCE_DIR / "kernels.c"
"""The one file the compiler is given (its parts are included from beside it)."""

_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)".*$', re.MULTILINE)


def source_files() -> list[Path]:
    """Every file of `csrc/`, by path: what the cache key hashes, so that an edit to any part
    builds the kernels again."""
    return sorted(p for p in SOURCE_DIR.rglob("*") if p.is_file())


def source_digest() -> str:
    """The sha256 of every file of `csrc/`: its path in the folder and its bytes."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.relative_to(SOURCE_DIR).as_posix().encode() + b"\0")
        data = path.read_bytes()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def source_text(source: Path = SOURCE) -> str:
    """The whole source as one text, as the compiler reads it: `source` with each
    ``#include "part"`` replaced by that part's text. Written anywhere, it builds alone (the
    changed copies that tests and scripts/bench-kernels compile)."""
    return _LOCAL_INCLUDE.sub(
        lambda found: source_text(source.parent / found.group(1)).rstrip("\n"), source.read_text()
    )


SIMD_LEVELS = [
    ("AVX-512 VNNI", ("__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512VNNI__", "__AVX2__")),
    ("AVX-512", ("__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX2__")),
    ("AVX2", ("__AVX2__", "__FMA__", "__F16C__")),
    ("NEON + dotprod", ("__aarch64__", "__ARM_NEON", "__ARM_FEATURE_DOTPROD")),
    ("NEON", ("__aarch64__", "__ARM_NEON")),
]
"""What the kernels' source tests (csrc/kernels.h), from the widest down: the level they run at,
by the macros the compiler defines with `arch_flags`."""


def simd_level(macros: set[str]) -> str:
    """The SIMD level the kernels compile to where the compiler defines `macros`."""
    for name, needs in SIMD_LEVELS:
        if all(m in macros for m in needs):
            return name
    return "none (portable C, scalar)" if macros else "unknown"


def compiler_macros(cc: str) -> set[str]:
    """The macros `cc` defines with the kernels' flags (empty where it cannot say)."""
    try:
        proc = subprocess.run(
            [cc, *arch_flags(), *extra_flags(), "-dM", "-E", "-x", "c", "-"],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if proc.returncode != 0:
        return set()
    return {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}


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
"""The build where the compiler has no OpenMP: the kernels' own thread pool (pthreads)."""


def extra_flags() -> list[str]:
    """``$CHATBOT_KERNEL_FLAGS``, added to every build: e.g. ``-mno-avx512f`` builds the AVX2
    kernels on an AVX-512 machine, to measure or test what such CPUs run (the cache keeps
    each set of flags apart)."""
    return shlex.split(os.environ.get("CHATBOT_KERNEL_FLAGS", ""))


def build_flags(openmp: bool = True) -> list[str]:
    """The compiler flags of the OpenMP build, or of the build on the kernels' own pool."""
    return [*(FLAGS if openmp else NO_OPENMP_FLAGS), *extra_flags()]


def library_path(cc: str, openmp: bool = True) -> Path:
    """Where the library built by `cc` (with OpenMP or without) is cached for this source
    (every file of `csrc/`) and CPU: the two builds have their own names."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(
        "\0".join([source_digest(), " ".join(build_flags(openmp)), version, _cpu_identity()]).encode()
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
def cache_lock(folder: Path) -> Iterator[None]:
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
    """The compiler's command line that builds `source` (csrc/kernels.c, or a changed copy of
    csrc/ or of `source_text`) into the shared library `target` with `flags` (`build_flags`)."""
    return [cc, *flags, "-o", str(target), str(source), "-lm"]


def build(cc: str, target: Path, openmp: bool = True) -> None:
    """Compile the kernels into `target` (with OpenMP, or on its own thread pool), then record
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
        declare_functions(lib)
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


def load_cached(cc: str, path: Path, pool_path: Path) -> ctypes.CDLL:
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
    level = simd_level(compiler_macros(cc))
    try:
        with waiting(f"building the kernels for {level} (once, ~20 s)"):
            build(cc, path)
    except KernelsUnavailable as exc:
        try:
            with waiting(f"building the kernels for {level}, no OpenMP (once, ~20 s)"):
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
