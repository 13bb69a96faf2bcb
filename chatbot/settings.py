"""The sampling and cache settings, one row each: name, type, range, default, help, the
`/set` aliases, the preset key, the OpenAI request field, and the layer it belongs to.

Everything that names a setting reads this table: the dataclasses of `chatbot.config` (their
defaults and ranges), the CLI flags (`chatbot.cli.options.setting_options`), `/set`
(`chatbot.terminal.commands`), presets (`chatbot.models.presets`), `--resume`
(`chatbot.conversation.settings`), `serve`'s requests (`chatbot.server.protocol`), the remote client
(`chatbot.conversation.remote_backend`) and the status line. Adding a setting is a row here, a field of its
dataclass, the code that uses it (a sampler) and a test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from chatbot.errors import ConfigError

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


@dataclass(frozen=True)
class Choice:
    """Allowed values of a setting that is one of a few words (`Range`'s interface)."""

    values: tuple[str, ...]
    kind: type = str

    def check(self, key: str, value: Any) -> str:
        word = str(value).strip().lower()
        if word not in self.values:
            raise ConfigError(f"{key} must be {self.describe()}, got {value!r}")
        return word

    def describe(self) -> str:
        return "one of " + ", ".join(self.values)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Setting:
    """One setting.

    Attributes:
        name: its name everywhere: the dataclass field, the preset key (within `preset`'s
            section), `--name-with-dashes`, `/set name`.
        kind: float, int or bool.
        layer: "sampling" (`SamplingConfig`) or "engine" (`EngineConfig`).
        default: the built-in value (None: derived, or off).
        help: the flag's help; `{default}` is replaced by `default`.
        range: the values allowed (None: a bool).
        inherited: the flag's default is None: the value comes from the preset, else the
            model, else `default` (the sampling a model ships).
        from_model: the model's generation_config may give it (its attribute of that name).
        aliases: other names `/set` takes.
        preset: its key in a preset: "sampling.NAME", "streaming.KEY" or "NAME" at the top;
            None: a flag of `run` only.
        resumed: a resumed chat takes it back from its log.
        request: its field in an OpenAI-style request (None: none); `extra` says it is not
            OpenAI's own (vLLM's, llama-server's: a client sends it in `extra_body`).
        openai_default: its value for a request that asks for OpenAI's sampling (one that sets
            temperature or top_p): OpenAI has no such setting, so it is off.
        serve: a flag of `serve` too; a text: its help there.
        brief: how the status line shows it (a format of the value; None: not shown).
        brief_sampled: shown only when sampling (not greedy).
        brief_off: a value that is not shown (the setting is off).
    """

    name: str
    kind: type
    layer: str
    default: Any
    help: str
    range: Range | Choice | None = None
    inherited: bool = False
    from_model: bool = False
    aliases: tuple[str, ...] = ()
    preset: str | None = None
    resumed: bool = True
    request: str | None = None
    extra: bool = False
    openai_default: Any = None
    serve: bool | str = False
    brief: str | None = None
    brief_sampled: bool = False
    brief_off: Any = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def help_text(self) -> str:
        return self.help.format(default=self.default)


_FROM = "(default: the preset's, else the model's, else {default})"

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "temperature", float, "sampling", 0.7,
        f"Sampling temperature; 0 is greedy {_FROM}.",
        Range(float, 0.0, 100.0, gap_above_low=0.01),
        inherited=True, from_model=True, aliases=("temp", "t"), preset="sampling.temperature",
        request="temperature", openai_default=1.0, serve="Default temperature (requests may set their own).",
        brief="temp {:g}", brief_sampled=True,
    ),
    Setting(
        "top_p", float, "sampling", 0.9,
        f"Nucleus sampling mass (0, 1] {_FROM}.",
        Range(float, 0.0, 1.0, low_inclusive=False),
        inherited=True, from_model=True, aliases=("p", "topp"), preset="sampling.top_p",
        request="top_p", openai_default=1.0, brief="top-p {:g}", brief_sampled=True,
    ),
    Setting(
        "top_k", int, "sampling", 50,
        f"Sample among the k likeliest tokens; 0 turns it off {_FROM}.",
        Range(int, 0),
        inherited=True, from_model=True, aliases=("k", "topk"), preset="sampling.top_k",
        request="top_k", extra=True, openai_default=0, brief="top-k {}", brief_sampled=True,
    ),
    Setting(
        "repetition_penalty", float, "sampling", 1.1,
        f"Penalty for tokens already in the conversation; 1 turns it off {_FROM}.",
        Range(float, 0.01, 10.0),
        inherited=True, from_model=True, aliases=("rep", "repeat_penalty"),
        preset="sampling.repetition_penalty", request="repetition_penalty", extra=True,
        openai_default=1.0, brief="rep {:g}", brief_off=1.0,
    ),
    Setting(
        "repeat_last_n", int, "sampling", 64,
        "How many of the last tokens the repetition penalty looks at; 0 turns it off, -1 is the "
        "whole conversation (default: the preset's, else {default}).",
        Range(int, -1, MAX_TOKENS),
        inherited=True, aliases=("last_n", "penalty_last_n"), preset="sampling.repeat_last_n",
        request="repeat_last_n", extra=True,
    ),
    Setting(
        "max_new_tokens", int, "sampling", 512,
        "Most tokens per answer (default: the preset's, else {default}).",
        Range(int, 1, 1_000_000),
        inherited=True, aliases=("max", "max_tokens", "n"), preset="sampling.max_new_tokens",
        request="max_tokens", serve="Default max_tokens of a request.", brief="max {}",
    ),
    Setting(
        "seed", int, "sampling", None,
        "Random seed for reproducible sampling.",
        Range(int, 0, 2**63 - 1),
        inherited=True, preset="sampling.seed", request="seed", brief="seed {}",
    ),
    Setting(
        "think", str, "sampling", None,
        "A thinking model's thinking: on, off, or an effort (low, medium, high), passed to its chat "
        "template (enable_thinking, reasoning_effort); default: the model's own.",
        Choice(("on", "off", "low", "medium", "high")),
        inherited=True, preset="sampling.think", brief="think {}",
    ),
    Setting(
        "think_budget", int, "sampling", None,
        "Most thinking tokens per answer: then the thinking is closed and the model answers; "
        "0 answers at once (default: no limit).",
        Range(int, 0, MAX_TOKENS),
        inherited=True, aliases=("reasoning_budget",), preset="sampling.think_budget",
        request="think_budget", extra=True, serve="Default thinking budget of a request (tokens).",
        brief="think budget {}",
    ),
    Setting(
        "draft", str, "sampling", "off",
        "Speculative decoding: ngram drafts the next tokens from the conversation (prompt lookup, "
        "no second model), FILE or a hub id loads a small model of the same vocabulary that "
        "guesses them (then: model); the guesses are checked in one pass: the same answer, "
        "faster where they are right.",
        Choice(("ngram", "model", "off")),
        aliases=("speculative",), preset="sampling.draft", request="draft", extra=True,
        serve="Speculative decoding for requests that do not choose (ngram, off, or a draft model's "
        "FILE or hub id: then model).",
        brief="draft {}", brief_off="off",
    ),
    Setting(
        "draft_tokens", int, "sampling", 8,
        "Most tokens one n-gram draft proposes (with --draft ngram; fewer while they are "
        "rejected).",
        Range(int, 1, 15),
        preset="sampling.draft_tokens", request="draft_tokens", extra=True,
    ),
    Setting(
        "stream_interval", int, "sampling", 1,
        "Show text every N tokens.",
        Range(int, 1, 1000),
        aliases=("interval",), preset="sampling.stream_interval", resumed=False,
    ),
    Setting(
        "prefill_chunk", int, "engine", 512,
        "Prefill long inputs in chunks of this many tokens.",
        Range(int, 1, MAX_TOKENS),
        resumed=False, serve=True,
    ),
    Setting(
        "enable_streaming", bool, "engine", False,
        "Attention sinks + recent window: chat forever in bounded memory.",
        preset="streaming.enable", serve="Each conversation on an attention-sink cache: no context limit.",
    ),
    Setting(
        "start_size", int, "engine", 4,
        "Attention-sink tokens kept at the start (with --enable-streaming).",
        Range(int, 0, MAX_TOKENS),
        preset="streaming.start_size", serve=True,
    ),
    Setting(
        "recent_size", int, "engine", None,
        "Recent tokens kept (with --enable-streaming; default: a quarter of the context, at most 2000).",
        Range(int, 16, MAX_TOKENS),
        preset="streaming.recent_size", serve=True,
    ),
    Setting(
        "keep_system", bool, "engine", None,
        "Pin the system prompt in the streaming cache (default: on when --system is set).",
        preset="streaming.keep_system",
    ),
    Setting(
        "max_context", int, "engine", None,
        "Most tokens the conversation may hold (default: the model's context).",
        Range(int, 16, MAX_TOKENS),
        preset="max_context", serve=True,
    ),
)  # fmt: skip

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def layer(name: str) -> tuple[Setting, ...]:
    """The settings of one layer ("sampling", "engine"), in table order."""
    return tuple(s for s in SETTINGS if s.layer == name)


def default(name: str) -> Any:
    """A setting's built-in value."""
    return BY_NAME[name].default


def ranges(name: str) -> dict[str, Range | Choice]:
    """The ranges of a layer's numeric settings, by name."""
    return {s.name: s.range for s in layer(name) if s.range is not None}


def preset_section(section: str) -> dict[str, str]:
    """A preset section's keys ("sampling", "streaming") and the settings they give."""
    prefix = section + "."
    keys = {s.preset: s.name for s in SETTINGS if s.preset and s.preset.startswith(prefix)}
    return {key.removeprefix(prefix): name for key, name in keys.items()}
