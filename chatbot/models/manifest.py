"""Cache folders published whole: files written to a temporary folder, listed with their
sizes in a manifest, and renamed into place in one step, so that a crash leaves either the
old folder or the new one and a damaged copy is noticed (a listed file missing or of another
size) and rebuilt. Used by the GGUF metadata cache and the dequantized-GGUF copies."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

MANIFEST = "chatbot-manifest.json"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest when every file it lists is there with its size, else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        ok = bool(manifest["files"]) and all(
            (folder / name).stat().st_size == size for name, size in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return manifest if ok and isinstance(manifest, dict) else None


def publish(tmp: Path, target: Path, **fields: Any) -> None:
    """List the files of `tmp` with their sizes (and `fields`) in its manifest, then put `tmp`
    in the place of `target` (replacing an older copy)."""
    files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST}
    (tmp / MANIFEST).write_text(json.dumps({**fields, "files": files}, indent=1))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
