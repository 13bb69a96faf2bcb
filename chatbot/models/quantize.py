"""bitsandbytes quantization (`--quantize 4bit|8bit`): what runs where, and the load config.

Which bitsandbytes paths run depends on its release and on the device: older releases are
CUDA-only, recent ones (0.46+) bring CPU kernels for both 4-bit and 8-bit, MPS support is
partial. Rather than keep a table that goes stale, `check_quantization` runs one tiny
quantized layer on the target device before the (slow) model load and turns a failure into
one line naming the device, the mode and the bitsandbytes version.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import warnings
from typing import Any

import torch

from chatbot.config import QUANTIZE_CHOICES
from chatbot.errors import ModelLoadError

_probed: dict[tuple[str, str, torch.dtype], str | None] = {}


def bnb_version() -> str | None:
    """The installed bitsandbytes version, or None."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        return importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None


def compute_dtype(mode: str, dtype: str, device: torch.device) -> torch.dtype:
    """The dtype quantized layers compute in and the unquantized layers are stored in.

    An explicit --dtype wins. auto: on GPUs, 4-bit computes in bfloat16 where the device has
    it, else float16 (QLoRA's NF4 recipe), and 8-bit in float16 (LLM.int8 casts its inputs
    to float16 anyway). On the CPU both keep float32, which prefills several times faster
    than bfloat16 there (see docs/models.md).
    """
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype in table:
        return table[dtype]
    if device.type == "cuda":
        if mode == "4bit" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def _probe(mode: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Run one 64x64 quantized linear layer on `device`; None if it works, else the reason."""
    key = (mode, str(device), dtype)
    if key in _probed:
        return _probed[key]
    reason: str | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes as bnb

            gen = torch.Generator().manual_seed(0)
            weight = torch.randn(64, 64, generator=gen)
            x = torch.randn(2, 64, generator=gen)
            layer: torch.nn.Module
            if mode == "4bit":
                layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=dtype, quant_type="nf4")
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
                x = x.to(dtype)
            else:
                layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False, threshold=6.0)
                layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            layer = layer.to(device)
            with torch.inference_mode():
                out = layer(x.to(device)).float().cpu()
            if not torch.isfinite(out).all():
                reason = "the test layer gave non-finite output"
    except Exception as exc:  # noqa: BLE001 - bitsandbytes raises many kinds for a missing kernel
        text = " ".join(str(exc).split())
        reason = (text or type(exc).__name__)[:200]
    _probed[key] = reason
    return reason


def check_quantization(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Make sure `mode` runs on `device` with this bitsandbytes, before loading anything.

    Raises:
        ModelLoadError: unknown mode, bitsandbytes missing, or its kernels fail here.
    """
    if mode not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"unknown --quantize {mode!r}: use 4bit or 8bit")
    version = bnb_version()
    if version is None:
        raise ModelLoadError(f"--quantize {mode} needs bitsandbytes: pip install 'bitsandbytes>=0.50'")
    if device.type not in ("cpu", "cuda", "xpu", "mps"):
        raise ModelLoadError(f"--quantize {mode} does not run on {device.type} with bitsandbytes {version}")
    reason = _probe(mode, device, dtype)
    if reason is not None:
        where = "CUDA" if device.type != "cuda" else "a newer bitsandbytes"
        raise ModelLoadError(
            f"{mode} quantization does not run on {device} with bitsandbytes {version} "
            f"({reason}); it needs {where}, or drop --quantize"
        )


class _DropInt8Casts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


def _quiet_int8_casts() -> None:
    """bitsandbytes logs a warning on *every* 8-bit matmul whose input is not float16 (on
    the CPU: every layer of every step, in the middle of the answer). The cast is how
    LLM.int8 works (docs/models.md says so); drop the message."""
    log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropInt8Casts) for f in log.filters):
        log.addFilter(_DropInt8Casts())


def bnb_config(mode: str, dtype: torch.dtype) -> Any:
    """The BitsAndBytesConfig for a mode: 4-bit NF4 with double quantization and 16-bit
    compute (or what --dtype asks), or 8-bit LLM.int8 with the usual outlier threshold."""
    from transformers import BitsAndBytesConfig

    if mode == "8bit":
        _quiet_int8_casts()
    if mode == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0)


def describe_quantization(config: Any) -> str:
    """One phrase for the banner: "none", "bitsandbytes 4-bit nf4 (compute bfloat16)", …"""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return "none"
    get = qc.get if isinstance(qc, dict) else (lambda k, d=None: getattr(qc, k, d))
    method = get("quant_method", "")
    method = str(getattr(method, "value", method))
    if method == "bitsandbytes":
        if get("load_in_4bit", False):
            cdt = get("bnb_4bit_compute_dtype", None)
            cdt = str(cdt).removeprefix("torch.") if cdt is not None else "float32"
            double = ", double quant" if get("bnb_4bit_use_double_quant", False) else ""
            return f"bitsandbytes 4-bit {get('bnb_4bit_quant_type', 'fp4')} (compute {cdt}{double})"
        if get("load_in_8bit", False):
            return "bitsandbytes 8-bit (LLM.int8)"
    bits = get("bits", None)
    return f"{method} {bits}-bit" if bits else method or "quantized"
