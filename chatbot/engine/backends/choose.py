"""Which backend runs a loaded model: chosen once, when it loads (`backend_for`), and
wrapped for a server's concurrent generations (`serving_backend`).

The backends themselves (`chatbot.engine.backends.base`) know nothing of each other; this module is
the one that knows them all, so that none of them imports another's module to be chosen.
"""

from __future__ import annotations

from typing import Any

from chatbot.engine.backends.base import Backend, BatchedBackend, HFBackend, NativeBackend


def choose_backend(model: Any, decoder: Any | None = None) -> Backend:
    """The backend for a loaded model: the native kernels where a decoder was made, else
    transformers."""
    return NativeBackend(model, decoder) if decoder is not None else HFBackend(model)


def serving_backend(backend: Backend, slots: int) -> Backend:
    """`backend` for a server running `slots` generations at once: batched where it can step
    several caches in one call and `slots` is over 1, else as it is (one at a time)."""
    if slots > 1 and backend.max_batch > 1 and not isinstance(backend, BatchedBackend):
        return BatchedBackend(backend)
    return backend


def backend_for(
    model: Any, level: str, threads: int | None = None, use_gguf: bool = True
) -> tuple[Backend, str | None]:
    """The backend `--opt level` asks for on `model`, and a note when it could not be had.

    ``compile`` (and ``auto`` on CUDA, where the native kernels do not run) gives the
    compiled step (`chatbot.engine.backends.compiled.CompiledBackend`); ``off`` transformers; the
    other levels the native kernels, or transformers with the reason they are off.

    Raises:
        ValueError: an unknown level.
    """
    device = model.get_input_embeddings().weight.device
    # bitsandbytes' layers trace whole from 0.50 on (their ops have fake implementations);
    # older ones keep transformers' eager step on CUDA unless `compile` is asked for
    quantized = getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None) is not None
    if level == "compile" or (level == "auto" and device.type == "cuda" and (not quantized or _bnb_traces())):
        from chatbot.engine.backends.compiled import CompiledBackend

        return CompiledBackend(model), None
    from chatbot.engine.backends.native.decoder import make_decoder

    decoder, reason = make_decoder(model, level, threads, use_gguf=use_gguf)
    return choose_backend(model, decoder), reason


def _bnb_traces() -> bool:
    """bitsandbytes is 0.50 or later: its layers compile into the one-graph step."""
    import importlib.metadata

    try:
        major, minor = (int(part) for part in importlib.metadata.version("bitsandbytes").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (0, 50)
