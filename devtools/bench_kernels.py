"""The kernels' matrix-vector products of a GGUF file, several builds side by side in one
process: e.g. the native build against ``-mno-avx512f`` (what an AVX2 CPU runs), or a
changed copy of the source (csrc/) against the current one.

On a shared virtual machine the memory bandwidth one core gets moves by 1.5x from minute to
minute, so two builds timed in two processes, or one after the other, differ by more than
most changes to a kernel. Here every build is loaded at once, and each round times every
build in turn on the same matrices and the same input:

- ``hot``: each kind of matrix of the first layer (format and shape) 20 times in a row, so
  it stays in cache: the kernel's arithmetic;
- ``layers``: every layer's matrices once, as a decode step reads them, from memory;
- ``output``: the output matrix (the embedding where the model ties them).

Every figure is the minimum and the median over the rounds, in ms, and the minimum's GB/s.
`acts` times each build with int16 inputs (``--opt auto``), int8 ones (``--opt fast``), or
both (rows ``build/int16``, ``build/int8``).
Unless told not to (`check=False`, for a copy whose products are meant to differ), each
build's products must equal the first build's. Run it with `scripts/bench-kernels`.
"""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.gguf_weights import GGUFWeights

HOT_REPEATS = 20
ACTS = {"int16": kernels.ACT_I16, "int8": kernels.ACT_Q8}
_LAYER_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def default_builds() -> dict[str, str]:
    """The native build, and on an AVX-512 CPU also the AVX2 one (``-mno-avx512f``)."""
    builds = {"native": ""}
    try:
        if " avx512f" in Path("/proc/cpuinfo").read_text():
            builds["avx2"] = "-mno-avx512f"
    except OSError:
        pass
    return builds


def build(name: str, flags: str, folder: Path, source: Path | None = None) -> ctypes.CDLL:
    """csrc/kernels.c (or `source`: the kernels.c of a changed copy of csrc/, or the whole
    source in one file, `kernel_build.source_text`) compiled as the cache would, plus `flags`:
    with OpenMP, or where the compiler has none (clang without libomp), on the kernels' own
    pool.

    Raises:
        RuntimeError: the compiler failed (the OpenMP build's first error line).
    """
    cc = kernels.find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    target = folder / f"kernels-{name}.so"
    errors = []
    for base in (kernels.FLAGS, kernels.NO_OPENMP_FLAGS):
        cmd = kernels.compile_command(cc, [*base, *flags.split()], target, source or kernels.SOURCE)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return kernels.open_library(target)
        errors.append((done.stderr or done.stdout).strip().splitlines()[0])
    raise RuntimeError(f"build {name!r} failed: {errors[0]}")


def matrices(path: Path) -> dict[str, list[kernels.PackedMatrix]]:
    """The groups of matrices timed: hot (one of each kind in the first layer), layers, output."""
    src = GGUFWeights(path)
    layers, i = [], 0
    while f"blk.{i}.attn_q.weight" in src:
        layers += [src.matrix(f"blk.{i}.{part}.weight") for part in _LAYER_PARTS]
        i += 1
    if not layers:
        raise ValueError(f"{path}: no blk.N.attn_q.weight matrices (not a Llama-family file)")
    hot: dict[tuple[int, int, int], kernels.PackedMatrix] = {}
    for p in layers[: len(_LAYER_PARTS)]:
        hot.setdefault((p.fmt, p.rows, p.cols), p)
    out = "output.weight" if "output.weight" in src else "token_embd.weight"
    return {"hot": list(hot.values()), "layers": layers, "output": [src.matrix(out)]}


def run_kernels_bench(
    path: Path,
    builds: dict[str, str],
    sources: dict[str, Path] | None = None,
    rounds: int = 8,
    threads: int = 1,
    check: bool = True,
    folder: Path | None = None,
    acts: tuple[str, ...] = ("int16",),
) -> dict[str, Any]:
    """Time `builds` (name -> extra compiler flags; `sources`: name -> a C file to build
    instead, as `build` takes it) on the file's matrices, alternating them `rounds` times.

    Returns:
        {"builds": {name: {group: {"min_ms", "median_ms", "gbps"}}}, "bytes": {group: n},
        "cpu", "threads", "rounds", "load": the 1-minute load average before and after}.

    Raises:
        RuntimeError: a build failed, or (with `check`) its products differ from the first's.
    """
    import tempfile

    try:  # the cached build: for the tiles' layout, made as a user's run makes it
        kernels.load_library()
    except kernels.KernelsUnavailable as exc:
        raise RuntimeError(str(exc)) from None
    groups = matrices(path)
    nbytes = {g: sum(p.data.numel() * p.data.element_size() for p in ms) for g, ms in groups.items()}
    gen = torch.Generator().manual_seed(0)
    inputs = {c: torch.randn(c, generator=gen) for c in {p.cols for ms in groups.values() for p in ms}}
    with tempfile.TemporaryDirectory() as tmp:
        built = {n: build(n, f, Path(folder or tmp), (sources or {}).get(n)) for n, f in builds.items()}
        # (build, inputs) pairs, named by the build alone where one kind of inputs is timed
        libs = {(f"{n}/{a}" if len(acts) > 1 else n): (lib, a) for n, lib in built.items() for a in acts}
        times: dict[str, dict[str, list[float]]] = {n: {g: [] for g in groups} for n in libs}
        first: dict[tuple[str, int], torch.Tensor] = {}
        load = [os.getloadavg()[0]]
        for name, (lib, act) in libs.items():  # warm-up and the check against the first build
            for i, p in enumerate(m for ms in groups.values() for m in ms):
                y = kernels.matvec(p, inputs[p.cols], threads, ACTS[act], lib=lib)
                ref = first.setdefault((act, i), y)
                if check and not torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())):
                    raise RuntimeError(
                        f"build {name!r}: its products differ from those of build {next(iter(built))!r}"
                    )
        for _ in range(rounds):
            for name, (lib, act) in libs.items():
                for group, ms in groups.items():
                    reps = HOT_REPEATS if group == "hot" else 1
                    start = time.perf_counter()
                    for _ in range(reps):
                        for p in ms:
                            kernels.matvec(p, inputs[p.cols], threads, ACTS[act], lib=lib)
                    times[name][group].append((time.perf_counter() - start) / reps * 1000)
        load.append(os.getloadavg()[0])
    return {
        "builds": {
            n: {
                g: {"min_ms": min(t), "median_ms": statistics.median(t), "gbps": nbytes[g] / min(t) / 1e6}
                for g, t in per.items()
            }
            for n, per in times.items()
        },
        "bytes": nbytes,
        "cpu": platform.processor() or platform.machine(),
        "threads": threads,
        "rounds": rounds,
        "load": load,
    }


def format_kernels(result: dict[str, Any]) -> str:
    """A table: per build and group, min / median ms, GB/s, and the first build's min over this one's."""
    names = list(result["builds"])
    base = result["builds"][names[0]]
    load = result["load"]
    head = f"{result['threads']} thread(s), {result['rounds']} rounds alternated"
    lines = [
        f"{head}, load average {load[0]:.2f} -> {load[-1]:.2f}",
        f"{'build':<12} {'group':<7} {'min ms':>8} {'median ms':>10} {'GB/s':>6} {'speed':>6}",
    ]
    for name in names:
        for group, r in result["builds"][name].items():
            lines.append(
                f"{name:<12} {group:<7} {r['min_ms']:>8.2f} {r['median_ms']:>10.2f} {r['gbps']:>6.1f} "
                f"{base[group]['min_ms'] / r['min_ms']:>5.2f}x"
            )
    return "\n".join(lines)
