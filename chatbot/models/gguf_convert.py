"""A GGUF file's checks and its float32 conversion cache.

`check_gguf` reads a file's header and tensor table before anything slow. A GGUF file that
cannot run as it is gets dequantized by transformers once (`convert_gguf`); the safetensors
copy is kept under the user's cache directory (`cache_root`), keyed by the file's content hash
(`converted_dir`), and trusted only while its manifest matches its files (`manifest_ok`).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from chatbot.errors import ModelLoadError, first_line
from chatbot.models.load_checks import quiet_transformers
from chatbot.models.manifest import (  # noqa: F401  (MANIFEST: re-exported)
    MANIFEST,
    cache_root,
    file_sha256,
    publish,
    read_manifest,
    scratch_folder,
    staging,
)
from chatbot.models.source import check_gguf
from chatbot.progress import waiting

_CONVERSION_VERSION = 1


def _identity(path: Path) -> str:
    """Key for a converted copy: a hash of the file's content, remembered per (size, mtime)."""
    st = path.stat()
    memo = cache_root() / "hashes.json"
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    with waiting("hashing the file (once)"):
        digest = file_sha256(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        known = known if isinstance(known, dict) else {}
        known[key] = digest
        # a temporary file of its own: two processes hashing at once each rename a whole file
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def converted_dir(gguf: Path) -> Path:
    return cache_root() / "gguf" / f"{gguf.stem}-{_identity(gguf)[:16]}"


def manifest_ok(folder: Path) -> bool:
    """A converted copy is trusted only if every file it lists has its recorded size."""
    manifest = read_manifest(folder)
    return manifest is not None and manifest.get("version") == _CONVERSION_VERSION


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize `gguf` through transformers and write a safetensors copy to `target`.

    Written to a temporary folder beside `target` and renamed into place, so a crash never
    leaves a half-written copy that looks complete.

    Raises:
        ModelLoadError: the file is not a GGUF model transformers can read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from chatbot.models.gguf_model import apply_expert_metadata

    check_gguf(gguf)
    try:
        with quiet_transformers(gguf=True), waiting("converting the file to float32 (once)"):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            apply_expert_metadata(gguf, config)  # the experts' width, which transformers misses
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, config=config, dtype=torch.float32
            )
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {first_line(exc)}") from exc
    # The dequantized weights are plain tensors; drop the marker that forbids saving them.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with staging(target) as tmp:
        with quiet_transformers():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        publish(tmp, target, version=_CONVERSION_VERSION, gguf=str(gguf))


def writable_target(target: Path, notes: list[str]) -> Path:
    """`target`, or a folder in the system's temporary directory when the conversion cache
    cannot be written (checked before converting, not after)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=target.parent))
        return target
    except OSError as exc:
        tmp_root = scratch_folder("chatbot-gguf-")
        notes.append(
            f"cannot write the conversion cache {target.parent} ({exc.strerror or exc}); "
            "converted into a temporary folder for this run (set XDG_CACHE_HOME)"
        )
        return tmp_root / target.name
