"""Cache folders published whole: files written to a temporary folder, listed with their
sizes and content hashes in a manifest, and renamed into place in one step, so that a crash
leaves either the old folder or the new one and a damaged copy is noticed (a listed file
missing, of another size, or with other bytes) and rebuilt. Used by the GGUF metadata cache
and the dequantized-GGUF copies.

Every file is checked by its content hash (configs, tokenizers: a few MB, ~2 ms), except
weight files (a dequantized copy's safetensors, gigabytes, which would cost seconds at every
start): those by size, and the loader looks for NaN in what it loads from them. A manifest
written before hashes were recorded (sizes only) is not trusted: the folder is rebuilt once.

The folders being written are known here (`staging`, `scratch_folder`), so that a process
leaving without its normal shutdown (`chatbot run` quit while its model still loads in a
thread) removes them first (`remove_partial`) instead of leaving gigabytes behind."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/chatbot` (default `~/.cache/chatbot`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "chatbot"


MANIFEST = "chatbot-manifest.json"
WEIGHT_FILES = (".safetensors", ".bin", ".pt")  # checked by size only
_PARTIAL: set[Path] = set()  # folders being written, or to remove when the process ends


@contextmanager
def staging(target: Path) -> Iterator[Path]:
    """A new temporary folder beside `target` to write its files into (then `publish`);
    removed on leaving, whatever happens."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    _PARTIAL.add(tmp)
    try:
        yield tmp
    finally:
        _PARTIAL.discard(tmp)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def scratch_folder(prefix: str) -> Path:
    """A temporary folder for this process only, removed when it ends."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    _PARTIAL.add(tmp)
    atexit.register(shutil.rmtree, tmp, True)
    return tmp


def remove_partial() -> None:
    """Remove the folders being written (`staging`) and the scratch folders: for a process
    about to leave with `os._exit`, which runs no `finally` and no `atexit`."""
    for tmp in list(_PARTIAL):
        shutil.rmtree(tmp, ignore_errors=True)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest when every file it lists is there with its size and content
    hash (weight files: their size), else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        ok = bool(manifest["files"]) and all(
            _file_ok(folder / name, entry) for name, entry in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return manifest if ok and isinstance(manifest, dict) else None


def _file_ok(path: Path, entry: dict[str, Any]) -> bool:
    if path.stat().st_size != entry["size"]:
        return False
    return path.suffix in WEIGHT_FILES or bool(file_sha256(path) == entry["sha256"])


def _entry(path: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": path.stat().st_size}
    if path.suffix not in WEIGHT_FILES:
        entry["sha256"] = file_sha256(path)
    return entry


def publish(tmp: Path, target: Path, **fields: Any) -> None:
    """List the files of `tmp` with their sizes and hashes (and `fields`) in its manifest,
    then put `tmp` in the place of `target` (replacing an older copy)."""
    files = {p.name: _entry(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
    (tmp / MANIFEST).write_text(json.dumps({**fields, "files": files}, indent=1))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


def file_sha256(path: Path, advance: Callable[[int], object] | None = None) -> str:
    """The file's SHA-256, read in 4 MiB blocks (`advance(n)` told after each)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            if advance is not None:
                advance(len(block))
    return h.hexdigest()
