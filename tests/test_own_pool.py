"""The kernels built without OpenMP, on their own thread pool (csrc/pool.c; as clang without
libomp builds them, Apple's among others): the same bits as the OpenMP build, at any thread
count.

The builds are made here, into the module's folder: with the C compiler the kernels use
(gcc on CI, so the pool is always tested, by leaving out -fopenmp), and with clang where it
is installed. Each is loaded beside the OpenMP build, and `kernels._library` is pointed at
the one under test, so that the decoder, the products and the packing all run on it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.decoder import FastDecoder

PROMPT = [5, 17, 42, 99, 7, 250, 31, 8, 64, 3, 120, 77]


def _build(folder: Path, cc: str, openmp: bool) -> ctypes.CDLL:
    path = folder / f"{Path(cc).name}-{'openmp' if openmp else 'pool'}.so"
    kernels.build(cc, path, openmp=openmp)
    return kernels.open_library(path)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """{"openmp": the OpenMP build, "pool": the same compiler's build without OpenMP}."""
    cc = kernels.find_compiler()
    if cc is None:
        pytest.skip("needs a C compiler to build the kernels")
    folder = tmp_path_factory.mktemp("builds")
    try:
        openmp = _build(folder, cc, True)
    except kernels.KernelsUnavailable as exc:
        pytest.skip(f"needs a compiler with OpenMP for the reference build: {exc}")
    return {"openmp": openmp, "pool": _build(folder, cc, False)}


@pytest.fixture(scope="module")
def clang_build(tmp_path_factory) -> ctypes.CDLL:
    """clang's build without OpenMP (-fopenmp left out whether or not it has libomp)."""
    if shutil.which("clang") is None:
        pytest.skip(
            "clang is not installed: the build without OpenMP is tested with the default compiler only"
        )
    return _build(tmp_path_factory.mktemp("clang"), "clang", False)


def _using(monkeypatch, lib: ctypes.CDLL) -> None:
    monkeypatch.setattr(kernels, "_library", lib)


def greedy_logits(model, lib, threads: list[int], n: int, monkeypatch, level: str = "auto") -> torch.Tensor:
    """The logits of `n` greedy steps after PROMPT on `lib`, decoding step i on
    threads[i % len(threads)] threads ([n, vocab])."""
    _using(monkeypatch, lib)
    decoder = FastDecoder(model, level, threads=threads[0])
    assert decoder.lib is lib
    cache = decoder.new_cache()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True).logits[0, -1]
    steps = []
    for i in range(n):
        decoder.threads = threads[i % len(threads)]
        logits = decoder.decode(cache, int(torch.argmax(logits)))
        steps.append(logits.clone())
    return torch.stack(steps)


def test_each_build_says_how_it_runs_its_threads(builds):
    assert kernels.uses_openmp(builds["openmp"]) is True
    assert kernels.uses_openmp(builds["pool"]) is False


@pytest.mark.parametrize("threads", [1, 2])
def test_the_default_model_decodes_the_same_bits_on_the_pool(builds, default_model, threads, monkeypatch):
    """SmolLM2-135M's Q4_1 file, int16 activations (what a chat runs): every logit of 24
    greedy steps equal between the builds."""
    model = default_model.model
    ref = greedy_logits(model, builds["openmp"], [threads], 24, monkeypatch)
    got = greedy_logits(model, builds["pool"], [threads], 24, monkeypatch)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("level", ["f32", "int8", "int4"])
def test_thread_counts_above_the_cpus_and_changing_between_calls(builds, tiny_model, level, monkeypatch):
    """More threads than CPUs, and a different count at every step (the pool starts the
    threads it lacks and leaves the others waiting): the one-thread OpenMP logits."""
    many = (os.cpu_count() or 1) + 2
    ref = greedy_logits(tiny_model, builds["openmp"], [1], 16, monkeypatch, level)
    got = greedy_logits(tiny_model, builds["pool"], [2, many, 1, 3, many + 3, 2], 16, monkeypatch, level)
    assert torch.equal(got, ref)


