"""`chatbot doctor`: what the machine gives the chatbot, and the decode path a model takes,
checked against the machine itself (its compiler, /proc/cpuinfo) and against what a chat on
the same model does."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_model, make_tokenizer, write_tiny_gguf


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`chatbot doctor` on the machine as it is: kernel flags only where a test gives them (a
    suite run with CHATBOT_KERNEL_FLAGS=-mno-avx512f, as for the AVX2 figures, keeps the
    native build these tests compare against)."""
    base = {k: v for k, v in os.environ.items() if k != "CHATBOT_KERNEL_FLAGS"}
    return subprocess.run(
        [sys.executable, "-m", "chatbot.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, **(env or {})},
        check=False,
    )


def fields(out: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    tok = make_tokenizer()
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, make_model(len(tok)), tok)
    return path


def test_the_machine_and_a_native_decode_path(tiny, tmp_path):
    done = doctor("--model", str(tiny), env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    got = fields(done.stdout)
    assert {"chatbot", "platform", "cpu", "compiler", "simd", "kernels", "gpu", "model", "decode"} <= set(got)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512bw " in flags and " avx512vl " in flags:
        assert got["simd"].startswith("AVX-512")
    elif " avx2 " in flags:
        assert got["simd"].startswith("AVX2")
    assert "with OpenMP" in got["compiler"]
    assert got["threads"] == "OpenMP"
    assert str(tmp_path / "cache" / "chatbot" / "kernels") in got["kernels"]
    assert got["kernels"].endswith("(built)")  # loading the model built them
    assert [line for line in done.stdout.splitlines() if line.startswith("decode: ")] == [
        "decode: " + got["decode"]
    ]
    assert got["decode"].startswith("native (--opt auto): ")
    off = fields(doctor("--model", str(tiny), "--opt", "off").stdout)
    assert off["decode"] == "transformers (--opt off)"


def test_no_compiler_says_transformers_and_why(tiny, tmp_path):
    done = doctor("--model", str(tiny), env={"PATH": "", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    got = fields(done.stdout)
    assert got["compiler"].startswith("none found")
    assert got["kernels"].endswith("(not built yet)")
    assert got["decode"].startswith("transformers (no C compiler found")


def test_a_compiler_without_openmp_decodes_natively_on_the_own_pool(tiny, tmp_path):
    """As Apple's clang or Debian's clang without libomp: -fopenmp fails, so the kernels are
    built without it and run on their own thread pool; the doctor names both."""
    fake = tmp_path / "cc-no-omp"
    refuse = 'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "no omp.h" >&2; exit 1; }; done'
    fake.write_text(f'#!/bin/sh\n{refuse}\nexec cc "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"CC": str(fake), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = doctor("--no-load", env=env)
    assert done.returncode == 0, done.stderr
    got = fields(done.stdout)
    assert str(fake) in got["compiler"] and "without OpenMP" in got["compiler"]
    assert got["threads"].startswith("own pool")
    assert got["kernels"].endswith("(not built yet)")
    assert "model" not in got and "decode" not in got
    done = doctor("--model", str(tiny), env=env)
    assert done.returncode == 0, done.stderr
    loaded = fields(done.stdout)
    assert loaded["decode"].startswith("native (--opt auto): ") and loaded["decode"].endswith("(own pool)")
    assert loaded["threads"].startswith("own pool")
    assert loaded["kernels"] == got["kernels"].replace("(not built yet)", "(built)")


def test_clang_as_installed(tiny, tmp_path):
    """`CC=clang chatbot doctor` (Debian's clang has no libomp unless libomp-dev is
    installed): a native decode path either way, on the pool where -fopenmp fails."""
    if shutil.which("clang") is None:
        pytest.skip("clang is not installed")
    done = doctor("--model", str(tiny), env={"CC": "clang", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    got = fields(done.stdout)
    assert "clang" in got["compiler"]
    assert got["decode"].startswith("native (--opt auto): ")
    if "without OpenMP" in got["compiler"]:
        assert got["threads"].startswith("own pool") and got["decode"].endswith("(own pool)")
    else:
        assert got["threads"] == "OpenMP" and not got["decode"].endswith("(own pool)")


def test_kernel_flags_from_the_environment_pick_another_build(tiny, tmp_path):
    """CHATBOT_KERNEL_FLAGS=-mno-avx512f builds the kernels an AVX2 CPU runs (its own
    library in the cache); flags the compiler refuses leave the chat on transformers, said
    in one line."""
    if " avx2 " not in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""):
        pytest.skip("needs an x86 CPU with AVX2")
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    plain = fields(doctor("--model", str(tiny), env=cache).stdout)
    avx2 = doctor("--model", str(tiny), env={**cache, "CHATBOT_KERNEL_FLAGS": "-mno-avx512f"})
    assert avx2.returncode == 0, avx2.stderr
    got = fields(avx2.stdout)
    assert got["simd"] == "AVX2 (what -march=native -mno-avx512f gives the kernels here)"
    assert got["kernels"].endswith("(built)") and got["kernels"] != plain["kernels"]
    assert got["decode"].startswith("native (--opt auto): ")
    bad = doctor("--model", str(tiny), env={**cache, "CHATBOT_KERNEL_FLAGS": "-mno-such-flag"})
    assert bad.returncode == 0, bad.stderr
    assert fields(bad.stdout)["decode"].startswith("transformers (")
    assert "Traceback" not in bad.stdout + bad.stderr
