"""Whether a model's cached keys can be moved to new positions (StreamingLLM's re-rotation),
and the attention window its streaming cache must fit in.

`check_streaming_support` refuses, with one line naming the reason, the models whose keys
`chatbot.engine.cache.sinks.SinkCache` cannot re-rotate: no rotary embedding, interleaved or
partial or multimodal rotary embeddings, layers other than full or sliding-window attention,
a sliding window smaller than the cache. `layer_inv_freqs` gives each layer's frequencies.
"""

from __future__ import annotations

from typing import Any

import torch

from chatbot.errors import StreamingUnsupportedError

# model_type -> how it encodes positions, for models that cannot be re-rotated.
_NO_ROPE = {
    "gpt2": "learned absolute positions",
    "gpt_neo": "learned absolute positions",
    "gpt_bigcode": "learned absolute positions",
    "opt": "learned absolute positions",
    "biogpt": "learned absolute positions",
    "xglm": "sinusoidal absolute positions",
    "bloom": "ALiBi attention biases",
    "mpt": "ALiBi attention biases",
    "jais": "ALiBi attention biases",
}
# Rotary, but pairs (x0, x1), (x2, x3)... instead of the rotate_half halves we re-rotate.
_INTERLEAVED_ROPE = {"gptj", "codegen"}


def _find_rotary(model: Any) -> Any | None:
    inner = getattr(model, "model", None)
    # A multimodal wrapper (Gemma3ForConditionalGeneration) keeps it on its language model.
    candidates = [inner, getattr(inner, "language_model", None), getattr(model, "base_model", None), model]
    for module in candidates:
        rotary = getattr(module, "rotary_emb", None) if module is not None else None
        if rotary is not None:
            return rotary
    return None


def _rope_parameter_dicts(config: Any) -> list[dict[str, Any]]:
    """The rope parameter dicts of a v5 config: one flat dict, or one per layer type."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return []
    nested = [value for value in params.values() if isinstance(value, dict)]
    return nested or [params]


def _sliding_window(config: Any) -> int | None:
    """The window of a model whose full-attention layers still mask beyond it (Mistral)."""
    window = getattr(config, "sliding_window", None)
    if window is None or not getattr(config, "use_sliding_window", True):
        return None
    return int(window)


def _text_config(model_or_config: Any) -> tuple[Any, bool]:
    """The decoder's config of a model or config, and whether a model was given."""
    is_model = hasattr(model_or_config, "config") and not hasattr(model_or_config, "to_dict")
    config = model_or_config.config if is_model else model_or_config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return config, is_model


def streaming_window(model_or_config: Any) -> int | None:
    """The smallest attention window among the model's layers, which a streaming cache must
    fit in (None: every layer attends to the whole cache).

    ``config.layer_types`` says which layers slide (gemma2, gemma3, qwen2 with
    ``use_sliding_window``); without it a ``sliding_window`` applies to every layer (Mistral).
    """
    config, _ = _text_config(model_or_config)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return _sliding_window(config)
    window = getattr(config, "sliding_window", None)
    return int(window) if window and "sliding_attention" in layer_types else None


def layer_inv_freqs(model: Any) -> list[torch.Tensor]:
    """Each decoder layer's rotary inverse frequencies, as the model rotates its keys.

    The rotary module holds one ``inv_freq`` for every layer or, in a model with several
    kinds of layer (gemma3: local and global rope), one ``{layer_type}_inv_freq`` per kind;
    ``config.layer_types[i]`` is the kind of layer ``i``.

    Raises:
        StreamingUnsupportedError: no rotary module, or a layer whose frequencies it lacks.
    """
    config, _ = _text_config(model)
    model_type = getattr(config, "model_type", "") or "this model"
    rotary = _find_rotary(model)
    if rotary is None:
        raise StreamingUnsupportedError(
            f"the attention-sink cache needs rotary position embeddings; no rotary embedding module "
            f"found on {type(model).__name__}"
        )
    layer_types = list(getattr(config, "layer_types", None) or [])
    shared = getattr(rotary, "inv_freq", None)
    freqs = []
    for i in range(config.num_hidden_layers):
        kind = layer_types[i] if i < len(layer_types) else None
        freq = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
        freq = freq if isinstance(freq, torch.Tensor) else shared
        if not isinstance(freq, torch.Tensor):
            raise StreamingUnsupportedError(
                f"the attention-sink cache cannot read the rotary frequencies of {model_type}"
                + (f" {kind} layers" if kind else "")
                + " (non-standard rotary embedding)"
            )
        freqs.append(freq)
    return freqs


