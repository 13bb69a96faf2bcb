"""Presets: small YAML files that name a model and how to chat with it.

A preset sets any of the `chatbot run` settings; flags given on the command line override
it, and what is left comes from the built-in defaults. The layout (all keys optional):

    description: one line for `chatbot models`
    model: Qwen/Qwen2.5-1.5B-Instruct   # hub id, folder, .gguf file; null: the default model
    revision: main
    trust_remote_code: false
    template: auto                      # auto, a fallback name, or a .jinja file
    system: You are a helpful assistant.
    device: auto
    dtype: auto
    quantize: null                      # 4bit or 8bit
    device_map: null
    max_memory: null
    max_context: null
    sampling: {temperature: 0.7, top_p: 0.9, ...}   # the "sampling.*" keys of chatbot.settings
    streaming: {enable: false, start_size: 4, ...}   # its "streaming.*" keys

Relative paths in `model` and `template` are taken from the preset file's folder. Unknown
keys and bad values are refused with the file, the key and the allowed values.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chatbot.config import QUANTIZE_CHOICES, EngineConfig, Range, RunConfig, SamplingConfig
from chatbot.errors import ConfigError
from chatbot.models.templates import TEMPLATES
from chatbot.settings import Choice, preset_section

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")

# Every setting a preset or a flag can give (the prefill chunk is a flag of `run` only, the
# draft model the value of its --draft); the built-in defaults are those of RunConfig's dataclasses.
PRESET_SETTINGS = tuple(n for n in RunConfig.setting_names() if n not in ("prefill_chunk", "draft_model"))
SAMPLING_KEYS = tuple(preset_section("sampling"))
_TOP_KEYS = (
    "description",
    "model",
    "revision",
    "trust_remote_code",
    "template",
    "system",
    "device",
    "dtype",
    "quantize",
    "device_map",
    "max_memory",
    "max_context",
    "sampling",
    "streaming",
)
# streaming.<key> -> setting name
_STREAMING_KEYS = preset_section("streaming")


@dataclass(frozen=True)
class Preset:
    """A parsed preset: its name, file and the settings it gives (`given`, by name; the
    other fields of `config` keep their defaults)."""

    name: str
    path: Path | None
    description: str = ""
    config: RunConfig = field(default_factory=RunConfig)
    given: frozenset[str] = frozenset()


@dataclass
class Settings:
    """The effective settings of a run and where each came from ("default", "preset", "flag")."""

    config: RunConfig
    origin: dict[str, str]
    preset: Preset | None = None

    def __getitem__(self, key: str) -> Any:
        return self.config.get(key)

    def run_config(self) -> RunConfig:
        """The settings as the one object `chatbot run` passes on.

        Raises:
            ConfigError: a value out of range.
        """
        return self.config.validated()

    def as_yaml(self) -> str:
        """The settings in preset layout, each line commented with its origin: the output
        of `chatbot config show` is itself a valid `--config` file."""
        import yaml

        def line(key: str, value: Any, name: str, indent: str = "") -> str:
            dumped = yaml.safe_dump({key: value}, default_flow_style=True, width=1 << 16).strip()
            dumped = dumped.removeprefix("{").removesuffix("}")
            origin = self.origin[name]
            if value is None and name in SAMPLING_KEYS and origin == "default":
                origin = "default: the model's generation_config, else the built-in value"
            if origin == "preset" and self.preset is not None:
                origin = f"preset {self.preset.name}"
            return f"{indent}{dumped}  # {origin}"

        out = []
        if self.preset is not None:
            where = f" ({self.preset.path})" if self.preset.path else ""
            out.append(f"# preset: {self.preset.name}{where}")
            if self.preset.description:
                # safe_dump ends a lone scalar with "..." (end of document): not in a mapping
                dumped = yaml.safe_dump(self.preset.description, width=1 << 16).strip()
                out.append(f"description: {dumped.removesuffix('...').strip()}")
        for key in _TOP_KEYS:
            if key in ("description", "sampling", "streaming"):
                continue
            out.append(line(key, self[key], key))
        out.append("sampling:")
        out += [line(k, self[k], k, "  ") for k in SAMPLING_KEYS]
        out.append("streaming:")
        out += [line(k, self[name], name, "  ") for k, name in _STREAMING_KEYS.items()]
        return "\n".join(out) + "\n"


# -- finding and reading presets --------------------------------------------------------------


def _shipped_presets() -> Path:
    """The presets that come with chatbot: `chatbot/configs/` where it is installed from a
    wheel (package data), else `configs/` beside the package (a clone, an editable install)."""
    package = Path(__file__).resolve().parents[1]
    installed, checkout = package / "configs", package.parent / "configs"
    return checkout if not installed.is_dir() and checkout.is_dir() else installed


SHIPPED_PRESETS = _shipped_presets()


def preset_dirs() -> list[Path]:
    """Where presets are looked up, first match wins: $CHATBOT_PRESETS, the user's
    `$XDG_CONFIG_HOME/chatbot/presets`, then the presets shipped inside the package
    (`configs/` in a clone, installed as package data `chatbot/configs/`)."""
    dirs = []
    if os.environ.get("CHATBOT_PRESETS"):
        dirs.append(Path(os.environ["CHATBOT_PRESETS"]).expanduser())
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    dirs.append(Path(base) / "chatbot" / "presets")
    dirs.append(SHIPPED_PRESETS)
    return dirs


def list_presets() -> list[Preset]:
    """Every preset found, by name; a broken file is listed with its error as description."""
    found: dict[str, Preset] = {}
    for d in preset_dirs():
        if not d.is_dir():
            continue
        for path in sorted(d.iterdir()):
            if path.suffix not in (".yaml", ".yml") or path.stem.lower() in found:
                continue
            try:
                found[path.stem.lower()] = load_preset_file(path)
            except ConfigError as exc:
                found[path.stem.lower()] = Preset(path.stem, path, f"(broken: {exc})")
    return sorted(found.values(), key=lambda p: (p.name != "default", p.name))


def find_preset(name: str) -> Preset:
    """The preset called `name` (its file name without .yaml, any case).

    Raises:
        ConfigError: no such preset (the message lists the ones there are).
    """
    key = name.lower().removesuffix(".yaml").removesuffix(".yml")
    for d in preset_dirs():
        for suffix in (".yaml", ".yml"):
            if not d.is_dir():
                continue
            for path in d.iterdir():
                if path.suffix == suffix and path.stem.lower() == key:
                    return load_preset_file(path)
    names = ", ".join(p.name for p in list_presets()) or "none found"
    raise ConfigError(f"no preset named {name!r}; presets: {names} (or give a file with --config)")


def load_preset_file(path: str | Path) -> Preset:
    """Read and check a preset file.

    Raises:
        ConfigError: unreadable file, bad YAML, unknown keys or bad values (naming the file
            and the key).
    """
    import yaml

    from chatbot.errors import ChatbotError
    from chatbot.limits import MAX_CONFIG_BYTES, expand, loads_yaml, read_text

    path = expand(path)
    try:  # bounded: --config /dev/zero, a FIFO or a binary file is one line, not a hang
        text = read_text(path, MAX_CONFIG_BYTES, "preset file")
        data = loads_yaml(text, str(path))
    except ChatbotError as exc:
        raise ConfigError(str(exc)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}{at}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a preset is a mapping of keys to values, got {type(data).__name__}")
    return parse_preset(data, path)


def parse_preset(data: dict[str, Any], path: Path | None = None) -> Preset:
    """Check a preset mapping and read it into a Preset (named after its file).

    Raises:
        ConfigError: naming the file, the key and the allowed values.
    """
    where = str(path) if path else "preset"
    base = path.parent if path else Path.cwd()

    def fail(key: str, allowed: str, value: Any) -> ConfigError:
        return ConfigError(f"{where}: {key} must be {allowed}, got {value!r}")

    unknown = [k for k in data if k not in _TOP_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; keys: {', '.join(_TOP_KEYS)}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("description", "sampling", "streaming"):
            continue
        if key in ("trust_remote_code",):
            if not isinstance(value, bool):
                raise fail(key, "true or false", value)
        elif key == "dtype":
            if value not in DTYPES:
                raise fail(key, "one of " + ", ".join(DTYPES), value)
        elif key == "device":
            if not isinstance(value, str) or not _DEVICE.match(value):
                raise fail(key, "auto, cpu, cuda, cuda:N or mps", value)
        elif key == "quantize":
            if value is not None and value not in QUANTIZE_CHOICES:
                raise fail(key, "null, 4bit or 8bit", value)
        elif key == "template":
            if not isinstance(value, str):
                raise fail(key, "auto, " + ", ".join(TEMPLATES) + " or a .jinja file", value)
            if value != "auto" and value not in TEMPLATES:
                if not value.endswith((".jinja", ".j2")):
                    raise fail(key, "auto, " + ", ".join(TEMPLATES) + " or a .jinja file", value)
                value = str((base / Path(value).expanduser()).resolve())
        elif key == "model":
            if value is not None and not isinstance(value, str):
                raise fail(key, "a hub id, a folder, a .gguf file or null (the default model)", value)
            if isinstance(value, str) and value.startswith((".", "~")):
                value = str((base / Path(value).expanduser()).resolve())
        elif key == "max_context":
            if value is not None:
                value = _range_check(where, key, EngineConfig.RANGES[key], value)
        elif key == "max_memory":
            if value is not None and not isinstance(value, (str, dict)):
                raise fail(key, 'a string like "0=20GiB,cpu=64GiB" or a mapping', value)
        elif key == "device_map":
            if value is not None and not isinstance(value, (str, dict)):
                raise fail(key, "auto, balanced, sequential or a mapping of module -> device", value)
        elif value is not None and not isinstance(value, str):  # revision, system
            raise fail(key, "a string", value)
        out[key] = value

    sampling = data.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise fail("sampling", "a mapping", sampling)
    for key, value in sampling.items():
        if key not in SAMPLING_KEYS:
            raise ConfigError(f"{where}: unknown key 'sampling.{key}'; keys: {', '.join(SAMPLING_KEYS)}")
        if value is None:  # unset: the model's generation_config (or the built-in default) decides
            continue
        out[key] = _range_check(where, f"sampling.{key}", SamplingConfig.RANGES[key], value)

    streaming = data.get("streaming") or {}
    if not isinstance(streaming, dict):
        raise fail("streaming", "a mapping", streaming)
    for key, value in streaming.items():
        if key not in _STREAMING_KEYS:
            raise ConfigError(f"{where}: unknown key 'streaming.{key}'; keys: {', '.join(_STREAMING_KEYS)}")
        name = _STREAMING_KEYS[key]
        if key in ("enable", "keep_system"):
            if not isinstance(value, bool) and not (key == "keep_system" and value is None):
                raise fail(
                    f"streaming.{key}", "true or false" + (" or null" if key == "keep_system" else ""), value
                )
        elif value is not None or key == "start_size":
            value = _range_check(where, f"streaming.{key}", EngineConfig.RANGES[name], value)
        out[name] = value
    description = str(data.get("description") or "")
    name = path.stem if path else "preset"
    return Preset(name, path, description, RunConfig().replaced(out), frozenset(out))


def _range_check(where: str, key: str, rng: Range | Choice, value: Any) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be {rng.describe()}, got {value!r}")
    try:
        return rng.check(key, value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# -- merging ----------------------------------------------------------------------------------


def resolve_settings(preset: Preset | None, flags: dict[str, Any], explicit: set[str]) -> Settings:
    """Defaults, then the preset, then the flags given on the command line.

    Args:
        preset: from --preset or --config, or None.
        flags: the values of the command's options (given or defaulted) by setting name.
        explicit: the names of the options the user gave.
    """
    names = RunConfig.setting_names()
    # the command's own defaults (the same as RunConfig's, normally)
    config = RunConfig().replaced({k: v for k, v in flags.items() if k in names and k not in explicit})
    origin = dict.fromkeys(names, "default")
    if preset is not None:
        config = config.replaced({k: preset.config.get(k) for k in preset.given})
        origin.update(dict.fromkeys(preset.given, "preset"))
    given = [k for k in explicit if k in flags and k in names]
    config = config.replaced({k: flags[k] for k in given})
    origin.update(dict.fromkeys(given, "flag"))
    return Settings(config, origin, preset)


def select_preset(preset: str | None, config: str | Path | None, model: str | None = None) -> Preset | None:
    """The preset of `--preset NAME` or `--config FILE` (not both); failing those, `--model`
    when it names a preset rather than a path or a hub id (`--model vicuna`); with no --model
    at all, the `default` preset (the embedded default model's: its sampling suits it).

    Raises:
        ConfigError: both given, or the preset cannot be found or read.
    """
    if preset and config:
        raise ConfigError("give --preset or --config, not both")
    if config:
        return load_preset_file(config)
    if preset:
        return find_preset(preset)
    if (
        model
        and "/" not in model
        and not model.lower().endswith(".gguf")
        and not Path(model).expanduser().exists()
    ):
        try:
            return find_preset(model)
        except ConfigError:
            return None
    if not model:
        return find_preset("default")
    return None
