"""Every ggml weight format the kernels read, against the `gguf` package's reference
dequantization (`gguf.quants.dequantize`, a numpy transcription of ggml) on random valid
blocks; the matrix-vector products against float64 products of that reference."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from helpers import needs_kernels

from chatbot.engine.backends.native import kernels
from devtools.gguf_synthetic import BLOCKS, FLOAT_TYPES, random_blocks, random_floats

pytestmark = needs_kernels

FORMATS = [*BLOCKS, *FLOAT_TYPES]
ROWS, COLS = 24, 512  # two K-quant super-blocks, sixteen 32-blocks per row


def random_matrix(
    kind: str, seed: int, rows: int = ROWS, cols: int = COLS
) -> tuple[torch.Tensor, np.ndarray]:
    """(the kernel's bytes or float32 values, the reference float32 weights [rows, cols])."""
    rng = np.random.default_rng(seed)
    if kind in BLOCKS:
        raw = random_blocks(kind, rows * cols, rng, scale=0.5).reshape(rows, -1)
    else:
        raw = random_floats(kind, (rows, cols), rng)
    if kind == "BF16":
        ref = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        ref = dequantize(raw.view(np.uint8) if kind in BLOCKS else raw, GGMLQuantizationType[kind])
    data = torch.from_numpy(raw.view(np.uint8) if kind != "F32" else raw).reshape(rows, -1)
    return data, np.asarray(ref, dtype=np.float32).reshape(rows, cols)


@pytest.mark.parametrize("kind", FORMATS)
def test_dequantization_equals_ggml(kind):
    data, ref = random_matrix(kind, seed=1)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    packed = kernels.from_raw(data, kernels.GGUF_FORMATS[kind], ROWS, COLS)
    got = kernels.unpack(packed).numpy()
    # the same float32 operations in the same order as the reference: equal, or within one
    # rounding where numpy and C group a product differently
    np.testing.assert_allclose(got, ref, rtol=2e-7, atol=1e-9)


@pytest.mark.parametrize("kind", BLOCKS)
def test_random_blocks_hold_weights_of_about_the_scale(kind):
    """The synthetic writer's blocks (`scripts/make-synthetic-gguf`) read back by gguf-py as
    finite weights within about +-scale: MXFP4's E8M0 scale byte set from the scale like the
    others' float16 ones, not left random (2^-127 .. 2^127)."""
    for scale in (0.1, 1e-3):
        raw = random_blocks(kind, 256 * 64, np.random.default_rng(8), scale=scale)
        w = dequantize(raw, GGMLQuantizationType[kind])
        assert np.isfinite(w).all()
        assert 0.5 * scale < np.abs(w).max() <= 1.1 * scale, kind


def mxfp4_edge_blocks() -> np.ndarray:
    """MXFP4 blocks of every E8M0 scale byte, 0 to 255, each with all 16 codes twice (in
    both nibbles): the subnormal scales (e = 0, 1: 2^-128, 2^-127), 1 (e = 127), and the top
    ones whose large codes overflow float32 to infinity in ggml's reading (2^127 x 6), with
    no NaN (code 0 times any scale is 0)."""
    codes = np.arange(16, dtype=np.uint8)
    qs = codes | np.roll(codes, 5) << np.uint8(4)
    blocks = np.zeros((256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = qs
    return blocks


def test_mxfp4_dequantization_is_ggmls_at_every_scale():
    """Bit for bit as gguf-py dequantizes it (ggml's doubled codes and halved scale)."""
    blocks = mxfp4_edge_blocks()
    with np.errstate(over="ignore"):
        ref = np.asarray(dequantize(blocks, GGMLQuantizationType.MXFP4), dtype=np.float32).reshape(256, 32)
    assert not np.isnan(ref).any() and np.isinf(ref).any()
    assert ref[127].max() == 6.0 and ref[0][ref[0] > 0].min() == 2.0**-128
    packed = kernels.from_raw(torch.from_numpy(blocks), kernels.FMT_MXFP4, 256, 32)
    got = kernels.unpack(packed).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


INT16_FORMATS = {"Q8_0", "Q4_1", "Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"}


K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}


def int16_activations(x: np.ndarray, block: int = 32, top: int = 32767) -> np.ndarray:
    """x as the kernels hold it for `--opt auto`'s integer products: per block (32 values, or
    a K-quant super-block of 256), a float32 scale absmax / 32767 and int16 values (round half
    to even, as nearbyintf). `top=127`: the int8 values of `--opt fast` (ACT_Q8)."""
    b = x.reshape(-1, block).astype(np.float32)
    d = (np.abs(b).max(axis=1, keepdims=True) / np.float32(top)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * d).reshape(-1)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("act", [kernels.ACT_F32, kernels.ACT_I16, kernels.ACT_Q8])
def test_matvec_equals_float64_product_of_reference(kind, act):
    """ACT_I16 is the activation form `--opt auto` uses: the block formats with an int16
    product must equal the exact product with the int16-rounded activations; the others
    take float32 activations and must equal the exact product with x itself. ACT_Q8 (`--opt
    fast`): the same block formats take int8-rounded activations."""
    data, ref = random_matrix(kind, seed=2)
    packed = kernels.from_raw(data, kernels.GGUF_FORMATS[kind], ROWS, COLS)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal(COLS).astype(np.float32))
    block = 256 if kind in K_QUANTS else 32
    integer = act in (kernels.ACT_I16, kernels.ACT_Q8) and kind in INT16_FORMATS
    top = 127 if act == kernels.ACT_Q8 else 32767
    xs = int16_activations(x.numpy(), block, top) if integer else x.numpy()
    exact = ref.astype(np.float64) @ xs.astype(np.float64)
    bound = np.abs(ref).astype(np.float64) @ np.abs(xs).astype(np.float64)
    for threads in (1, 2):
        got = kernels.matvec(packed, x, threads, act=act).numpy()
        assert np.all(np.abs(got - exact) <= 2e-6 * bound + 1e-6), kind
    if integer:  # and it is not the float32 product
        assert not np.allclose(
            kernels.matvec(packed, x, 1, act=act).numpy(),
            ref.astype(np.float64) @ x.numpy(),
            rtol=0,
            atol=1e-7,
        )


def test_byte_sizes_are_ggml_block_sizes():
    from gguf import GGML_QUANT_SIZES

    for kind, fmt in kernels.GGUF_FORMATS.items():
        assert kernels.BLOCK_SHAPES[fmt] == GGML_QUANT_SIZES[GGMLQuantizationType[kind]]


def test_from_raw_refuses_wrong_sizes():
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.from_raw(torch.zeros(4, 144, dtype=torch.uint8), kernels.FMT_Q4_K, 4, 200)
    with pytest.raises(ValueError, match="takes"):
        kernels.from_raw(torch.zeros(4, 100, dtype=torch.uint8), kernels.FMT_Q4_K, 4, 256)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


BUILDS = {
    # the portable C: what a CPU without AVX2, or another architecture, runs (float32 inputs)
    "scalar": (["-O2"], [kernels.ACT_F32]),
    # this CPU without AVX-512 (a Zen 3 or an older Xeon): the 256-bit integer products
    "avx2": (["-O3", "-march=native", "-mno-avx512f"], [kernels.ACT_F32, kernels.ACT_I16]),
    # and without AVX-VNNI (Zen 3, Skylake), where this CPU has it: the batched product's
    # step is asm of its own for each (vpmaddwd + vpaddd, or vpdpwssd)
    "avx2-no-vnni": (
        ["-O3", "-march=native", "-mno-avx512f", "-mno-avxvnni"],
        [kernels.ACT_F32, kernels.ACT_I16],
    ),
}


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_other_builds_match_reference(tmp_path, build):
    """The library as other CPUs build it, against the reference; the tests above check the
    build for this CPU."""
    cc = kernels.find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    if build.startswith("avx2") and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if build == "avx2-no-vnni" and "avx_vnni" not in _cpu_flags():
        pytest.skip("this CPU has no AVX-VNNI: the avx2 build is this one")
    extra, acts = BUILDS[build]
    lib_path = tmp_path / f"{build}.so"
    # threads as this machine's own build runs them: OpenMP, or the kernels' own pool where the
    # compiler has no OpenMP (clang without libomp)
    threads = "-fopenmp" if kernels.uses_openmp(kernels.load_library()) else "-pthread"
    flags = [*extra, threads, "-shared", "-fPIC", "-std=c11"]
    subprocess.run([cc, *flags, "-o", str(lib_path), str(kernels.SOURCE), "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.chatbot_matvec_scratch.restype = ctypes.c_long
    x = torch.from_numpy(np.random.default_rng(4).standard_normal(COLS).astype(np.float32))
    for kind in FORMATS:
        data, ref = random_matrix(kind, seed=5)
        mat = kernels.from_raw(data, kernels.GGUF_FORMATS[kind], ROWS, COLS).as_struct()
        out = torch.empty(ROWS, COLS)
        lib.chatbot_dequantize(ctypes.byref(mat), ctypes.c_void_p(out.data_ptr()), 1)
        np.testing.assert_allclose(out.numpy(), ref, rtol=2e-7, atol=1e-9, err_msg=kind)
        for act in acts:
            int16 = act == kernels.ACT_I16 and kind in INT16_FORMATS
            xs = int16_activations(x.numpy(), 256 if kind in K_QUANTS else 32) if int16 else x.numpy()
            y = torch.empty(ROWS)
            scratch = torch.empty(lib.chatbot_matvec_scratch(COLS))
            lib.chatbot_matvec(
                ctypes.byref(mat), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(scratch.data_ptr()),
                ctypes.c_void_p(y.data_ptr()), 1, act,
            )  # fmt: skip
            exact = ref.astype(np.float64) @ xs.astype(np.float64)
            bound = np.abs(ref).astype(np.float64) @ np.abs(xs).astype(np.float64)
            assert np.all(np.abs(y.numpy() - exact) <= 2e-6 * bound + 1e-6), (kind, act)
        # the batched product of prefill (`--opt auto`): 256-bit on AVX2, none in portable C;
        # 37 rows and 13 inputs leave part-filled groups of rows and of inputs
        xb = np.random.default_rng(7).standard_normal((13, COLS)).astype(np.float32)
        xb[3] *= 100.0
        xb[5] = 0.0
        rows = 37
        data, ref = random_matrix(kind, seed=6, rows=rows)
        mat = kernels.from_raw(data, kernels.GGUF_FORMATS[kind], rows, COLS).as_struct()
        yb = np.full((13, rows), np.nan, dtype=np.float32)
        for threads in (1, 2):
            rc = lib.chatbot_matmul(
                ctypes.byref(mat),
                ctypes.c_void_p(xb.ctypes.data),
                13,
                ctypes.c_void_p(yb.ctypes.data),
                threads,
            )
            if build == "scalar" or kind not in BATCHED:
                assert rc == -1 and np.isnan(yb).all(), kind
                break
            assert rc == 0, kind
            assert_batched_product(yb, xb, ref, kind)


def unit_activations(x: np.ndarray, kind: str) -> np.ndarray:
    """x as the batched int16 product holds it: int16 per unit of values sharing one weight
    scale (16 for Q6_K, else 32)."""
    return int16_activations(x, 16 if kind == "Q6_K" else 32)


BATCHED = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"}


@pytest.mark.parametrize("kind", FORMATS)
def test_batched_int16_product_equals_float64_reference(kind):
    """The prefill product of `--opt auto` (`matmul_i16`): for every input, the exact product
    of the reference weights with that input rounded to int16 per unit. Rows not a multiple of
    16 and inputs not a multiple of 8 check the padded tails. Formats without it say so (None)."""
    rows = 37
    data, ref = random_matrix(kind, seed=6, rows=rows)
    packed = kernels.from_raw(data, kernels.GGUF_FORMATS[kind], rows, COLS)
    x = np.random.default_rng(7).standard_normal((13, COLS)).astype(np.float32)
    x[3] *= 100.0  # inputs of very different sizes: each has its own scales
    x[5] = 0.0
    got = kernels.matmul_i16(packed, torch.from_numpy(x), threads=2)
    if got is None:  # (AVX2 and AVX-512 have it; the portable C has not)
        assert kind not in BATCHED or not {"avx2", "fma", "f16c"} <= _cpu_flags()
        return
    assert kind in BATCHED
    assert_batched_product(got.numpy(), x, ref, kind)


def assert_batched_product(got: np.ndarray, x: np.ndarray, ref: np.ndarray, kind: str) -> None:
    """got = the exact product of the weights ref with each input of x rounded to int16 per
    unit, not the float32 product; x[5] = 0 gives zeros."""
    xs = np.stack([unit_activations(v, kind) for v in x])
    exact = xs.astype(np.float64) @ ref.astype(np.float64).T
    bound = np.abs(xs).astype(np.float64) @ np.abs(ref).astype(np.float64).T
    assert np.all(np.abs(got - exact) <= 2e-6 * bound + 1e-6), kind
    assert np.all(got[5] == 0.0)
    # and not the float32 product: the int16 rounding is there
    assert not np.allclose(got, x.astype(np.float64) @ ref.astype(np.float64).T, rtol=0, atol=1e-7)


def test_an_mxfp4_tensor_of_a_gguf_file_reads_as_stored(tmp_path):
    """gpt-oss's expert tensors: an MXFP4 matrix in a GGUF file, on the file's map, reads as
    gguf-py dequantizes it."""
    import gguf

    raw = random_blocks("MXFP4", 8 * 64, np.random.default_rng(9), scale=0.1).reshape(8, -1)
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_tensor("experts", raw, raw_dtype=GGMLQuantizationType.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    packed = kernels.from_gguf(gguf.GGUFReader(tmp_path / "m.gguf").tensors[0])
    assert (packed.fmt, packed.rows, packed.cols) == (kernels.FMT_MXFP4, 8, 64)
    ref = dequantize(raw, GGMLQuantizationType.MXFP4).reshape(8, 64)
    np.testing.assert_array_equal(kernels.unpack(packed).numpy(), ref)
