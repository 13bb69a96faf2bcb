"""What `chatbot models` lists: presets, and models already on this machine.

Looked at: the default model's package, the converted GGUF copies in chatbot's cache, the
hugging face hub cache (`HF_HUB_CACHE` / `HF_HOME`), and any folders given on the command
line (model folders with a config.json and .gguf files, one level deep).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chatbot.errors import ModelLoadError
from chatbot.models.hub import cached_files, gguf_names
from chatbot.models.manifest import MANIFEST, cache_root
from chatbot.models.source import default_gguf_path


@dataclass(frozen=True)
class LocalModel:
    """A model found on disk: what to pass to --model, its size and where it was found."""

    name: str
    size_bytes: int
    source: str  # "default", "hub cache", "converted GGUF", "folder", "gguf file"
    path: str


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def human_size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def hub_models() -> list[LocalModel]:
    """Models in the local hub cache (none when the cache is absent or unreadable): each GGUF
    of a repo by the name that runs it (`user/repo:QUANT`, else `user/repo/file.gguf`), and a
    repo with transformers weights by its id."""
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
    except Exception:  # noqa: BLE001 - no cache, or one it cannot read: nothing to list
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            folder = Path(rev.snapshot_path)
            files = cached_files(folder)
            ggufs = gguf_names(repo.repo_id, files)
            for name, parts in ggufs.items():
                size = sum(p.size or 0 for p in parts)
                out.append(LocalModel(name, size, "hub cache", str(folder / parts[0].path)))
            if any(f.path.endswith((".safetensors", ".bin")) for f in files):
                size = sum(f.size or 0 for f in files if not f.path.endswith(".gguf"))
                out.append(LocalModel(repo.repo_id, size, "hub cache", str(folder)))
    return sorted({m.name: m for m in out}.values(), key=lambda m: m.name.lower())


def downloaded(found: list[LocalModel]) -> set[str]:
    """The lowercased names in `found` that come from the hub cache (what `--model` would not
    download)."""
    return {m.name.lower() for m in found if m.source == "hub cache"}


def converted_models() -> list[LocalModel]:
    """GGUF files converted once by chatbot (their source file is in the manifest)."""
    root = cache_root() / "gguf"
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir()):
        if (folder / MANIFEST).is_file():
            out.append(LocalModel(folder.name, _tree_size(folder), "converted GGUF", str(folder)))
    return out


def folder_models(folders: list[Path]) -> list[LocalModel]:
    """Model folders (with config.json) and .gguf files in `folders`, one level deep."""
    out = []
    for base in folders:
        base = base.expanduser()
        candidates = [base] + (sorted(base.iterdir()) if base.is_dir() else [])
        for p in candidates:
            if p.is_dir() and (p / "config.json").is_file():
                out.append(LocalModel(p.name, _tree_size(p), "folder", str(p)))
            elif p.is_file() and p.suffix.lower() == ".gguf":
                out.append(LocalModel(p.stem, p.stat().st_size, "gguf file", str(p)))
    return out


def local_models(folders: list[Path] | None = None) -> list[LocalModel]:
    """Everything found: the default model first, then the caches, then `folders`."""
    out = []
    try:
        gguf = default_gguf_path()
        out.append(LocalModel("SmolLM2-135M-Instruct (default)", gguf.stat().st_size, "default", str(gguf)))
    except ModelLoadError:
        pass
    return out + converted_models() + hub_models() + folder_models(folders or [])
