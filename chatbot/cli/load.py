"""What the commands that run a model share: the steps from flags to a loaded model and engine
(settings resolved, threads, the backend, the load with its status line), and what is said
about them (the banner, the context and streaming notes)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from chatbot.config import EngineConfig
from chatbot.errors import ConfigError
from chatbot.terminal.tty import line_console

if TYPE_CHECKING:
    from chatbot.config import RunConfig
    from chatbot.engine.backends.base import Backend
    from chatbot.engine.generate import Engine
    from chatbot.models.presets import Settings


def make_backend(model: Any, opt: str) -> tuple[Backend, str | None]:
    """The backend for --opt (`chatbot.engine.backends.choose.backend_for`), and a note when the one
    asked for is off (None where the user need not hear it)."""
    from chatbot.engine.backends.choose import backend_for
    from chatbot.engine.backends.native.kernels import failure

    backend, reason = backend_for(model, opt)
    on_cpu = model.get_input_embeddings().weight.device.type == "cpu"
    missing = failure()
    if reason and missing and missing in reason and getattr(model, "chatbot_gguf", None):
        return backend, None  # the GGUF loader's note said so already
    return backend, reason if reason and (opt != "auto" or on_cpu) else None


def check_threads(threads: int | None) -> int | None:
    """--threads, capped at the cores here (with a note); checked before the model loads."""
    cores = os.cpu_count() or 1
    if threads and threads > cores:  # more threads than cores only make them wait for each other
        line_console(stderr=True).print(
            f"note: --threads {threads} is more than the {cores} cores here; using {cores}", markup=False
        )
        return cores
    return threads


def set_threads(threads: int | None) -> None:
    import torch

    if not threads:
        # Default: the CPUs left free by other busy processes (engine/backends/native/threads.py): a thread
        # descheduled for another process stalls its partners at every barrier.
        from chatbot.engine.backends.native.threads import default_threads

        torch.set_num_threads(default_threads(most=torch.get_num_threads()))
        return
    torch.set_num_threads(check_threads(threads) or threads)


def load_with_status(model: str | None, device: str, dtype: str, quiet: bool = False, **options: Any) -> Any:
    """`load_model`, under a status line on a terminal (unless `quiet`) that names the load's
    current wait (`chatbot.progress`: the kernels' first build, a GGUF file's first read)."""
    from chatbot.models.loader import load_model
    from chatbot.progress import listen

    err = Console(stderr=True)
    if not quiet and sys.stderr.isatty():
        with err.status("loading model…") as status:

            def show(what: str | None) -> None:
                status.update(f"{what}…" if what else "loading model…")

            with listen(show):
                return load_model(model, device=device, dtype=dtype, **options)
    return load_model(model, device=device, dtype=dtype, **options)


def resolve_cli_settings(ctx: typer.Context, preset: str | None, config: Path | None) -> Settings:
    """Defaults < the preset (--preset/--config) < a resumed session's (`run --resume`, where
    one is given: `chatbot.conversation.settings`) < the flags given on the command line."""
    from chatbot.models.presets import resolve_settings, select_preset
    from chatbot.models.templates import check_template_choice

    chosen = select_preset(preset, config, ctx.params.get("model"))
    # typer vendors its own click: compare the sources by name
    sources = {name: getattr(ctx.get_parameter_source(name), "name", "DEFAULT") for name in ctx.params}
    given = {name for name, source in sources.items() if source not in ("DEFAULT", "DEFAULT_MAP")}
    typed = set(given)  # what the command line says, --model NAME of a preset too
    if chosen is not None and not (preset or config):
        given.discard("model")  # --model named the preset
    flags = dict(ctx.params)
    if flags.get("greedy"):
        flags["temperature"] = 0.0
        given.add("temperature")
        typed.add("temperature")
    flags["draft"], draft_model = split_draft(flags.get("draft"))
    if draft_model is not None:
        check_draft(draft_model)
        flags["draft_model"] = draft_model
        given.add("draft_model")
    settings = resolve_settings(chosen, flags, given)
    if ctx.params.get("resume") is not None and ctx.params.get("server") is None:
        settings = _resumed(settings, ctx.params["resume"], typed)
    check_template_choice(settings["template"])
    return settings


def _resumed(settings: Settings, ref: str, typed: set[str]) -> Settings:
    """`settings` with those of the logged session `ref` that no flag gives, and a note."""
    from chatbot.conversation.log import replay, resolve_resume
    from chatbot.conversation.settings import resume_settings

    path = resolve_resume(ref)
    assert path is not None
    settings, note = resume_settings(settings, replay(path), typed)
    if note:
        line_console(stderr=True).print(note, markup=False)
    return settings


def make_engine(loaded: Any, config: EngineConfig, backend: Backend) -> Engine:
    """The model runner on `backend`, limited to `config.max_context` tokens (None: the
    model's context)."""
    from chatbot.engine.generate import Engine

    return Engine(loaded.model, loaded.tokenizer, max_context=config.max_context, backend=backend)


_IMPORTED = time.monotonic()  # where /proc cannot say when the process started


def seconds_since_start() -> float:
    """Seconds since this process started (what a user waited since the command), from
    /proc where there is one, else since this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rpartition(")")[2].split()
        with open("/proc/uptime", encoding="ascii") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def banner_line(loaded: Any, engine: Engine, opt: str) -> str:
    """The one line `chatbot run` shows on a terminal once the model is loaded; its "ready
    in" is the time since the command (imports too), the model's own load beside it."""
    d = loaded.describe()
    quant = f" · {d['quantization']}" if d["quantization"] != "none" else ""
    decoder = engine.decoder
    if decoder is not None:
        decode = f"native {decoder.info().activations} ({opt})"
    else:
        decode = "compiled (torch.compile)" if engine.compiled else "transformers"
    return (
        " · ".join(f"{d[k]}" for k in ("model", "parameters", "dtype", "device"))
        + quant
        + f" · context {d['context']} · template {d['template']} · "
        + f"ready in {seconds_since_start():.1f} s (load {d['load time']})"
        + f" · decode: {decode}"
    )


def context_note(loaded: Any, config: EngineConfig) -> str | None:
    """A warning when `--max-context` goes past the positions the model was trained on."""
    trained = getattr(loaded.model.config, "max_position_embeddings", None)
    if config.max_context is None or not trained or config.max_context <= trained:
        return None
    return (
        f"note: --max-context {config.max_context:,} is more than the model's context "
        f"({trained:,} tokens); answers past it are likely to degrade"
    )


def streaming_note(engine: Any, config: EngineConfig) -> str | None:
    """A note when --enable-streaming takes a smaller recent window than usual by default,
    so that the cache fits in the model's sliding window (gemma)."""
    if not config.enable_streaming or config.recent_size is not None:
        return None
    from chatbot.engine.cache.sinks import streaming_window

    limit = config.max_context or engine.max_context
    window = streaming_window(engine.model)
    recent = config.recent_window(limit, window)
    if window is None or recent == config.recent_window(limit):
        return None
    return (
        f"note: this model's sliding-window layers attend to {window:,} tokens, so --enable-streaming "
        f"keeps {config.start_size} sinks + {recent:,} recent tokens (the rest of the window is for "
        "a pinned system prompt; --recent-size to change)"
    )


def resolve_api_key(var: str | None) -> str | None:
    """The API key in the environment variable `var` (None: no key)."""
    if var is None:
        return None
    key = os.environ.get(var, "").strip()
    if not key:
        raise ConfigError(f"--api-key-env {var}: the environment variable {var} is not set or empty")
    return key


def exit_if_failed(repl: Any, interactive: bool) -> None:
    """A piped chat exits with 1 when a message (or /retry, /continue) got no answer: its
    error line was printed where it happened, and the lines after it were still run."""
    if not interactive and repl.failed:
        sys.exit(1)  # not typer's Exit: `main` runs click with standalone_mode=False


def in_background(work: Callable[[], Any]) -> Future[Any]:
    """Run `work` in a daemon thread; its result or exception goes to the future."""
    future: Future[Any] = Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which reports it
            future.set_exception(exc)

    threading.Thread(target=run, name="chatbot-load", daemon=True).start()
    return future


def fetch_hub_gguf(config: RunConfig) -> RunConfig:
    """`config` with a hub GGUF's `--model` (`user/repo:QUANT`, `user/repo/file.gguf`)
    downloaded now, in the foreground with huggingface_hub's progress bars, and named by its
    local file (as is when it names none).

    Raises:
        ModelLoadError: `chatbot.models.hub.resolve`'s one line.
    """
    from dataclasses import replace

    from chatbot.models.hub import parse_ref, resolve

    ref = parse_ref(config.load.model) if config.load.model else None
    if ref is None or Path(config.load.model or "").exists():
        return config
    path = resolve(ref, config.load.revision)
    return replace(config, load=replace(config.load, model=str(path), revision=None))


DRAFT_WORDS = ("ngram", "model", "off")


def split_draft(value: Any) -> tuple[Any, str | None]:
    """--draft's value as (the setting's word, the draft model to load): anything but one of
    `DRAFT_WORDS` names a draft model (a file, a folder, a hub id), and the word is then
    "model"."""
    if value is None or str(value).strip().lower() in DRAFT_WORDS:
        return value, None
    return "model", str(value)


def check_draft(ref: str) -> None:
    """A draft model's file or folder checked before any load, as `--model`'s is.

    Raises:
        ConfigError: one line naming --draft and what is wrong.
    """
    from chatbot.errors import ModelLoadError
    from chatbot.models.source import check_source

    try:
        check_source(ref, tables=False)
    except ModelLoadError as e:
        raise ConfigError(f"--draft {ref}: {e}") from e


def attach_draft(engine: Engine, load: Any, opt: str, quiet: bool = False) -> str | None:
    """Load `load.draft_model` (`--draft FILE`) on a backend of its own, check that it has
    the model's vocabulary, and give it to `engine`; the line that says so (None: none given).

    Raises:
        ConfigError: its tokenizer is another vocabulary (one line, naming the difference).
        ModelLoadError: it does not load (as `--model` would say).
    """
    if not load.draft_model:
        return None
    from chatbot.engine.draft_model import DraftModel, VocabularyMismatch, check_vocabulary
    from chatbot.engine.generate import Engine
    from chatbot.models.hub import parse_ref, resolve

    ref = load.draft_model
    hub = parse_ref(ref)
    if hub is not None and not Path(ref).exists():
        ref = str(resolve(hub, None))  # a hub GGUF, downloaded as --model's is
    draft = load_with_status(ref, load.device, load.dtype, quiet=quiet, template="auto")
    try:
        check_vocabulary(engine.tokenizer, draft.tokenizer)
    except VocabularyMismatch as e:
        raise ConfigError(f"--draft {load.draft_model}: {e}; a draft needs the model's tokenizer") from e
    backend, _ = make_backend(draft.model, opt)
    draft_engine = Engine(draft.model, draft.tokenizer, max_context=engine.max_context, backend=backend)
    engine.draft_model = DraftModel(draft_engine, draft.name)
    return f"draft model: {draft.name} ({draft.describe()['parameters']}), guesses checked in one pass"


def draft_sampling(engine: Engine, sampling: Any) -> tuple[Any, str | None]:
    """`sampling` with `draft model` turned off where no draft model is loaded (a preset or a
    resumed chat asked for one), and the note that says so."""
    if sampling.draft != "model" or engine.draft_model is not None:
        return sampling, None
    from dataclasses import replace

    note = "note: draft model: none is loaded (--draft FILE or hub id), so drafting is off"
    return replace(sampling, draft="off"), note
