"""The package's shape, read with `ast` (nothing is imported): no module under chatbot/ over
`MAX_FILE_LINES` lines, no C file over `MAX_C_FILE_LINES`, no function over
`MAX_FUNCTION_LINES`, and no name that starts with a single underscore imported from another
chatbot module (a name another module needs is public)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "chatbot"
MAX_FILE_LINES = 600
MAX_C_FILE_LINES = 1500
MAX_FUNCTION_LINES = 100


def modules() -> list[tuple[str, str]]:
    """(path relative to the checkout, source) of every .py file under chatbot/."""
    return [
        (str(p.relative_to(PACKAGE.parent)), p.read_text(encoding="utf-8"))
        for p in sorted(PACKAGE.rglob("*.py"))
    ]


def is_private(name: str) -> bool:
    """A name with one leading underscore (not a dunder such as ``__version__``)."""
    return name.startswith("_") and not name.startswith("__")


def long_files() -> list[str]:
    """'path: N lines' for each module over `MAX_FILE_LINES`."""
    return [f"{rel}: {n} lines" for rel, src in modules() if (n := len(src.splitlines())) > MAX_FILE_LINES]


def long_c_files() -> list[str]:
    """'path: N lines' for each C source or header under chatbot/ over `MAX_C_FILE_LINES`."""
    paths = sorted(p for ext in ("*.c", "*.h") for p in PACKAGE.rglob(ext))
    return [
        f"{p.relative_to(PACKAGE.parent)}: {n} lines"
        for p in paths
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_C_FILE_LINES
    ]


def long_functions() -> list[str]:
    """'path:line name: N lines' for each function (methods and nested ones too) over
    `MAX_FUNCTION_LINES`, counted from its ``def`` to its last line."""
    found = []
    for rel, src in modules():
        for node in ast.walk(ast.parse(src, rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    return found


def private_imports() -> list[str]:
    """'path:line: from MODULE import NAME' for each private name imported from a chatbot
    module: ``from chatbot.x import _y``, or relative (``from .x import _y``, ``from . import _y``)."""
    found = []
    for rel, src in modules():
        for node in ast.walk(ast.parse(src, rel)):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = node.module or ""
            if node.level == 0 and module != "chatbot" and not module.startswith("chatbot."):
                continue
            source = "." * node.level + module
            found += [
                f"{rel}:{node.lineno}: from {source} import {alias.name}"
                for alias in node.names
                if is_private(alias.name)
            ]
    return found


def test_the_checks_see_the_package():
    assert len(modules()) > 50
    assert any(rel == "chatbot/engine/backends/native/kernels.py" for rel, _ in modules())


def test_no_module_over_the_line_limit():
    found = long_files()
    assert found == [], "split these modules:\n" + "\n".join(found)


def test_no_c_file_over_the_line_limit():
    assert any(PACKAGE.rglob("*.c")), "the checks see no C source"
    found = long_c_files()
    assert found == [], "split these C files along their concepts:\n" + "\n".join(found)


def test_no_function_over_the_line_limit():
    found = long_functions()
    assert found == [], "split these functions:\n" + "\n".join(found)


def test_no_private_name_imported_across_modules():
    found = private_imports()
    assert found == [], "make these names public:\n" + "\n".join(found)


def test_private_imports_are_found(tmp_path, monkeypatch):
    """The import check on a package made for it: absolute and relative forms are caught,
    public names, dunders and other packages' private names are not."""
    package = tmp_path / "chatbot"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("_x = 1\n")
    (package / "sub" / "b.py").write_text(
        "from chatbot.a import _x\n"
        "from ..a import _x as y\n"
        "from . import _c\n"
        "from chatbot.a import public, __version__\n"
        "from os import _exit\n"
        "def f():\n    from chatbot import _late\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert private_imports() == [
        "chatbot/sub/b.py:1: from chatbot.a import _x",
        "chatbot/sub/b.py:2: from ..a import _x",
        "chatbot/sub/b.py:3: from . import _c",
        "chatbot/sub/b.py:7: from chatbot import _late",
    ]


MAX_MEASUREMENT_SHARE = 0.10


def measurement_share() -> float:
    """The share of chatbot/'s lines in measurement, benchmark and synthetic-data modules
    (paths naming measure, bench or synthetic)."""
    lines = {rel: len(src.splitlines()) for rel, src in modules()}
    kinds = ("measure", "bench", "synthetic")
    return sum(n for rel, n in lines.items() if any(k in rel for k in kinds)) / sum(lines.values())


def test_measurement_code_is_at_most_a_tenth_of_the_package():
    assert measurement_share() <= MAX_MEASUREMENT_SHARE, f"{measurement_share():.1%}"
