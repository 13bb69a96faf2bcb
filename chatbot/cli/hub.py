"""`chatbot pull`, `chatbot rm` and `chatbot models`: models on the hub and on this machine."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from chatbot.errors import ConfigError, ModelLoadError
from chatbot.gguf.table import split_parts

if TYPE_CHECKING:
    from chatbot.models.hub_download import Fetched

NameArg = Annotated[
    str,
    typer.Argument(
        metavar="NAME",
        help="user/repo:QUANT (a GGUF quant, e.g. Q4_K_M), user/repo/file.gguf, user/repo (a "
        "transformers repo) or a preset's name.",
        show_default=False,
    ),
]
RevisionOpt = Annotated[str | None, typer.Option(help="Hub branch, tag or commit.")]


def _hub_name(name: str) -> str:
    """`name`, or the hub model of the preset it names."""
    from chatbot.models.presets import list_presets

    for p in list_presets():
        if p.name.lower() == name.lower():
            if not p.config.load.model:
                raise ModelLoadError(f"the preset {p.name} runs the embedded default model: nothing to pull")
            return p.config.load.model
    return name


def pull(name: NameArg, revision: RevisionOpt = None) -> None:
    """Download a model from the hub (resuming a partial download) and check its files against
    the sha256 the hub names them by (it names none for small git files). Uses huggingface_hub's
    cache, login and HF_ENDPOINT."""
    from chatbot.models import hub
    from chatbot.models.catalog import human_size

    name = _hub_name(name)
    if hub.offline():
        raise ModelLoadError(f"HF_HUB_OFFLINE is set: pulling {name} needs the hub")
    ref = hub.parse_ref(name)
    if ref is None:
        folder, fetched = hub.pull_repo(name, revision)
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        what = f"{len(fetched)} files, {human_size(size)}, {_checked(fetched)}"
        typer.echo(f"pulled {name} ({what}) into {folder}")
        typer.echo(f"run it: chatbot run --model {name}")
        return
    try:
        fetched = hub.fetch(ref, revision)
    except KeyboardInterrupt:
        typer.echo(f"\ninterrupted: the part downloaded is kept; chatbot pull {name} resumes it", err=True)
        raise typer.Exit(130) from None
    first = fetched[0].path
    parts = split_parts(first)
    size = sum(p.stat().st_size for p in parts)
    files = f"{len(parts)} files" if len(parts) > 1 else "1 file"
    typer.echo(f"pulled {ref} ({files}, {human_size(size)}, {_checked(fetched)}): {first}")
    typer.echo(f"run it: chatbot run --model {ref}")


def _checked(fetched: list[Fetched]) -> str:
    """'checked', or which files were not: those the hub named no sha256 for."""
    unchecked = [f.path.name for f in fetched if f.sha256 is None]
    if not unchecked:
        return "checked"
    names = ", ".join(unchecked[:3]) + (f" and {len(unchecked) - 3} more" if len(unchecked) > 3 else "")
    done = len(fetched) - len(unchecked)
    head = f"{done} checked, " if done else ""
    return f"{head}not checked: the hub named no sha256 for {names}"


def rm(name: NameArg) -> None:
    """Remove a downloaded model from the hub cache: one GGUF quant (user/repo:QUANT) or a
    whole repo (user/repo)."""
    from chatbot.models import hub
    from chatbot.models.catalog import human_size

    name = _hub_name(name)
    removed, freed = hub.remove(name)
    typer.echo(f"removed {name} ({removed}, {human_size(freed)} freed)")


def models(
    folders: Annotated[
        list[Path] | None,
        typer.Argument(help="Also look in these folders for model folders and .gguf files."),
    ] = None,
) -> None:
    """List presets (and whether their model is downloaded) and the models on this machine
    (name, size, where)."""
    from chatbot.models.catalog import downloaded, human_size, local_models
    from chatbot.models.presets import list_presets

    for folder in folders or []:
        if not folder.expanduser().is_dir():
            what = "is not a folder" if folder.expanduser().exists() else "does not exist"
            raise ConfigError(f"models: {folder} {what}")
    width = max(40, shutil.get_terminal_size((80, 24)).columns)
    found = local_models(folders)
    here = downloaded(found)
    typer.echo("presets (chatbot run --preset NAME):")
    presets = list_presets()
    col = max((len(p.name) for p in presets), default=0)
    for p in presets:
        model = p.config.load.model
        _entry(f"{p.name:<{col}}", model or "default model", width)
        if model is None:
            _wrapped(p.description, width)
        else:
            state = "downloaded" if model.lower() in here else "downloads on first run"
            _wrapped(f"{p.description} ({state})", width)
    typer.echo("models on this machine (chatbot run --model NAME):")
    if not found:
        typer.echo("  none found")
    col = max((len(m.name) for m in found), default=0)
    for m in found:
        _entry(f"{m.name:<{col}}", f"{human_size(m.size_bytes):>9}  {m.source}", width)
        _wrapped(_home(m.path), width)


def _entry(head: str, rest: str, width: int) -> None:
    """An entry's first line, `head` then `rest`; `rest` goes under it where both do not fit."""
    line = f"  {head}  {rest}"
    if len(line) <= width:
        typer.echo(line)
    else:
        typer.echo(f"  {head.rstrip()}")
        _wrapped(rest.strip(), width)


def _wrapped(text: str, width: int) -> None:
    """`text` under an entry, indented, wrapped between words (a path longer than the line
    is left whole, so that it can be copied)."""
    for line in textwrap.wrap(text, width - 6, break_long_words=False, break_on_hyphens=False):
        typer.echo(f"      {line}")


def _home(path: str) -> str:
    home = str(Path.home())
    return "~" + path[len(home) :] if path.startswith(home + "/") else path
