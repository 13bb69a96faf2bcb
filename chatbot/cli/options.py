"""What the `chatbot` commands share: option declarations (each once, as an `Annotated`
alias: `run`, `serve` and `config show` declare no option of their own) and the steps from
flags to a loaded model and engine."""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console

from chatbot.config import EngineConfig
from chatbot.engine.backends.native.threads import apply_wait_policy
from chatbot.errors import ConfigError
from chatbot.models.templates import choices_text
from chatbot.settings import SETTINGS, Setting
from chatbot.terminal.tty import line_console

# Before torch loads libgomp (it reads its wait settings once): threads that wait at a
# barrier spin briefly, then sleep, so a busy machine is not made busier (engine/backends/native/threads.py).
apply_wait_policy()

if TYPE_CHECKING:
    from chatbot.config import RunConfig
    from chatbot.engine.backends.base import Backend
    from chatbot.engine.generate import Engine
    from chatbot.models.presets import Settings

F = TypeVar("F", bound=Callable[..., Any])
KEYWORD = inspect.Parameter.KEYWORD_ONLY


def check_opt(value: str) -> str:
    from chatbot.config import OPT_LEVELS

    if value not in OPT_LEVELS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(OPT_LEVELS)}")
    return value


ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="A transformers folder, a .gguf file, a hub GGUF (user/repo:QUANT or "
        "user/repo/file.gguf, downloaded once), a hub id or a preset name (default: the "
        "embedded SmolLM2-135M-Instruct).",
    ),
]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.")]
DtypeOpt = Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        help="CPU threads (default: the physical cores less those other processes keep busy).", min=1
    ),
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the figures to this JSON file.")]
QuantizeOpt = Annotated[
    str | None,
    typer.Option(help="Quantize the weights while loading with bitsandbytes: 4bit (NF4) or 8bit (LLM.int8)."),
]
DeviceMapOpt = Annotated[
    str | None,
    typer.Option(
        help="Spread a large model over devices (accelerate): auto, balanced, sequential, "
        "or a JSON map of module -> device."
    ),
]
MaxMemoryOpt = Annotated[
    str | None, typer.Option(help="Per-device budget with --device-map, e.g. 0=20GiB,1=20GiB,cpu=64GiB.")
]
RevisionOpt = Annotated[str | None, typer.Option(help="Hub branch, tag or commit of --model.")]
TrustOpt = Annotated[
    bool, typer.Option(help="Run model code shipped with the checkpoint (only for authors you trust).")
]
TemplateOpt = Annotated[
    str | None,
    typer.Option(
        help="Chat template: auto (the model's own, else one its vocabulary names), "
        + choices_text().removeprefix("auto, ")
        + "."
    ),
]
PresetOpt = Annotated[
    str | None, typer.Option(help="A preset by name (see: chatbot models); flags override it.")
]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="A preset file (YAML); flags override it.")]

# The chat settings that `run` and `config show` share (a preset can set each of them too).
SystemOpt = Annotated[str | None, typer.Option(help="System prompt.")]


GreedyOpt = Annotated[
    bool, typer.Option(help="Always pick the likeliest token (same as --temperature 0, which it overrides).")
]


def setting_options(command: str, after: str, moved: dict[str, str] | None = None) -> Callable[[F], F]:
    """Give a command taking `**settings` one option per setting of `chatbot.settings.SETTINGS`
    it has, declared from the table's row (help, type, default), inserted after its parameter
    `after`; typer reads the signature built here.

    Args:
        command: "run" (every setting), "config" (those a preset holds) or "serve" (its own).
        after: the parameter the settings' options follow (`--help` lists them there).
        moved: the command's own parameters to list after a setting's option instead, e.g.
            {"greedy": "seed"}.
    """

    def wanted(row: Setting) -> bool:
        return (
            command == "run"
            or (command == "config" and row.preset is not None)
            or bool(command == "serve" and row.serve)
        )

    def option(row: Setting) -> inspect.Parameter:
        text = row.serve if command == "serve" and isinstance(row.serve, str) else row.help_text()
        optional = row.inherited or row.default is None
        kind: Any = row.kind | None if optional else row.kind
        default = None if row.inherited else row.default
        annotation = Annotated[kind, typer.Option(help=text)]
        return inspect.Parameter(row.name, KEYWORD, default=default, annotation=annotation)

    def decorate(func: F) -> F:
        own = {
            p.name: p
            for p in inspect.signature(func, eval_str=True).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        }
        later = {name: own.pop(name) for name in moved or {}}
        params: list[inspect.Parameter] = []
        for name, param in own.items():
            params.append(param.replace(kind=KEYWORD))
            if name != after:
                continue
            for row in filter(wanted, SETTINGS):
                params.append(option(row))
                params += [later[k].replace(kind=KEYWORD) for k, v in (moved or {}).items() if v == row.name]
        func.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return func

    return decorate


