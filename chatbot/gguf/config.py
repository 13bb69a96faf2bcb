"""The config of a GGUF file's model as its cache folder saves it (config.json), read without
transformers: `ModelConfig` holds the file's keys as attributes, over the defaults that
transformers' plain `PreTrainedConfig` gives a config without them, so that our own model
(`chatbot.engine.backends.native.skeleton`), the kernels and the caches read the same values
as from transformers' class (tests/test_without_transformers.py compares the two).

Why: `import transformers` alone is ~1 s of a one-shot answer on the default model
(docs/benchmarks.md, "Start-up"); a model that runs as our own needs none of its config
machinery. A model built with transformers' class gets transformers' config
(`chatbot.models.gguf_model._load_cached_config`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

# What `PreTrainedConfig.__init__` (transformers 5.x) sets where config.json does not say:
# the attributes a forward pass, a cache or a generation config may read.
_DEFAULTS: dict[str, Any] = {
    "architectures": None,
    "output_hidden_states": False,
    "output_attentions": False,
    "return_dict": True,
    "dtype": None,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
    "problem_type": None,
}

# The generation settings transformers' plain config drops at load (they belong to a
# generation config): a config.json that has them is read without them.
GENERATION_KEYS = frozenset({
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids", "begin_suppress_tokens",
    "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size",
    "encoder_repetition_penalty", "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty",
    "forced_bos_token_id", "forced_eos_token_id", "length_penalty", "max_length", "min_length",
    "no_repeat_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule", "num_beam_groups",
    "num_beams", "num_return_sequences", "output_scores", "remove_invalid_values",
    "repetition_penalty", "return_dict_in_generate", "suppress_tokens", "target_lookbehind",
    "temperature", "top_k", "top_p", "typical_p", "use_cache",
})  # fmt: skip


class ModelConfig:
    """A model's config.json as attributes (`config.hidden_size`...), over transformers'
    defaults for the keys it lacks; an attribute neither gives raises AttributeError, as
    on transformers' config (callers use `getattr(config, name, default)`). Generation
    settings (`GENERATION_KEYS`) are dropped, as transformers drops them.

    Args:
        fields: the keys of config.json.
    """

    def __init__(self, **fields: Any) -> None:
        for key, value in {**_DEFAULTS, **fields}.items():
            if key not in GENERATION_KEYS:
                setattr(self, key, value)

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        """The config saved at `path` (a config.json).

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not JSON.
            TypeError: it is JSON but not an object.
        """
        fields = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(fields, dict):
            raise TypeError(f"{path} is not a JSON object")
        return cls(**fields)

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> ModelConfig:
        """The config of the text model: this one (a causal LM has no other)."""
        return self

    @property
    def per_layer_config(self) -> list[ModelConfig]:
        """Each layer's config: this one for every layer (what transformers' `DynamicCache`
        reads a config's layer kinds from)."""
        return [self] * int(getattr(self, "num_hidden_layers", 0))

    def _get_generation_parameters(self) -> dict[str, Any]:
        """The generation settings this config holds: none, since they are dropped at load
        (what transformers' `generate` checks a model's config for before it builds its
        generation config: `chatbot.compat.colossal`)."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        """Every attribute, copied (what transformers' `to_dict` gives a plain config, less
        its private ones)."""
        return copy.deepcopy({k: v for k, v in vars(self).items() if not k.startswith("_")})

    def __repr__(self) -> str:
        return f"ModelConfig({json.dumps(self.to_dict(), sort_keys=True, default=str)})"