def test_batched_decode_and_the_other_parallel_calls_match(builds, tiny_model, monkeypatch):
    """decode_batch, the batched int16 product (prefill), dequantizing and quantizing on two
    threads: the same bits from both builds."""
    import numpy as np

    from devtools.gguf_synthetic import random_blocks

    rows, cols = 80, 512
    raw = random_blocks("Q4_K", rows * cols, np.random.default_rng(0), scale=0.5).reshape(rows, -1)
    q4k = kernels.from_raw(
        torch.from_numpy(raw.view(np.uint8)).reshape(rows, -1), kernels.FMT_Q4_K, rows, cols
    )
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(1))
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(2))

    def outputs(lib: ctypes.CDLL) -> list[torch.Tensor | None]:
        _using(monkeypatch, lib)
        decoder = FastDecoder(tiny_model, "int4", threads=2)
        caches = [decoder.new_cache() for _ in range(3)]
        with torch.inference_mode():
            for i, cache in enumerate(caches):
                tiny_model(input_ids=torch.tensor([PROMPT[: 4 + 3 * i]]), cache=cache, use_cache=True)
        batch = [decoder.decode_batch(caches, [11, 12, 13]) for _ in range(4)]
        packed = torch.empty(96, 256 // kernels.QK * 34, dtype=torch.uint8)
        stats = torch.zeros(2)
        lib.chatbot_quantize(w.data_ptr(), 96, 256, kernels.FMT_Q8_0, packed.data_ptr(), 2, stats.data_ptr())
        return [
            torch.stack(batch),
            kernels.matmul_i16(q4k, x, 2),
            kernels.matmul_x8(kernels.tile_rows(q4k), x, 2),  # int8 inputs into 8-row tiles
            kernels.unpack(q4k, 2),
            kernels.matvec(q4k, x[0], 2, kernels.ACT_I16),
            packed,
            stats,
        ]

    ref, got = outputs(builds["openmp"]), outputs(builds["pool"])
    for a, b in zip(ref, got, strict=True):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
    assert ref[-1][0] > 0 and ref[-1][1] == w.abs().max()  # the reductions reached every row


def test_two_python_threads_decode_at_once_on_the_pool(builds, tiny_model, monkeypatch):
    """Two conversations decoded at the same moment (ctypes lets go of the GIL), each on two
    kernel threads: one team at a time, each answer as when decoded alone."""
    alone = greedy_logits(tiny_model, builds["pool"], [2], 12, monkeypatch, "int8")
    results: dict[int, torch.Tensor] = {}
    decoders = [FastDecoder(tiny_model, "int8", threads=2) for _ in range(2)]  # on the pool build

    def converse(i: int) -> None:
        cache = decoders[i].new_cache()
        with torch.inference_mode():
            logits = tiny_model(input_ids=torch.tensor([PROMPT]), cache=cache, use_cache=True).logits[0, -1]
            steps = []
            for _ in range(12):
                logits = decoders[i].decode(cache, int(torch.argmax(logits)))
                steps.append(logits.clone())
        results[i] = torch.stack(steps)

    runs = [threading.Thread(target=converse, args=(i,)) for i in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=120)
    assert not any(run.is_alive() for run in runs)
    assert torch.equal(results[0], alone) and torch.equal(results[1], alone)


def test_a_forked_child_runs_its_own_pool(builds, tmp_path):
    """A fork copies only the thread that forks: the child starts workers of its own, and
    a product on two threads neither hangs nor differs from the parent's."""
    lib_path = builds["pool"]._name
    script = f"""
import ctypes, os, sys
import torch
from chatbot.engine.backends.native import kernels
lib = kernels.open_library({str(lib_path)!r})
p = kernels.pack_f32(torch.randn(300, 64, generator=torch.Generator().manual_seed(0)))
x = torch.randn(64)
kernels._library = lib
before = kernels.matvec(p, x, 2)
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(60)
    os._exit(0 if torch.equal(kernels.matvec(p, x, 2), before) else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0"]


@pytest.mark.parametrize("threads", [1, 2])
def test_clang_without_openmp_decodes_like_gcc_with_it(builds, clang_build, tiny_model, threads, monkeypatch):
    """Another compiler rounds differently (it contracts other products into FMAs), so not the
    same bits: the same greedy tokens and logits within float tolerance."""
    assert kernels.uses_openmp(clang_build) is False
    ref = greedy_logits(tiny_model, builds["openmp"], [threads], 16, monkeypatch, "int4")
    got = greedy_logits(tiny_model, clang_build, [threads, threads + 1], 16, monkeypatch, "int4")
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert torch.allclose(got, ref, atol=1e-3, rtol=1e-4)


def _compiler_without_openmp(folder: Path) -> tuple[Path, Path]:
    """A compiler that refuses -fopenmp, as clang without libomp does, and logs its calls."""
    cc, log = folder / "cc-no-omp", folder / "calls"
    real = kernels.find_compiler()
    refuse = 'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "omp.h: not found" >&2; exit 1; }; done'
    cc.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n{refuse}\nexec {real} "$@"\n')
    cc.chmod(0o755)
    return cc, log


def test_a_compiler_without_openmp_builds_and_keeps_the_pool_build(builds, tmp_path, monkeypatch):
    """load_library: the OpenMP build fails, so the kernels are built without it, under a name
    of their own; the next start loads that build at once (no compiler run but --version)."""
    cc, log = _compiler_without_openmp(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for start in range(2):
        monkeypatch.setattr(kernels, "_library", None)
        monkeypatch.setattr(kernels, "_failure", None)
        lib = kernels.load_library()
        assert kernels.uses_openmp(lib) is False
        calls = log.read_text().splitlines()
        builds_run = [c for c in calls if "-shared" in c]
        assert len(builds_run) == (2 if start == 0 else 0), calls  # with OpenMP, then without
        log.write_text("")
    pool = kernels.library_path(str(cc), openmp=False)
    assert pool != kernels.library_path(str(cc))
    assert sorted(p.name for p in pool.parent.iterdir()) == sorted(
        [".lock", pool.name, f"{pool.name}.sha256"]
    )
