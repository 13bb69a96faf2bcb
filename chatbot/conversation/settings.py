"""How a logged chat ran, and `--resume` bringing it back.

A session log's first line (and each `resume` line) records the settings a chat needs to go
on as it was: the model and template it was loaded with (`load`), its cache (`engine`: a
streaming cache's sinks and window, the context limit), besides the system prompt and the
sampling (`settings`) it always had. `chatbot run --resume` takes them back for every setting
its command line does not give; a flag given wins, and one note says what came back and what
the command line changed.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatbot.config import OPTIONAL, EngineConfig, SamplingConfig
from chatbot.errors import ConfigError
from chatbot.settings import layer

if TYPE_CHECKING:
    from chatbot.config import ChatConfig
    from chatbot.models.presets import Settings

LOADED = ("model", "template")  # of LoadConfig
ENGINE = tuple(s.name for s in layer("engine") if s.resumed)  # of EngineConfig
SAMPLING = tuple(s.name for s in layer("sampling") if s.resumed)
RESUMED = (*LOADED, "system", *ENGINE, *SAMPLING)
"""The settings a resumed chat takes from its log, by name (`RunConfig.setting_names`)."""


def _absolute(source: str | None) -> str | None:
    """A path as an absolute one (a resume may start elsewhere); a hub id or name as it is."""
    if source is None or not Path(source).expanduser().exists():
        return source
    return str(Path(source).expanduser().resolve())


def run_record(config: ChatConfig) -> dict[str, Any]:
    """What a log line records of how a local model's chat runs: `load` (model and
    template, where known) and `engine` (the cache)."""
    record: dict[str, Any] = {"engine": {name: getattr(config.engine, name) for name in ENGINE}}
    if config.load is not None:
        record["load"] = {name: _absolute(getattr(config.load, name)) for name in LOADED}
    return record


def _check(name: str, value: Any) -> Any:
    """`value` as the setting `name` takes it, or ConfigError."""
    if name in SAMPLING:
        return value if name in OPTIONAL and value is None else SamplingConfig.RANGES[name].check(name, value)
    if name in ("enable_streaming", "keep_system"):
        if isinstance(value, bool) or (value is None and name == "keep_system"):
            return value
        raise ConfigError(f"{name} must be true or false")
    if name in ENGINE:
        if value is None and name != "start_size":
            return None
        return EngineConfig.RANGES[name].check(name, value)
    if value is None or isinstance(value, str):  # model, template, system
        if name == "template" and value is not None:
            from chatbot.models.templates import TEMPLATE_CHOICES

            # A log is not trusted to name files: a template comes back by name, never from
            # a path (a crafted log's "/etc/shadow" went into the cache).
            if value not in TEMPLATE_CHOICES:
                raise ConfigError(f"template {value!r} is not a template's name")
        return value
    raise ConfigError(f"{name} must be text")


def logged_settings(state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The settings a replayed log (`session_log.replay`) recorded, by name, each checked;
    and the names of those it recorded wrongly (left out). A log written before the `load`
    and `engine` records gives only its system prompt and sampling."""
    recorded: dict[str, Any] = {}
    for section, names in (("load", LOADED), ("engine", ENGINE), ("settings", SAMPLING)):
        values = state.get(section)
        if isinstance(values, dict):
            recorded.update({name: values[name] for name in names if name in values})
    if "system" in state:
        recorded["system"] = state["system"]
    good, bad = {}, []
    for name, value in recorded.items():
        try:
            good[name] = _check(name, value)
        except (ConfigError, TypeError, ValueError):
            bad.append(name)
    return good, bad


def _flag(name: str, value: Any) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    if value is None:
        return f"{flag} (default)"
    if isinstance(value, float):
        return f"{flag} {value:g}"
    if name == "system":
        text = " ".join(value.split())
        return f"{flag} {text if len(text) <= 30 else text[:29] + '…'!r}"
    return f"{flag} {value}"


def _otherwise(settings: Settings, name: str) -> Any:
    value = settings[name]
    return getattr(SamplingConfig, name) if value is None and name in SAMPLING else value


def _names_a_file(value: str) -> bool:
    return "/" in value or os.sep in value or value.endswith((".jinja", ".j2")) or value.startswith("~")


def resume_settings(
    settings: Settings, state: dict[str, Any], explicit: set[str]
) -> tuple[Settings, str | None]:
    """`settings` with the logged ones (`logged_settings`) in place of those the command line
    did not give (`explicit`: the names of the flags given), and the note to print: which
    settings came back (those that differ from what this run had otherwise) and which flags
    given changed a logged one. None: nothing changed."""
    logged, bad = logged_settings(state)
    back = {name: v for name, v in logged.items() if name not in explicit and v != settings[name]}
    overridden = [
        name for name in RESUMED if name in logged and name in explicit and logged[name] != settings[name]
    ]
    config = settings.config.replaced(back)
    origin = {**settings.origin, **dict.fromkeys(back, "session")}
    resumed = dataclasses.replace(settings, config=config, origin=origin)
    # (a sampling setting left to the model is named where it differs from the built-in
    # default: the model's own, its generation_config's, is not known before it loads)
    named = [n for n in RESUMED if n in back and back[n] != _otherwise(settings, n)]
    parts = []
    if named:
        parts.append("the session's settings come back: " + ", ".join(_flag(n, back[n]) for n in named))
    if overridden:
        changed = ", ".join(
            f"{_flag(n, settings[n])} (the session's: {_flag(n, logged[n])})" for n in overridden
        )
        parts.append("the command line's win: " + changed)
    template = state.get("load", {}).get("template") if isinstance(state.get("load"), dict) else None
    if "template" in bad and isinstance(template, str) and _names_a_file(template):
        bad.remove("template")
        parts.append(f"the log's template {template} is a file: not read (--template FILE reads it)")
    if bad:
        parts.append(f"the log's {', '.join(bad)} not valid, left out")
    return resumed, ("note: " + "; ".join(parts)) if parts else None
