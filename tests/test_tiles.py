"""Q4_K and Q6_K matrices in tiles of 8 rows (`kernels.tile_rows`, csrc/tiles.c):
the same weights as the rows they came from, and products equal to the float64 product of
ggml's reference weights with the int16-rounded inputs, on this CPU's build and on its AVX2
build; down to a whole decode step (the synthetic-file tests decode through tiles too)."""

from __future__ import annotations

import ctypes
import itertools
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from helpers import needs_kernels
from test_ggml_formats import _cpu_flags, int16_activations, random_matrix

from chatbot.engine.backends.native import kernels
from chatbot.engine.backends.native.packed import packed_matmul

pytestmark = needs_kernels

KINDS = ["Q4_K", "Q6_K"]


def tiled_pair(kind: str, seed: int, rows: int = 24, cols: int = 768):
    data, ref = random_matrix(kind, seed, rows, cols)
    plain = kernels.from_raw(data, kernels.GGUF_FORMATS[kind], rows, cols)
    tiles = kernels.tile_rows(plain)
    if not tiles.x8:
        pytest.skip("no tile kernels on this CPU (AVX2 and up)")
    return plain, tiles, ref


def check_product(got: np.ndarray, ref: np.ndarray, x: np.ndarray) -> None:
    """got == ref @ x up to float32 rounding of sub-totals (x: the inputs as the kernels hold them)"""
    exact = ref.astype(np.float64) @ x.astype(np.float64)
    bound = np.abs(ref).astype(np.float64) @ np.abs(x).astype(np.float64)
    assert np.all(np.abs(got - exact) <= 2e-6 * bound + 1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_tiles_hold_the_same_weights(kind):
    plain, tiles, ref = tiled_pair(kind, seed=11)
    assert tiles.nbytes == plain.nbytes and not torch.equal(tiles.data, plain.data)
    assert torch.equal(kernels.unpack(tiles), kernels.unpack(plain))
    np.testing.assert_allclose(kernels.unpack(tiles).numpy(), ref, rtol=2e-7, atol=1e-9)
    lib = kernels.load_library()
    ids = torch.tensor([0, 7, 8, 23, 13], dtype=torch.int64)
    rows = {}
    for name, p in (("plain", plain), ("tiles", tiles)):
        out = torch.empty(len(ids), p.cols)
        mat = p.as_struct()
        lib.chatbot_rows(ctypes.byref(mat), ids.data_ptr(), len(ids), out.data_ptr())
        rows[name] = out
    assert torch.equal(rows["plain"], rows["tiles"])
    assert torch.equal(rows["tiles"], torch.from_numpy(ref)[ids])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", [256, 768, 2304])
def test_tile_products_are_exact_int16_products(kind, cols):
    _, tiles, ref = tiled_pair(kind, seed=12, rows=40, cols=cols)
    rng = np.random.default_rng(13)
    x = rng.standard_normal(cols).astype(np.float32)
    x[::97] *= 60.0  # a few large inputs, as activations have
    xs = int16_activations(x, 256)
    for threads in (1, 2):
        got = kernels.matvec(tiles, torch.from_numpy(x), threads, act=kernels.ACT_I16).numpy()
        check_product(got, ref, xs)
    # the other input forms run through the rows the tiles hold
    got = kernels.matvec(tiles, torch.from_numpy(x), 1, act=kernels.ACT_F32).numpy()
    check_product(got, ref, x)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [40, 13])
