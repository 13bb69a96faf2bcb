"""The format table (`chatbot.engine.backends.native.formats`) against the kernels' C source and against ggml.

The kernels name each format in an enum (``FMT_Q4_K = 10``, csrc/kernels.h) and give its
block size in two switches (`block_len`: weights, `block_bytes`: bytes, csrc/formats.c).
Python reads all of that from the table; these tests read the C source and fail where the two
disagree, so a format changed on one side only is caught before a kernel reads a matrix with
the wrong stride.
"""

from __future__ import annotations

import re

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from chatbot.engine.backends.native import build as kernel_build
from chatbot.engine.backends.native.formats import FORMATS, KernelFormat


def _function_body(source: str, name: str) -> str:
    """The body of the C function `static int name(int fmt) { ... }` (to its closing brace
    at the start of a line)."""
    found = re.search(rf"static int {name}\(int fmt\) \{{\n(.*?)\n\}}", source, re.DOTALL)
    if found is None:
        raise AssertionError(f"the kernels' source has no function {name}(int fmt)")
    return found.group(1)


def _switch_values(body: str, constants: dict[str, int]) -> tuple[dict[str, int], int | None]:
    """``case FMT_X: case FMT_Y: return V;`` of a switch: {"FMT_X": V, ...} and the default's V."""
    values: dict[str, int] = {}
    default = None
    for labels, value in re.findall(r"((?:(?:case\s+\w+|default)\s*:\s*)+)return\s+(\w+)\s*;", body):
        number = int(value) if value.isdigit() else constants[value]
        for label in re.findall(r"case\s+(\w+)|default", labels):
            if label:
                values[label] = number
        if "default" in labels:
            default = number
    return values, default


def c_formats(source: str) -> dict[str, tuple[int, int, int]]:
    """The kernels' formats: ``FMT_`` name -> (enum value, weights per block, bytes per block)."""
    enum = re.search(r"enum\s*\{([^}]*FMT_F32[^}]*)\}", source)
    if enum is None:
        raise AssertionError("the kernels' source has no enum of FMT_ formats")
    codes = {name: int(value) for name, value in re.findall(r"(FMT_\w+)\s*=\s*(\d+)", enum.group(1))}
    defines = {name: int(value) for name, value in re.findall(r"#define (QK\w*) (\d+)", source)}
    lengths, default_length = _switch_values(_function_body(source, "block_len"), defines)
    sizes, _ = _switch_values(_function_body(source, "block_bytes"), defines)
    out = {}
    for name, code in codes.items():
        length = lengths.get(name, default_length)
        assert length is not None, f"block_len has no case for {name}"
        out[name] = (code, length, sizes.get(name, 0))
    return out


def mismatches(source: str, table: tuple[KernelFormat, ...] = FORMATS) -> list[str]:
    """Where the C source (`source`) and the table disagree, one line each."""
    found = c_formats(source)
    problems = []
    expected = {f"FMT_{f.gguf_name}": (f.code, f.block_weights, f.block_bytes) for f in table}
    for name in sorted(set(found) | set(expected)):
        if name not in found:
            problems.append(f"{name} is in the table but not in the kernels' enum")
        elif name not in expected:
            problems.append(f"{name} is in the kernels' enum but not in the table")
        elif found[name] != expected[name]:
            problems.append(
                f"{name}: the C source has (code, weights, bytes) {found[name]}, the table {expected[name]}"
            )
    return problems


def test_the_c_source_agrees_with_the_table():
    assert mismatches(kernel_build.source_text()) == []


# Each edit makes the C source disagree with the table in one way; the check must see each.
EDITS = {
    "block bytes": ("case FMT_Q4_K: return 144;", "case FMT_Q4_K: return 145;"),
    "enum value": ("FMT_Q6_K = 12", "FMT_Q6_K = 13"),
    "block length": ("case FMT_Q2_K: case FMT_Q3_K:", "case FMT_Q3_K:"),
    "format missing": (", FMT_Q6_K = 12", ""),
    "format added": ("FMT_Q6_K = 12", "FMT_Q6_K = 12, FMT_IQ4_NL = 13"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_the_check_fails_on_a_changed_copy_of_the_c_source(edit):
    source = kernel_build.source_text()
    old, new = EDITS[edit]
    assert source.count(old) >= 1, f"the edit {edit!r} no longer applies to the C source"
    assert mismatches(source.replace(old, new, 1)) != []


def test_the_table_agrees_with_ggml():
    """Block sizes and type ids as the gguf package (ggml's Python side) has them."""
    for f in FORMATS:
        qtype = GGMLQuantizationType[f.gguf_name]
        assert qtype.value == f.ggml_type, f.gguf_name
        assert GGML_QUANT_SIZES[qtype] == (f.block_weights, f.block_bytes), f.gguf_name
        assert all(at + 2 <= f.block_bytes for at in (*f.scale_at, *f.min_at)), f.gguf_name


def test_the_table_has_one_row_per_name_and_code():
    for field in ("name", "gguf_name", "ggml_type", "code"):
        values = [getattr(f, field) for f in FORMATS]
        assert len(set(values)) == len(values), field
