"""scripts/test-arm: the NEON kernels, cross-compiled for aarch64 and run under qemu-user,
against this machine's outputs for every format's products and whole decode steps (issue
24). Skipped where the cross tools are not installed (the script itself would install them
as root; a test does not)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import needs_kernels

from chatbot.doctor import Compiler
from chatbot.engine.backends.native import kernels

ROOT = Path(__file__).resolve().parents[1]
SYSROOT = Path("/usr/aarch64-linux-gnu")


def test_arch_flags_per_machine():
    """-march=native on x86; on 64-bit ARM -mcpu=native (GCC and clang on Linux), and a named
    Apple core for Apple's clang; the library is built with them."""
    assert kernels.arch_flags("x86_64", "Linux") == ["-march=native"]
    assert kernels.arch_flags("aarch64", "Linux") == ["-mcpu=native"]
    assert kernels.arch_flags("arm64", "Darwin") == ["-mcpu=apple-m1"]
    assert kernels.FLAGS[1:2] == kernels.arch_flags()


def test_doctor_names_the_neon_levels():
    arm = {"__aarch64__", "__ARM_NEON"}
    assert Compiler("gcc", macros=arm | {"__ARM_FEATURE_DOTPROD"}).simd == "NEON + dotprod"
    assert Compiler("gcc", macros=arm).simd == "NEON"
    assert Compiler("gcc", macros={"__ARM_NEON", "__arm__"}).simd.startswith("none")


def _qemu() -> str | None:
    return shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


def _missing() -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the reference outputs are x86's; this is {platform.machine()}"
    if not shutil.which("aarch64-linux-gnu-gcc") or not (SYSROOT / "lib" / "libc.a").exists():
        return "no aarch64 cross compiler (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross)"
    if not _qemu():
        return "no qemu-aarch64 (apt-get install qemu-user)"
    return None


def _driver(work: Path, arch: str) -> subprocess.CompletedProcess[str]:
    qemu = _qemu()
    assert qemu
    args = [qemu, "-L", str(SYSROOT), str(work / f"driver-{arch}"), str(work / "reference")]
    return subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)


@needs_kernels
@pytest.mark.slow  # about a minute; decodes the default model
def test_neon_kernels_agree_with_x86_under_qemu(tmp_path):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "test-arm"), "--keep", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # both NEON levels ran their code, every check of each agreed
    assert "NEON, with the int8 dot products (sdot)" in out
    assert "NEON, without the int8 dot products" in out
    # the two NEON levels with OpenMP, and the first again on the kernels' own thread pool
    assert out.count("47 checks: 47 agree, 0 FAILED") == 3, out
    assert "without OpenMP: the kernels' own thread pool" in out
    for name in ("q4_k_i16", "q6_k_i16", "q5_1_i16", "q8_0_q8", "bf16_f32", "mxfp4_q8", "mxfp4_i16"):
        assert out.count(f"ok     product {name} ") == 3, name
    assert out.count("ok     decode  decode_smollm2_q4_1_exact") == 3
    assert out.rstrip().endswith("test-arm: all checks agree")

    # and it can fail: x86 outputs moved by less than a wrong product would move them
    ref = tmp_path / "reference"
    bound = np.fromfile(ref / "q4_k_i16.bound")
    y = np.fromfile(ref / "q4_k_i16.y", dtype=np.float32)
    y[7] += np.float32(1e-4 * bound[7])
    y.tofile(ref / "q4_k_i16.y")
    logits = np.fromfile(ref / "decode_llama_mixed_i16.logits", dtype=np.float32)
    logits[3] += np.float32(0.1 * np.abs(logits).max())
    logits.tofile(ref / "decode_llama_mixed_i16.logits")
    failed = _driver(tmp_path, "armv8-a")
    assert failed.returncode == 1
    lines = [ln for ln in failed.stdout.splitlines() if ln.startswith("FAILED")]
    assert len(lines) == 2, failed.stdout
    assert "product q4_k_i16" in lines[0] and "decode_llama_mixed_i16" in lines[1]
    assert "47 checks: 45 agree, 2 FAILED" in failed.stdout
