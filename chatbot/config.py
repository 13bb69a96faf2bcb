"""Settings as dataclasses, with the validation shared by flags, presets and /set."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from chatbot.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric setting; `high=None` means unbounded."""

    kind: type
    low: float
    high: float | None = None
    low_inclusive: bool = True

    def check(self, key: str, value: Any) -> Any:
        try:
            if self.kind is int:
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
                value = int(value)
            else:
                value = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be {self.describe()}, got {value!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{key} must be {self.describe()}, got {value!r}")
        too_low = value < self.low if self.low_inclusive else value <= self.low
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


@dataclass
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy."""

    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    repetition_penalty: float = 1.1
    max_new_tokens: int = 512
    seed: int | None = None
    stream_interval: int = 1

    RANGES = {
        "temperature": Range(float, 0.0, 100.0),
        "top_p": Range(float, 0.0, 1.0, low_inclusive=False),
        "top_k": Range(int, 0),
        "repetition_penalty": Range(float, 0.0, 10.0, low_inclusive=False),
        "max_new_tokens": Range(int, 1, 1_000_000),
        "seed": Range(int, 0, 2**63 - 1),
        "stream_interval": Range(int, 1, 1000),
    }

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validated(self) -> SamplingConfig:
        """Return self after checking every field against its range.

        Raises:
            ConfigError: naming the key and the allowed range.
        """
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "seed":
                continue
            setattr(self, f.name, self.RANGES[f.name].check(f.name, value))
        return self

    def with_value(self, key: str, raw: Any) -> SamplingConfig:
        """A copy with one setting changed, parsed from text or a number.

        Raises:
            ConfigError: for an unknown key or a value outside its range.
        """
        key = key.replace("-", "_")
        if key not in self.RANGES:
            raise ConfigError(f"unknown setting {key!r}; settings: {', '.join(self.RANGES)}")
        if key == "seed" and isinstance(raw, str) and raw.lower() in ("none", "off", "random"):
            return dataclasses.replace(self, seed=None)
        value = self.RANGES[key].check(key, raw)
        return dataclasses.replace(self, **{key: value})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class EngineConfig:
    """How the engine runs the model: chunking, streaming cache, context limits."""

    prefill_chunk: int = 512
    enable_streaming: bool = False
    start_size: int = 4
    recent_size: int | None = None  # None: derived from the model's context
    keep_system: bool | None = None  # None: on when a system prompt is set
    max_context: int | None = None  # None: the model's max_position_embeddings

    def validated(self) -> EngineConfig:
        Range(int, 1).check("prefill_chunk", self.prefill_chunk)
        Range(int, 0).check("start_size", self.start_size)
        if self.recent_size is not None:
            Range(int, 16).check("recent_size", self.recent_size)
        if self.max_context is not None:
            Range(int, 16).check("max_context", self.max_context)
        return self


@dataclass
class ChatConfig:
    """Everything a chat session needs besides the model."""

    system: str | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