OptOpt = Annotated[
    str,
    typer.Option(
        "--opt",
        help="Decode path: auto (native CPU kernels on the file's own weights; inputs int8 as "
        "llama.cpp's where that is faster, int16 elsewhere: as close to float32 as llama.cpp or "
        "closer), exact (int16 inputs everywhere: near float32), fast (int8 inputs everywhere, "
        "llama.cpp's arithmetic), f32, int8 or int4 "
        "(smaller, lossy), compile (transformers compiled with torch.compile, one step per token "
        "on a static cache: the default on a GPU), off (transformers).",
        callback=check_opt,
    ),
]
DebugOpt = Annotated[bool, typer.Option(help="Show tracebacks.")]


def print_version(value: bool) -> None:
    """`chatbot --version`: a line of versions and the kernels' SIMD level, then exit (no
    model, no torch import, no kernel build)."""
    if not value:
        return
    from chatbot.doctor import version_lines

    print("\n".join(version_lines()))
    raise typer.Exit()


VersionOpt = Annotated[
    bool,
    typer.Option(
        "--version",
        help="Print the versions (chatbot, python, torch, transformers) and the kernels' SIMD "
        "level, and exit.",
        callback=print_version,
        is_eager=True,
    ),
]

# `run`'s own.
PromptArg = Annotated[
    str | None,
    typer.Argument(
        help="Answer this prompt and exit (the answer on stdout, the stats line on stderr); text "
        "piped in goes before it in the same message. Without it: the chat.",
        metavar="PROMPT",
        show_default=False,
    ),
]
PromptOpt = Annotated[
    str | None, typer.Option("--prompt", "-p", help="The prompt, as an option (the same as the argument).")
]
JsonSchemaOpt = Annotated[
    Path | None,
    typer.Option(
        help="Hold every answer to the JSON schema in this file (constrained decoding; "
        "in the chat, /set format json asks for any JSON object).",
        metavar="FILE",
        show_default=False,
    ),
]
PlainOpt = Annotated[bool, typer.Option(help="Print raw text instead of rendered Markdown.")]
NoStatsOpt = Annotated[bool, typer.Option("--no-stats", help="Hide the stats line after each answer.")]
ResumeOpt = Annotated[
    str | None,
    typer.Option(
        help="Continue a logged session: its id (or the start of it), or 'last' "
        "(the default when no value is given)."
    ),
]
ServerOpt = Annotated[
    str | None,
    typer.Option(
        help="Chat with a model on an OpenAI-compatible server (vLLM, SGLang, llama-server, ollama, "
        "chatbot serve), e.g. http://127.0.0.1:8000/v1; --model names it there."
    ),
]
ClientKeyEnvOpt = Annotated[
    str | None, typer.Option(help="With --server: send the API key in this environment variable.")
]

# `serve`'s own; where a name is also `run`'s, its help says what it means for a server.
ServeModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="A transformers folder, a .gguf file or a hub id (default: the embedded SmolLM2-135M-Instruct).",
    ),
]
HostOpt = Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")]
PortOpt = Annotated[int, typer.Option(help="TCP port.", min=1, max=65535)]
ServerKeyEnvOpt = Annotated[
    str | None,
    typer.Option(help="Require 'Authorization: Bearer KEY' on /v1, KEY read from this environment variable."),
]
ServedModelNameOpt = Annotated[
    str | None, typer.Option(help="The model id clients use (default: the model's name).")
]
PrefixCacheOpt = Annotated[
    bool,
    typer.Option(
        help="Keep conversation caches between requests "
        "(a request extending one prefills only its new tokens)."
    ),
]
CacheConversationsOpt = Annotated[
    int, typer.Option(help="Conversation caches kept, least recently used evicted.", min=1)
]
CacheMemoryOpt = Annotated[
    str, typer.Option(help="Cap on the KV cache memory kept between requests, e.g. 2GiB.")
]
ServePresetOpt = Annotated[
    str | None,
    typer.Option(
        help="A preset by name (see: chatbot models): its model and its sampling as the defaults "
        "of requests (default: the default model's preset when no --model is given)."
    ),
]
MaxBodyOpt = Annotated[
    str,
    typer.Option(
        help="Cap on a request body, e.g. 4MiB; a larger one is refused unread (413). "
        "auto: 128 bytes per token of context, at least 1 MiB."
    ),
]
LogLevelOpt = Annotated[
    str, typer.Option(help="uvicorn's log level: warning, info (one line per request), debug.")
]
# Shared by the benches.
TextOpt = Annotated[
    Path | None,
    typer.Option(help="A long plain-text file (default: the Python FAQ text shipped in the package)."),
]
ConversationOpt = Annotated[
    Path | None,
    typer.Option(help='A JSON file {"turns": [...]} (default: the shipped twelve-turn chat).'),
]


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
