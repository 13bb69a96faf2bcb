"""What this machine gives the chatbot, for `chatbot doctor`: the CPU and the SIMD level the
kernels are built for, the C compiler and whether it has OpenMP (else the kernels run on their
own thread pool), where the kernels are cached, the GPUs torch sees, and which decode path a
model takes. Facts only; the CLI prints them.

Nothing here imports torch or builds the kernels at import: `chatbot --version` reads the
SIMD level from the compiler's preprocessor alone (`simd_level`)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from chatbot.engine.backends.native import build as kernel_build


@dataclass
class Compiler:
    """The C compiler the kernels would be built with (None: there is none)."""

    command: str | None
    version: str = ""
    openmp: bool = False
    macros: set[str] = field(default_factory=set)  # what -march=native (kernels.arch_flags) defines

    @property
    def simd(self) -> str:
        """The SIMD level kernels.c is compiled for on this CPU."""
        return kernel_build.simd_level(self.macros)


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The CPU architecture: x86_64, aarch64, arm64..."""
    return platform.machine()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), as torch and the kernels see them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _run(args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def compiler() -> Compiler:
    """The compiler `kernels.load_library` would use, its version, its -march=native macros
    and whether `-fopenmp` builds and links (Apple's clang and clang without libomp fail)."""
    cc = kernel_build.find_compiler()
    if cc is None:
        return Compiler(None)
    version = _run([cc, "--version"])
    first = version.stdout.splitlines()[0] if version is not None and version.stdout else ""
    defined = kernel_build.compiler_macros(cc)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "omp.c"
        src.write_text("#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        built = _run([cc, "-fopenmp", "-o", str(Path(tmp) / "omp"), str(src)])
    openmp = built is not None and built.returncode == 0
    return Compiler(shutil.which(cc) or cc, first, openmp, defined)


def simd_level() -> str:
    """The SIMD level the kernels are (or would be) built for here, and by what, from the
    compiler's preprocessor in a few milliseconds: no build, no torch."""
    cc = kernel_build.find_compiler()
    if cc is None:
        return "none (no C compiler: models decode through transformers)"
    flags = " ".join([cc, *kernel_build.arch_flags(), *kernel_build.extra_flags()])
    return f"{Compiler(cc, macros=kernel_build.compiler_macros(cc)).simd} ({flags})"


def version_lines() -> list[str]:
    """`chatbot --version`: the package and the libraries it runs on, and the kernels' SIMD
    level; read from the installed packages' metadata and the compiler (fast: no torch)."""
    env = environment()
    versions = f"python {env['python']}, torch {env['torch']}, transformers {env['transformers']}"
    return [f"chatbot {env['chatbot']} ({versions})", f"kernels: {simd_level()}"]


@dataclass
class Gpu:
    """The accelerators torch sees."""

    cuda: list[str]
    mps: bool


def gpus() -> Gpu:
    import torch

    cuda = []
    if torch.cuda.is_available():
        cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return Gpu(cuda, mps)


def kernels_cache(cc: Compiler) -> tuple[Path, Path | None]:
    """The kernels' cache folder, and the library this compiler and CPU would use (None
    without a compiler): the OpenMP build, or the one on the kernels' own pool."""
    from chatbot.engine.backends.native import kernels  # torch: only `chatbot doctor` asks

    if cc.command is None:
        return kernels.kernels_dir(), None
    lib = kernels.loaded()
    openmp = kernels.uses_openmp(lib) if lib is not None else cc.openmp
    return kernels.kernels_dir(), kernels.library_path(cc.command, openmp=openmp)


def kernel_threads(cc: Compiler) -> str | None:
    """How the kernels run on several threads: "OpenMP", or "own pool" where they were (or
    would be) built without it; None without a compiler. A loaded library says so itself."""
    from chatbot.engine.backends.native import kernels

    lib = kernels.loaded()
    if lib is not None:
        return "OpenMP" if kernels.uses_openmp(lib) else "own pool"
    if cc.command is None:
        return None
    return "OpenMP" if cc.openmp else "own pool"


def environment() -> dict[str, str]:
    """Python, the platform, and the versions of the libraries the chat runs on."""
    from importlib.metadata import PackageNotFoundError, version

    from chatbot import DISTRIBUTION

    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name, dist in (("chatbot", DISTRIBUTION), ("torch", "torch"), ("transformers", "transformers")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def kv_store() -> str:
    """What the chats' KV caches on disk hold, where, and the store's cap."""
    from chatbot.conversation.kvstore import describe_store

    return describe_store()