def test_int8_inputs_give_the_exact_int8_products(kind, rows):
    """`--opt fast` (ACT_Q8): the K-quants' inputs as int8 per super-block of 256 (ggml's
    Q8_K), in tiles (40 rows) and row by row (13 rows, and Q5_K, which has no tiles): the exact
    product with the int8-rounded inputs, not the int16 one."""
    cols = 768
    data, ref = random_matrix(kind, seed=21, rows=rows, cols=cols)
    p = kernels.tile_rows(kernels.from_raw(data, kernels.GGUF_FORMATS[kind], rows, cols))
    if kind != "Q5_K" and rows % 8 == 0 and not p.x8:
        pytest.skip("no tile kernels on this CPU (AVX2 and up)")
    assert p.x8 == (kind != "Q5_K" and rows % 8 == 0)
    x = np.random.default_rng(22).standard_normal(cols).astype(np.float32)
    x[::97] *= 60.0
    x8, x16 = int16_activations(x, 256, top=127), int16_activations(x, 256)
    for threads in (1, 2):
        got = kernels.matvec(p, torch.from_numpy(x), threads, act=kernels.ACT_Q8).numpy()
        check_product(got, ref, x8)
        assert np.abs(got - ref.astype(np.float64) @ x16.astype(np.float64)).max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_tile_sums_do_not_overflow_at_the_largest_weights_and_inputs(kind):
    """Every quant and scale at its largest magnitude, every input at +-32767: the integer
    sums are at their bounds (csrc/tiles.c) and must still be exact."""
    rows, cols = 16, 512
    per_row = cols // 256
    fmt = kernels.GGUF_FORMATS[kind]
    if kind == "Q4_K":
        block = np.zeros(144, np.uint8)
        block[0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
        block[2:4] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
        block[4:16] = 0xFF  # all six-bit scales and mins 63
        block[16:] = 0xFF  # all quants 15
    else:
        block = np.zeros(210, np.uint8)  # quants 0: weight -32 x scale
        block[192:208] = np.uint8(0x80)  # scales -128
        block[208:210] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
        top = block.copy()  # quants 63, the largest products of the unsigned quants
        top[:192] = 0xFF
        block = np.concatenate([block, top])  # each row: one super-block of each
    raw = np.tile(block, rows * per_row // (len(block) // (144 if kind == "Q4_K" else 210))).reshape(rows, -1)
    ref = dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols).astype(np.float32)
    plain = kernels.from_raw(torch.from_numpy(raw.copy()), fmt, rows, cols)
    tiles = kernels.tile_rows(plain)
    if not tiles.x8:
        pytest.skip("no tile kernels on this CPU (AVX2 and up)")
    for sign in (1.0, -1.0):
        x = np.full(cols, sign, np.float32)
        for act in (kernels.ACT_I16, kernels.ACT_Q8):  # inputs at +-32767, at +-127
            got = kernels.matvec(tiles, torch.from_numpy(x), 1, act=act).numpy()
            check_product(got, ref, x)
            assert abs(got[0]) > 1e4
        batched = kernels.matmul_x8(tiles, torch.from_numpy(np.tile(x, (5, 1))), 2)  # int8 inputs
        for row in batched.numpy():
            check_product(row, ref, x)


@pytest.mark.parametrize("kind", KINDS)
def test_tile_prefill_products_equal_the_rows(kind):
    plain, tiles, _ = tiled_pair(kind, seed=14, rows=48)
    x = torch.from_numpy(np.random.default_rng(15).standard_normal((21, plain.cols)).astype(np.float32))
    for act in (kernels.ACT_I16, kernels.ACT_F32):
        assert torch.equal(packed_matmul(tiles, x, 2, act), packed_matmul(plain, x, 2, act))


@pytest.mark.parametrize("kind", KINDS)
def test_batched_int8_products_are_the_one_token_products(kind):
    """Prefill's int8 product (`kernels.matmul_x8`, `--opt auto` at an int8 site): each
    input's row of the result is, bit for bit, the one-token tile product with int8 inputs
    (`matvec(..., ACT_Q8)`, what the decode step computes), so a prompt prefills as it would
    decode; and it is the exact product with the int8-rounded inputs. 13 inputs (not a multiple
    of the 4 a tile takes at once), of very different sizes, one all zeros; 1 and 2 threads."""
    plain, tiles, ref = tiled_pair(kind, seed=31, rows=40, cols=768)  # 5 tiles: one alone
    x = np.random.default_rng(32).standard_normal((13, plain.cols)).astype(np.float32)
    x[:, ::97] *= 60.0
    x[3] *= 100.0
    x[5] = 0.0
    xt = torch.from_numpy(x)
    one_token = torch.stack([kernels.matvec(tiles, xt[i], 1, act=kernels.ACT_Q8) for i in range(len(x))])
    for threads in (1, 2):
        got = kernels.matmul_x8(tiles, xt, threads)
        assert got is not None and torch.equal(got, one_token), threads
    for i, row in enumerate(x):
        check_product(got[i].numpy(), ref, int16_activations(row, 256, top=127))
    assert torch.all(got[5] == 0.0)
    assert torch.equal(packed_matmul(tiles, xt, 2, kernels.ACT_Q8), got)
    # not the int16 product: the int8 rounding is there
    assert (got - kernels.matmul_i16(tiles, xt, 2)).abs().max() > 1e-3
    # the rows as stored have no int8 product: None, and packed_matmul takes the int16 one
    assert kernels.matmul_x8(plain, xt, 2) is None
    assert torch.equal(packed_matmul(plain, xt, 2, kernels.ACT_Q8), kernels.matmul_i16(plain, xt, 2))
    # a single input and fewer inputs than packed_matmul batches: the same rows
    assert torch.equal(kernels.matmul_x8(tiles, xt[:1], 2), one_token[:1])


def test_batched_int8_product_is_for_tiles_only():
    """Formats without tiles have no int8 batched product (None, nothing written)."""
    data, _ = random_matrix("Q4_1", seed=33, rows=16, cols=512)
    other = kernels.from_raw(data, kernels.FMT_Q4_1, 16, 512)
    assert kernels.matmul_x8(other, torch.ones(6, 512), 1) is None


def test_stack_keeps_tiles_apart_from_rows():
    plain, tiles, _ = tiled_pair("Q4_K", seed=16)
    stacked = kernels.stack([tiles, tiles])
    assert stacked.x8 and stacked.rows == 48
    assert torch.equal(kernels.unpack(stacked)[24:], kernels.unpack(plain))
    with pytest.raises(AssertionError):
        kernels.stack([tiles, plain])


def test_tiles_are_left_alone_where_they_do_not_fit(monkeypatch):
    data, _ = random_matrix("Q4_K", seed=17, rows=12, cols=512)
    odd = kernels.from_raw(data, kernels.FMT_Q4_K, 12, 512)
    assert kernels.tile_rows(odd) is odd  # rows not a multiple of 8
    data, _ = random_matrix("Q4_1", seed=17, rows=16, cols=512)
    other = kernels.from_raw(data, kernels.FMT_Q4_1, 16, 512)
    assert kernels.tile_rows(other) is other  # a format without tiles
    monkeypatch.setenv("CHATBOT_TILES", "0")
    data, _ = random_matrix("Q4_K", seed=17, rows=16, cols=512)
    fits = kernels.from_raw(data, kernels.FMT_Q4_K, 16, 512)
    assert kernels.tile_rows(fits) is fits


@pytest.mark.parametrize("vnni", [True, False], ids=["avx-vnni", "no-vnni"])
def test_avx2_build_tiles_match_reference(tmp_path, vnni):
    """The tiles as an AVX2 CPU without AVX-512 runs them (256-bit vpdpbusd where the CPU has
    AVX-VNNI, vpmaddubsw where not), with int16 inputs and with int8 ones (their own tile
    products there), one input at a time and several (prefill's batched int8 product, which
    gives each input the one-token product bit for bit)."""
    cc = kernels.find_compiler()
    if cc is None or not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("no C compiler or no AVX2")
    if not vnni and "avx_vnni" not in _cpu_flags():
        pytest.skip("this CPU has no AVX-VNNI: the other build is this one")
    lib_path = tmp_path / "avx2.so"
    flags = [
        "-O3",
        "-march=native",
        "-mno-avx512f",
        *([] if vnni else ["-mno-avxvnni"]),
        "-pthread",
        "-shared",
        "-fPIC",
        "-std=c11",
    ]  # any compiler
    subprocess.run([cc, *flags, "-o", str(lib_path), str(kernels.SOURCE), "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.chatbot_matvec_scratch.restype = ctypes.c_long
    cols = 768
    x = np.random.default_rng(18).standard_normal(cols).astype(np.float32)
    x[::53] *= 40.0
    for kind in KINDS:
        data, ref = random_matrix(kind, seed=19, rows=32, cols=cols)
        plain = kernels.from_raw(data, kernels.GGUF_FORMATS[kind], 32, cols)
        out = torch.empty_like(plain.data)
        assert lib.chatbot_repack(ctypes.byref(plain.as_struct()), ctypes.c_void_p(out.data_ptr())) == 0
        mat = kernels.PackedMatrix(out, plain.fmt, 32, cols, x8=True).as_struct()
        for threads, (act, top) in itertools.product(
            (1, 2), ((kernels.ACT_I16, 32767), (kernels.ACT_Q8, 127))
        ):
            y = torch.empty(32)
            scratch = torch.empty(lib.chatbot_matvec_scratch(cols))
            xt = torch.from_numpy(x)
            lib.chatbot_matvec(
                ctypes.byref(mat), ctypes.c_void_p(xt.data_ptr()), ctypes.c_void_p(scratch.data_ptr()),
                ctypes.c_void_p(y.data_ptr()), threads, act,
            )  # fmt: skip
            check_product(y.numpy(), ref, int16_activations(x, 256, top=top))
            one_token = y.clone() if act == kernels.ACT_Q8 else None
        # prefill's batched int8 product in this build: each row the one-token product
        xs = torch.from_numpy(np.stack([x, -0.5 * x, 3.0 * x, x[::-1].copy(), 0 * x]))
        for threads in (1, 2):
            y = torch.full((len(xs), 32), float("nan"))
            lib.chatbot_matmul_x8(
                ctypes.byref(mat),
                ctypes.c_void_p(xs.data_ptr()),
                len(xs),
                ctypes.c_void_p(y.data_ptr()),
                threads,
            )
            for row, inp in zip(y.numpy(), xs.numpy(), strict=True):
                check_product(row, ref, int16_activations(inp, 256, top=127))
            assert torch.equal(y[0], one_token), kind
