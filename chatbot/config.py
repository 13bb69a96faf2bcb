"""Settings as dataclasses, with the validation shared by flags, presets and /set."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from chatbot.errors import ConfigError

QUANTIZE_CHOICES = ("4bit", "8bit")
"""bitsandbytes modes of `--quantize` (`chatbot.models.quantize`)."""
OPT_LEVELS = ("off", "f32", "auto", "exact", "fast", "int8", "int4", "compile")
"""`--opt`: ``off`` is plain transformers; ``compile`` is transformers' forward pass compiled as
one step per token on a static cache (`chatbot.engine.compiled`; the default on CUDA); the
others pick the weight format of the native kernels (`chatbot.engine.fast`)."""
FILE_LEVELS = ("auto", "exact", "fast")
"""The native levels that decode a GGUF file's matrices as stored; they differ in the form of
the products' inputs (`chatbot.engine.fast.choose_inputs`)."""

# Above any context a model has today; bounds token counts given on the command line.
MAX_TOKENS = 1 << 24


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric setting; `high=None` means unbounded."""

    kind: type
    low: float
    high: float | None = None
    low_inclusive: bool = True
    # Values between `low` and this are refused (e.g. a temperature of 1e-300, which
    # overflows the logits): `low` itself, or at least this.
    gap_above_low: float | None = None

    def check(self, key: str, value: Any) -> Any:
        try:
            if self.kind is int:
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
                value = int(value)
            else:
                value = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key} must be {self.describe()}, got {value!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be {self.describe()}, got {value!r}")
        too_low = value < self.low if self.low_inclusive else value <= self.low
        if self.gap_above_low is not None and self.low < value < self.gap_above_low:
            raise ConfigError(
                f"{key} must be {_fmt(self.low)} or at least {_fmt(self.gap_above_low)}, got {value!r}"
            )
        if too_low or (self.high is not None and value > self.high):
            raise ConfigError(f"{key} must be {self.describe()}, got {value!r}")
        return value

    def describe(self) -> str:
        name = "an integer" if self.kind is int else "a number"
        lo = ("≥ " if self.low_inclusive else "> ") + _fmt(self.low)
        if self.high is None:
            return f"{name} {lo}"
        return f"{name} {lo} and ≤ {_fmt(self.high)}"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


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


UNSET_TEXT = "server's default"
"""How a setting in `SamplingConfig.unset` is shown: only a chat with a server leaves any."""


@dataclass
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy.

    `unset` names the settings nobody gave, left to whoever answers: a server applies its own
    defaults (its model's preset) to the fields a request leaves out. Their values here are
    placeholders, never sent nor shown; `with_value` sets one."""

    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    repetition_penalty: float = 1.1
    max_new_tokens: int = 512
    seed: int | None = None
    stream_interval: int = 1
    unset: frozenset[str] = frozenset()
    # None: free text; else the answer is held to this format (constrained decoding).
    output_format: OutputFormat | None = None

    RANGES: ClassVar[dict[str, Range]] = {
        "temperature": Range(float, 0.0, 100.0, gap_above_low=0.01),
        "top_p": Range(float, 0.0, 1.0, low_inclusive=False),
        "top_k": Range(int, 0),
        "repetition_penalty": Range(float, 0.01, 10.0),
        "max_new_tokens": Range(int, 1, 1_000_000),
        "seed": Range(int, 0, 2**63 - 1),
        "stream_interval": Range(int, 1, 1000),
    }

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
            if value is None and key == "seed":
                continue
            setattr(self, key, rng.check(key, value))
        return self

    def given(self) -> dict[str, Any]:
        """The settings not left to the server (`unset`), by name (the seed: when set)."""
        return {
            key: getattr(self, key)
            for key in self.RANGES
            if key not in self.unset and (key != "seed" or self.seed is not None)
        }

    def shown(self, key: str) -> str:
        """A setting's value as /set lists it."""
        if key == FORMAT_KEY:
            return "text" if self.output_format is None else self.output_format.describe()
        if key in self.unset:
            return UNSET_TEXT
        value = getattr(self, key)
        return "random" if key == "seed" and value is None else str(value)

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
        if key == "seed" and isinstance(raw, str) and raw.lower() in ("none", "off", "random"):
            return dataclasses.replace(self, seed=None, unset=self.unset - {key})
        value = self.RANGES[key].check(key, raw)
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

    prefill_chunk: int = 512
    enable_streaming: bool = False
    start_size: int = 4
    recent_size: int | None = None  # None: derived from the model's context (`recent_window`)
    keep_system: bool | None = None  # None: on when a system prompt is set
    max_context: int | None = None  # None: the model's max_position_embeddings

    # The numeric settings (None, where a field allows it, is not checked against these).
    RANGES: ClassVar[dict[str, Range]] = {
        "prefill_chunk": Range(int, 1, MAX_TOKENS),
        "start_size": Range(int, 0, MAX_TOKENS),
        "recent_size": Range(int, 16, MAX_TOKENS),
        "max_context": Range(int, 16, MAX_TOKENS),
    }

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

    def options(self) -> dict[str, Any]:
        """The keyword arguments of `load_model` besides the source."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}


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
    max_new_tokens: int | None = None
    seed: int | None = None
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
