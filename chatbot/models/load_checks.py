"""Checks and settings before a load: the device, the dtype, accelerate's device map and memory
budget (`LoadOptions`), a folder's safetensors headers, whether a config describes a chat model,
and the small helpers the loaders share (quiet transformers, short errors, out-of-memory).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatbot.errors import ConfigError, ModelLoadError


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
def _quiet_warnings() -> Iterator[None]:
    """Python's warnings ignored, and accelerate's logger at errors only (it warns that
    offloaded weights sit on the meta device: the banner says so), for one block."""
    acc = logging.getLogger("accelerate")
    acc_level = acc.level
    acc.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        acc.setLevel(acc_level)


@contextmanager
def quiet_transformers(gguf: bool = False):
    """Silence progress bars and info logs of a load; errors still raise. `gguf`: the load
    reads a GGUF file through transformers, whose reader has a bare tqdm bar of its own
    (which would fight the CLI's spinner); importing that reader takes ~0.2 s, so only loads
    that use it ask for it (a GGUF file run as it is reads its own tensor table). Where
    transformers is not imported yet (a GGUF file run as our own model need not import it:
    ~1 s), its verbosity is asked of its import instead (`_quiet_if_imported`)."""
    if not gguf and "transformers" not in sys.modules:
        with _quiet_if_imported():
            yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf_utils: Any = None
    if gguf:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_tqdm = gguf_utils.tqdm
        gguf_utils.tqdm = _no_bar
    try:
        with _quiet_warnings():
            yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()
        if gguf_utils is not None:
            gguf_utils.tqdm = gguf_tqdm


@contextmanager
def _quiet_if_imported():
    """`quiet_transformers` for a block that may import transformers: its logging reads
    TRANSFORMERS_VERBOSITY when it is imported; and if the block imported it, the verbosity
    and progress bars are set back after it as `quiet_transformers` sets them."""
    saved = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    try:
        with _quiet_warnings():
            yield
    finally:
        if saved is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = saved
        hf_logging = sys.modules.get("transformers.utils.logging")
        if hf_logging is not None:
            hf_logging.set_verbosity(hf_logging._get_default_logging_level())
            hf_logging.enable_progress_bar()


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


def disk_size(folder: Path) -> int:
    """The bytes of the weight files (.safetensors, .bin, .pt) directly in `folder`."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` says memory ran out (MemoryError, torch's out-of-memory, or an allocator's
    RuntimeError)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text
        for s in ("out of memory", "can't allocate memory", "not enough memory", "failed to allocate")
    )


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
