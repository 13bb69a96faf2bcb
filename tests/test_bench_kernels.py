"""scripts/bench-kernels: several builds of the kernels timed side by side in one process on
a GGUF file's matrices, their products checked against the first build's."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import needs_kernels

from chatbot.engine.backends.native import build as kernel_build
from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf

ROOT = Path(__file__).resolve().parents[1]
# The tile products' last step (csrc/tiles.c, AVX2 and AVX-512): the sums less the mins
TILE_CLOSE = "_mm256_storeu_ps(out, _mm256_sub_ps(acc, accm));"

pytestmark = [
    needs_kernels,
    pytest.mark.skipif(
        platform.machine().lower() not in ("x86_64", "amd64"), reason="the tile products are x86"
    ),
]


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf"
    write_synthetic_gguf(path, "qwen2", SHAPES["qwen2"]["tiny"], "Q4_K_M", seed=3)
    return path


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # -O1: the builds compile in a fraction of the time; the figures are not what is tested
    return subprocess.run(
        [str(ROOT / "scripts" / "bench-kernels"), *args, "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), **(env or {})},
    )


def _broken_copy(folder: Path) -> Path:
    """The kernels' source in one file (`source_text`), with the tile products adding the mins
    where they subtract them."""
    text = kernel_build.source_text()
    macros = subprocess.run(
        ["cc", "-march=native", "-dM", "-E", "-x", "c", "/dev/null"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    if "__AVX2__" not in macros or TILE_CLOSE not in text:
        pytest.skip("no AVX2 tile products here")
    broken = folder / "kernels_broken.c"
    broken.write_text(text.replace(TILE_CLOSE, TILE_CLOSE.replace("_sub_ps", "_add_ps")))
    return broken


def test_two_builds_take_turns_and_the_first_is_the_yardstick(q4_k_m, tmp_path):
    broken = _broken_copy(tmp_path)
    args = ["--build", "ours=-O1", "--build", "copy=-O1", "--source", f"copy={broken}", "--no-check"]
    done = _bench(str(q4_k_m), *args, "--acts", "int16,int8")
    assert done.returncode == 0, done.stderr
    rows = re.findall(
        r"^((?:ours|copy)/int(?:16|8))\s+(hot|layers|output)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$",
        done.stdout,
        re.MULTILINE,
    )
    names = ("ours/int16", "ours/int8", "copy/int16", "copy/int8")
    assert [(r[0], r[1]) for r in rows] == [(b, g) for b in names for g in ("hot", "layers", "output")]
    for build, _, low, median, gbps, speed in rows:
        assert 0 < float(low) <= float(median) and float(gbps) > 0
        if build == "ours/int16":
            assert speed == "1.00"
    assert "2 rounds alternated, load average" in done.stdout
    assert _bench(str(q4_k_m), "--acts", "int4").stderr.strip() == (
        "error: --acts takes int16, int8 or int16,int8, got 'int4'"
    )


def test_a_build_whose_products_differ_is_refused_in_one_line(q4_k_m, tmp_path):
    broken = _broken_copy(tmp_path)
    done = _bench(str(q4_k_m), "--build", "ours=-O1", "--build", "copy=-O1", "--source", f"copy={broken}")
    assert done.returncode == 1
    assert done.stderr.strip() == "error: build 'copy': its products differ from those of build 'ours'"
    assert done.stdout == ""


def test_a_file_that_is_not_a_model_is_one_line(tmp_path):
    bad = tmp_path / "empty.gguf"
    bad.write_bytes(b"GGUF")
    done = _bench(str(bad), "--build", "ours=-O1")
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1


def _compiler(folder: Path, name: str, refuse: str) -> str:
    """A `cc` that fails (saying "no omp.h") when an argument matches the shell pattern `refuse`."""
    fake = folder / name
    fake.write_text(
        f'#!/bin/sh\nfor a in "$@"; do case "$a" in {refuse}) echo "no omp.h" >&2; exit 1;; esac; done\n'
        'exec cc "$@"\n'
    )
    fake.chmod(0o755)
    return str(fake)


def test_a_compiler_without_openmp_builds_on_the_own_pool(q4_k_m, tmp_path):
    """As the cache does for clang without libomp: the build without -fopenmp (-pthread)."""
    no_omp = _compiler(tmp_path, "cc-no-omp", "-fopenmp")
    done = _bench(str(q4_k_m), "--build", "ours=-O1", env={"CC": no_omp})
    assert done.returncode == 0, done.stderr
    assert re.search(r"^ours\s+layers\s+[\d.]+", done.stdout, re.MULTILINE), done.stdout
    broken = _compiler(tmp_path, "cc-broken", "*")  # fails every build: the error, one line
    done = _bench(str(q4_k_m), "--build", "ours=-O1", env={"CC": broken, "XDG_CACHE_HOME": str(tmp_path)})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: ") and "no omp.h" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
