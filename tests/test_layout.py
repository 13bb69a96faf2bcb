"""The package's layout, read with `ast` (nothing is imported): the folders show the layers.

- no import cycle between chatbot's modules (every import counts: at the top, inside a
  function, and under ``if TYPE_CHECKING:``, since a type-only cycle still ties two modules);
- at most `MAX_TOP_MODULES` modules directly in chatbot/, at most `MAX_FOLDER_FILES` Python
  files in any folder, no C file over `MAX_C_LINES` lines;
- the core (engine, models, gguf, conversation) imports no UI library.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "chatbot"
MAX_TOP_MODULES = 8
MAX_FOLDER_FILES = 16
MAX_C_LINES = 1500
CORE = ("engine", "models", "gguf", "conversation")
UI = ("typer", "prompt_toolkit", "rich", "click")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The chatbot modules that `name` imports (``from P import mod`` counts as P.mod where
    that is a module, else as P)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm),
    a package's own ``__init__`` importing its modules aside."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def edges(v: str) -> set[str]:
        # a package's __init__ re-exporting its own modules is not a cycle with them
        return {w for w in graph.get(v, ()) if not w.startswith(v + ".")}

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports():
    graph = import_graph()
    assert "chatbot.engine.generate" in graph["chatbot.conversation.session"]
    assert "chatbot.engine.stops" in graph["chatbot.engine.stop_criteria"]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "p": {"p.x"}, "p.x": {"p"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_a_type_only_import_counts(tmp_path, monkeypatch):
    package = tmp_path / "chatbot"
    package.mkdir()
    (package / "a.py").write_text("from chatbot.b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from chatbot.a import A\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert cycles(import_graph()) == [["chatbot.a", "chatbot.b"]]


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_no_crowded_folder():
    crowded = {
        str(d.relative_to(PACKAGE.parent)): n
        for d in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]
        if (n := len(list(d.glob("*.py")))) > MAX_FOLDER_FILES
    }
    assert crowded == {}


def test_no_long_c_file():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in [*PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")]
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_C_LINES
    }
    assert list(PACKAGE.rglob("*.c")), "the kernels' C sources are in the package"
    assert long == {}


def test_the_core_imports_no_ui():
    found = []
    for name, path in all_modules().items():
        if name.split(".")[1:2] and name.split(".")[1] in CORE:
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                found += [f"{name}: {m}" for m in mods if m.split(".")[0] in UI]
    assert found == []
