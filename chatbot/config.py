"""Settings as dataclasses, with the validation shared by flags, presets and /set."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from chatbot.errors import ConfigError
from chatbot.settings import MAX_TOKENS, Choice, Range, default, ranges

__all__ = ["MAX_TOKENS", "Range"]  # also here: older callers import them from config

QUANTIZE_CHOICES = ("4bit", "8bit")
"""bitsandbytes modes of `--quantize` (`chatbot.models.quantize`)."""
OPT_LEVELS = ("off", "f32", "auto", "exact", "fast", "int8", "int4", "compile")
"""`--opt`: ``off`` is plain transformers; ``compile`` is transformers' forward pass compiled as
one step per token on a static cache (`chatbot.engine.backends.compiled`; the default on CUDA); the
others pick the weight format of the native kernels (`chatbot.engine.backends.native.decoder`)."""
FILE_LEVELS = ("auto", "exact", "fast")
"""The native levels that decode a GGUF file's matrices as stored; they differ in the form of
the products' inputs (`chatbot.engine.backends.native.decoder.choose_inputs`)."""


@dataclass(frozen=True)
class OutputFormat:
    """What shape the answer must take, enforced token by token (`chatbot.engine.grammar`):
    a JSON object (`schema` None), or JSON that satisfies `schema`, a JSON Schema as JSON text.

    `name` is the schema's name (OpenAI's `json_schema.name`), `strict` its `strict` flag:
    both travel with it to a server; the schema is enforced either way.
    """

    schema: str | None = None
    name: str = "schema"
    strict: bool | None = None

    @classmethod
    def json_object(cls) -> OutputFormat:
        return cls()

    def describe(self) -> str:
        """The format as /set lists it."""
        return "json" if self.schema is None else f"json schema {self.name}"

    def response_format(self) -> dict[str, Any]:
        """OpenAI's `response_format` for it."""
        if self.schema is None:
            return {"type": "json_object"}
        spec: dict[str, Any] = {"name": self.name, "schema": json.loads(self.schema)}
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}

    @classmethod
    def from_file(cls, path: Path) -> OutputFormat:
        """The JSON schema in a file (`--json-schema FILE`), named after the file.

        Raises:
            ConfigError: the file cannot be read, or holds no JSON object.
        """
        try:
            schema = json.loads(path.expanduser().read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"--json-schema: cannot read {path}: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"--json-schema: {path} is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ConfigError(f"--json-schema: {path} holds a {type(schema).__name__}, not a schema object")
        name = re.sub(r"[^a-zA-Z0-9_-]", "_", path.stem)[:64] or "schema"
        return cls(json.dumps(schema), name)


FORMAT_KEY = "format"
"""The `/set` key of `SamplingConfig.output_format`: `text` or `json` (any JSON object)."""


def format_choice(raw: Any) -> str:
    """`/set format`'s value, normalized: "text" or "json".

    Raises:
        ConfigError: anything else.
    """
    value = str(raw).strip().lower()
    value = {"off": "text", "none": "text", "json_object": "json"}.get(value, value)
    if value not in ("text", "json"):
        raise ConfigError(
            f"format must be text or json, got {raw!r} (a JSON schema: chatbot run --json-schema FILE)"
        )
    return value


OPTIONAL = {"seed": "random", "think": "the model's default", "think_budget": "none"}
"""The sampling settings that may be None, and how their None is shown."""

UNSET_TEXT = "server's default"
"""How a setting in `SamplingConfig.unset` is shown: only a chat with a server leaves any."""


@dataclass
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy.

    `unset` names the settings nobody gave, left to whoever answers: a server applies its own
    defaults (its model's preset) to the fields a request leaves out. Their values here are
    placeholders, never sent nor shown; `with_value` sets one."""

    # The fields of the "sampling" rows of `chatbot.settings.SETTINGS` (defaults, ranges there).
    temperature: float = default("temperature")
    top_p: float = default("top_p")
    top_k: int = default("top_k")
    repetition_penalty: float = default("repetition_penalty")
    repeat_last_n: int = default("repeat_last_n")  # the penalty's window; 0: off, -1: all
    max_new_tokens: int = default("max_new_tokens")
    seed: int | None = default("seed")
    think: str | None = default("think")  # None: the model's own default
    think_budget: int | None = default("think_budget")  # None: no limit
    draft: str = default("draft")  # "ngram" (n-gram lookup), "model" (the draft model): speculation
    draft_tokens: int = default("draft_tokens")
    stream_interval: int = default("stream_interval")
    unset: frozenset[str] = frozenset()
    # None: free text; else the answer is held to this format (constrained decoding).
    output_format: OutputFormat | None = None

    RANGES: ClassVar[dict[str, Range | Choice]] = ranges("sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 and "temperature" not in self.unset

    def validated(self) -> SamplingConfig:
        """Return self after checking every setting against its range.

        Raises:
            ConfigError: naming the key and the allowed range.
        """
        for key, rng in self.RANGES.items():
            value = getattr(self, key)
            if value is None and key in OPTIONAL:
                continue
            setattr(self, key, rng.check(key, value))
        return self

    def given(self) -> dict[str, Any]:
        """The settings not left to the server (`unset`), by name (the seed: when set)."""
        return {
            key: getattr(self, key)
            for key in self.RANGES
            if key not in self.unset and (key not in OPTIONAL or getattr(self, key) is not None)
        }

    def shown(self, key: str) -> str:
        """A setting's value as /set lists it."""
        if key == FORMAT_KEY:
            return "text" if self.output_format is None else self.output_format.describe()
        if key in self.unset:
            return UNSET_TEXT
        value = getattr(self, key)
        if value is None:
            return OPTIONAL.get(key, "none")
        return str(value)

    def with_value(self, key: str, raw: Any) -> SamplingConfig:
        """A copy with one setting changed, parsed from text or a number.

        Raises:
            ConfigError: for an unknown key or a value outside its range.
        """
        key = key.replace("-", "_")
        if key == FORMAT_KEY:
            json_object = format_choice(raw) == "json"
            return dataclasses.replace(
                self, output_format=OutputFormat.json_object() if json_object else None
            )
        if key not in self.RANGES:
            raise ConfigError(f"unknown setting {key!r}; settings: {', '.join(self.RANGES)}")
        if key in OPTIONAL and isinstance(raw, str) and raw.lower() in ("none", "random", "default", "auto"):
            return dataclasses.replace(self, **{key: None}, unset=self.unset - {key})  # type: ignore[arg-type]
        if key in ("seed", "think_budget") and isinstance(raw, str) and raw.lower() == "off":
            return dataclasses.replace(self, **{key: None}, unset=self.unset - {key})  # type: ignore[arg-type]
        value: Any = self.RANGES[key].check(key, raw)
        return dataclasses.replace(self, **{key: value}, unset=self.unset - {key})

    def as_dict(self) -> dict[str, Any]:
        """The settings by name; None for one left to the server."""
        return {key: None if key in self.unset else getattr(self, key) for key in self.RANGES}


def default_recent_size(max_context: int, window: int | None = None, start_size: int = 4) -> int:
    """A sensible window for --enable-streaming: about a quarter of the trained context,
    e.g. 2000 for an 8k model, at least 256.

    Args:
        max_context: the model's context (or --max-context).
        window: the model's smallest sliding window (`streaming_window`). Where the sinks
            and that default would not fit in it, the recent window takes what is left of
            the sliding window after a quarter of it, kept for the sinks and a pinned
            system prompt (384 for gemma3-1b's 512).
        start_size: the sinks.
    """
    recent = max(256, min(2000, max_context // 4))
    if window is not None and start_size + recent > window:
        recent = max(1, window - max(start_size, window // 4))
    return recent


@dataclass
class EngineConfig:
    """How the engine runs the model: chunking, streaming cache, context limits."""

    # The fields of the "engine" rows of `chatbot.settings.SETTINGS` (defaults, ranges there).
    prefill_chunk: int = default("prefill_chunk")
    enable_streaming: bool = default("enable_streaming")
    start_size: int = default("start_size")
    recent_size: int | None = default("recent_size")  # None: from the model's context (`recent_window`)
    keep_system: bool | None = default("keep_system")  # None: on when a system prompt is set
    max_context: int | None = default("max_context")  # None: the model's max_position_embeddings

    # The numeric settings (None, where a field allows it, is not checked against these).
    RANGES: ClassVar[dict[str, Range | Choice]] = ranges("engine")

    def validated(self) -> EngineConfig:
        """Check each value alone, and the sinks against a given recent window (the model's
        context is checked by `check_window` once it is known).

        Raises:
            ConfigError: naming the key and the allowed range.
        """
        for key, rng in self.RANGES.items():
            if getattr(self, key) is not None:
                rng.check(key, getattr(self, key))
        if self.recent_size is not None:
            self.check_window(self.start_size, self.recent_size)
        return self

    def recent_window(self, max_context: int, sliding_window: int | None = None) -> int:
        """The recent window of this conversation's streaming cache: `recent_size`, else the
        default for a context of `max_context` tokens (`default_recent_size`).

        Args:
            max_context: the conversation's context (--max-context, else the model's).
            sliding_window: the model's smallest sliding window, if it has one.
        """
        if self.recent_size is not None:
            return self.recent_size
        return default_recent_size(max_context, sliding_window, self.start_size)

    def check_window(self, start_size: int, recent_size: int, max_context: int | None = None) -> None:
        """A streaming cache must fit in the context: sinks + recent window at most
        `max_context` (None: not known yet), and no more sinks than the window.

        Raises:
            ConfigError: it does not fit (saying what would).
        """
        if start_size > recent_size:
            raise ConfigError(
                f"start_size ({start_size:,}) must not be larger than the recent window ({recent_size:,})"
            )
        if max_context is not None and start_size + recent_size > max_context:
            raise ConfigError(
                f"start_size + recent_size ({start_size:,} + {recent_size:,}) must be at most the "
                f"context ({max_context:,} tokens); e.g. --recent-size {max(16, max_context - start_size):,}"
            )


@dataclass
class ChatConfig:
    """Everything a chat session needs besides the model."""

    system: str | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    load: LoadConfig | None = None  # how the model was loaded, where known (a session log records it)


@dataclass(frozen=True)
class LoadConfig:
    """Which model to load and how: the arguments of `chatbot.models.loader.load_model`."""

    model: str | None = None  # None: the embedded default model
    device: str = "auto"
    dtype: str = "auto"
    quantize: str | None = None
    device_map: str | dict[str, Any] | None = None
    max_memory: str | dict[Any, Any] | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    template: str | None = "auto"
    draft_model: str | None = None  # `--draft FILE`: a small model that guesses (speculation)

    def options(self) -> dict[str, Any]:
        """The keyword arguments of `load_model` besides the source."""
        mine = ("model", "draft_model")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in mine}


@dataclass
class SamplingChoices:
    """The sampling settings a preset or a flag gave, each None where none did: those come
    from the model's generation_config once it is loaded, else `SamplingConfig`'s defaults
    (`engine.sampling.sampling_from_model`). The fields are SamplingConfig's, checked against
    its `RANGES`."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    think: str | None = None
    think_budget: int | None = None
    draft: str | None = None
    draft_tokens: int | None = None
    stream_interval: int = 1

    def given(self) -> dict[str, Any]:
        """The values set, by name: the keyword arguments of `sampling_from_model`."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def validated(self) -> SamplingChoices:
        """Return self after checking the values set against `SamplingConfig.RANGES`.

        Raises:
            ConfigError: naming the key and the allowed range.
        """
        SamplingConfig(**self.given()).validated()
        return self


@dataclass
class RunConfig:
    """Everything `chatbot run` resolved once from the defaults, a preset and the flags.

    Each setting is a field of one section (`load`, `sampling`, `engine`) or `system`, under
    a name used nowhere else: the name of its flag, and of its key in a preset.
    """

    load: LoadConfig = field(default_factory=LoadConfig)
    system: str | None = None
    sampling: SamplingChoices = field(default_factory=SamplingChoices)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # `run --json-schema`: a choice of this run, not a setting (no preset or log holds it)
    output_format: OutputFormat | None = None

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """Every setting's name, section by section."""
        return tuple(name for names in _SECTIONS.values() for name in names)

    def get(self, name: str) -> Any:
        """The value of the setting `name` (see `setting_names`)."""
        section = _section_of(name)
        return getattr(self if section is None else getattr(self, section), name)

    def replaced(self, values: dict[str, Any]) -> RunConfig:
        """A copy with the settings in `values` (by name) changed; unchecked (see `validated`).

        Raises:
            KeyError: a name that is no setting.
        """
        changes: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            changes.setdefault(_section_of(name) or "", {})[name] = value
        top = changes.pop("", {})
        for section, fields in changes.items():
            top[section] = dataclasses.replace(getattr(self, section), **fields)
        return dataclasses.replace(self, **top)

    def validated(self) -> RunConfig:
        """Check the values given before a (slow) model load.

        Raises:
            ConfigError: naming the key and the allowed range.
        """
        self.sampling.validated()
        self.engine.validated()
        return self

    def chat_config(self, sampling: SamplingConfig) -> ChatConfig:
        """The session's settings, with `sampling` completed from the loaded model."""
        if self.output_format is not None:
            sampling = dataclasses.replace(sampling, output_format=self.output_format)
        return ChatConfig(system=self.system, sampling=sampling, engine=self.engine, load=self.load)


# RunConfig's sections (None: a field of RunConfig itself) and the names of their settings.
_SECTIONS: dict[str | None, tuple[str, ...]] = {
    "load": tuple(f.name for f in dataclasses.fields(LoadConfig)),
    None: ("system",),
    "sampling": tuple(f.name for f in dataclasses.fields(SamplingChoices)),
    "engine": tuple(f.name for f in dataclasses.fields(EngineConfig)),
}


def _section_of(name: str) -> str | None:
    for section, names in _SECTIONS.items():
        if name in names:
            return section
    raise KeyError(f"no setting named {name!r}")