def check_streaming_support(
    model_or_config: Any, capacity: int | None = None, start_size: int | None = None
) -> None:
    """Refuse models whose cached keys cannot be moved to new positions.

    Args:
        model_or_config: a loaded model (checked for rotary frequencies for every layer,
            see `layer_inv_freqs`, whose size matches the head dim) or a bare `PretrainedConfig`.
        capacity: start + recent of the intended cache; a model with sliding-window layers
            is accepted when the whole cache fits in the smallest window (the window mask
            then never bites).
        start_size: the sinks of the intended cache, for the recent window that would
            fit (default 4).

    Raises:
        StreamingUnsupportedError: with a message naming the reason.
    """
    config, is_model = _text_config(model_or_config)
    model_type = getattr(config, "model_type", "") or "this model"
    need = "the attention-sink cache needs rotary position embeddings"

    if model_type in _NO_ROPE:
        raise StreamingUnsupportedError(f"{need}; {model_type} uses {_NO_ROPE[model_type]}")
    if model_type == "falcon" and getattr(config, "alibi", False):
        raise StreamingUnsupportedError(f"{need}; this falcon model uses ALiBi attention biases")
    if model_type in _INTERLEAVED_ROPE:
        raise StreamingUnsupportedError(
            f"the attention-sink cache re-rotates keys in the Llama (rotate_half) layout; "
            f"{model_type} uses interleaved rotary embeddings"
        )
    if getattr(config, "qk_rope_head_dim", None):
        raise StreamingUnsupportedError(
            f"the attention-sink cache cannot re-rotate {model_type} keys: only part of each key "
            "is rotary (multi-head latent attention)"
        )

    rope_dicts = _rope_parameter_dicts(config)
    if not rope_dicts and getattr(config, "rope_theta", None) is None and not is_model:
        raise StreamingUnsupportedError(f"{need}; the {model_type} config declares none")

    factors = [getattr(config, "partial_rotary_factor", None)] + [
        d.get("partial_rotary_factor") for d in rope_dicts
    ]
    partial = [f for f in factors if f is not None and float(f) < 1.0]
    if partial:
        raise StreamingUnsupportedError(
            f"the attention-sink cache needs rotary embeddings on the whole head; {model_type} "
            f"rotates only a part (partial_rotary_factor={partial[0]})"
        )
    if any(d.get("mrope_section") for d in rope_dicts) or any(
        str(d.get(key, "")).startswith("mrope") for d in rope_dicts for key in ("rope_type", "type")
    ):
        raise StreamingUnsupportedError(
            f"the attention-sink cache cannot re-rotate {model_type} keys: it uses multimodal "
            "rotary embeddings (mrope_section)"
        )

    layer_types = getattr(config, "layer_types", None) or []
    other_types = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other_types:
        raise StreamingUnsupportedError(
            f"the attention-sink cache needs full or sliding-window attention in every layer; {model_type} "
            f"has {', '.join(other_types)} layers"
        )
    window = streaming_window(config)
    if window is not None and (capacity is None or capacity > window):
        fits = window - (4 if start_size is None else start_size)
        where = " (its sliding_attention layers)" if "sliding_attention" in layer_types else ""
        if capacity is None:
            size = ""
        elif start_size is None:
            size = f", smaller than the cache's {capacity} tokens"
        else:
            size = f"; {start_size} sinks + {capacity - start_size} recent make {capacity}"
        raise StreamingUnsupportedError(
            f"the attention-sink cache must lie inside {model_type}'s sliding window of "
            f"{window} tokens{where}{size}",
            recent_fits=max(fits, 0),
        )

    if is_model:
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // config.num_attention_heads)
        for inv_freq in layer_inv_freqs(model_or_config):
            if inv_freq.numel() * 2 != head_dim:
                raise StreamingUnsupportedError(
                    f"the attention-sink cache needs rotary embeddings on the whole head; {model_type} "
                    f"rotates {inv_freq.numel() * 2} of {head_dim} dims"
                )
