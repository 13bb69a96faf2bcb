"""The `chatbot` command: flags -> config -> session -> terminal or measurement.

This is the only place where errors become messages: a ChatbotError or a bad flag prints one
line and exits with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.exceptions import Abort, Exit, TyperException

from chatbot.cli.bench import bench_app, eval_ppl
from chatbot.cli.help import HelpGroup
from chatbot.cli.hub import models, pull, rm
from chatbot.cli.load import (
    attach_draft,
    banner_line,
    check_threads,
    context_note,
    draft_sampling,
    exit_if_failed,
    fetch_hub_gguf,
    in_background,
    load_with_status,
    make_backend,
    make_engine,
    resolve_api_key,
    resolve_cli_settings,
    set_threads,
    streaming_note,
)
from chatbot.cli.options import (
    CacheConversationsOpt,
    CacheDirOpt,
    CacheDiskOpt,
    CacheMemoryOpt,
    ClientKeyEnvOpt,
    ConfigOpt,
    DebugOpt,
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    GreedyOpt,
    HideThinkingOpt,
    HostOpt,
    JsonSchemaOpt,
    LogLevelOpt,
    MaxBodyOpt,
    MaxMemoryOpt,
    ModelOpt,
    NoStatsOpt,
    OptOpt,
    PlainOpt,
    PortOpt,
    PrefixCacheOpt,
    PresetOpt,
    PromptArg,
    PromptOpt,
    PruneOpt,
    QuantizeOpt,
    ResumeOpt,
    RevisionOpt,
    ServedModelNameOpt,
    ServeModelOpt,
    ServePresetOpt,
    ServerKeyEnvOpt,
    ServerOpt,
    SessionsLimitOpt,
    ShowThinkingOpt,
    SlotSavePathOpt,
    SystemOpt,
    TemplateOpt,
    ThreadsOpt,
    TrustOpt,
    VersionOpt,
    setting_options,
)
from chatbot.config import EngineConfig, LoadConfig, OutputFormat, RunConfig
from chatbot.errors import ChatbotError, ConfigError
from chatbot.models.gc_pause import pause_until_ready
from chatbot.models.gc_pause import ready as gc_ready
from chatbot.settings import layer
from chatbot.terminal.advice import in_user_words

app = typer.Typer(
    name="chatbot",
    help="Chat with a local language model in the terminal.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    cls=HelpGroup,  # help wrapped between words, commands listed with whole phrases
)

_DEBUG = False


@app.callback()
def options(version: VersionOpt = False) -> None:
    """Chat with a local language model in the terminal."""


@app.command()
@setting_options("run", after="system", moved={"greedy": "seed"})
def run(
    ctx: typer.Context,
    prompt: PromptArg = None,
    model: ModelOpt = None,
    system: SystemOpt = None,
    greedy: GreedyOpt = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = None,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    revision: RevisionOpt = None,
    trust_remote_code: TrustOpt = False,
    template: TemplateOpt = "auto",
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    threads: ThreadsOpt = None,
    opt: OptOpt = "auto",
    plain: PlainOpt = False,
    no_stats: NoStatsOpt = False,
    show_thinking: ShowThinkingOpt = False,
    hide_thinking: HideThinkingOpt = False,
    resume: ResumeOpt = None,
    prompt_option: PromptOpt = None,
    json_schema: JsonSchemaOpt = None,
    server: ServerOpt = None,
    api_key_env: ClientKeyEnvOpt = None,
    debug: DebugOpt = False,
    **settings: Any,
) -> None:
    """Chat with a model; with a PROMPT, answer it and exit. Reads one message per line when
    stdin is not a terminal."""
    global _DEBUG
    _DEBUG = debug
    from chatbot.terminal.oneshot import one_shot_message

    if show_thinking and hide_thinking:
        raise ConfigError("give --show-thinking or --hide-thinking, not both")
    thinking_view = "show" if show_thinking else "hide" if hide_thinking else "fold"
    message = one_shot_message(prompt, prompt_option, None if sys.stdin.isatty() else sys.stdin.buffer)
    output_format = None if json_schema is None else OutputFormat.from_file(json_schema)
    if server is not None:
        overrides = {row.name: settings[row.name] for row in layer("sampling")}
        if greedy:
            overrides["temperature"] = 0.0
        overrides["output_format"] = output_format
        gc_ready()
        from chatbot.cli.remote import run_remote

        run_remote(
            ctx,
            server,
            model,
            api_key_env,
            system,
            overrides,
            settings["enable_streaming"],
            plain,
            no_stats,
            resume,
            message,
            thinking_view,
        )
        return
    if api_key_env is not None:
        raise ConfigError("--api-key-env goes with --server URL")
    # Every setting, resolved and checked once, before the (slow) model load.
    resolved = resolve_cli_settings(ctx, preset, config).run_config()
    if output_format is not None:  # the grammar engine's faults before the (slow) load
        from chatbot.engine.grammar import GrammarError, check_format

        try:
            check_format(output_format)
        except GrammarError as exc:
            raise ConfigError(f"--json-schema {json_schema}: {exc}") from None
    resolved.output_format = output_format
    _chat_locally(resolved, opt, check_threads(threads), plain, no_stats, resume, message, thinking_view)


def _chat_locally(
    settings: RunConfig,
    opt: str,
    threads: int | None,
    plain: bool,
    no_stats: bool,
    resume: str | None,
    message: str | None,
    thinking_view: str = "fold",
) -> None:
    """`chatbot run` on a model here: the REPL, with the model loading behind the prompt on a
    terminal (before the first line on a pipe); with a `message` (a one-shot prompt), its
    answer alone, as on a pipe."""
    from chatbot.conversation.log import resolve_resume
    from chatbot.models.source import check_source
    from chatbot.terminal.oneshot import answer_once
    from chatbot.terminal.repl import Repl
    from chatbot.terminal.repl import run as run_repl
    from chatbot.terminal.tty import make_consoles

    settings = fetch_hub_gguf(settings)  # a download shows its bars before the prompt
    # A wrong path fails now; a damaged file, when its tables are read (after the prompt).
    source = check_source(settings.load.model, tables=False)
    resume_path = resolve_resume(resume)
    interactive = sys.stdin.isatty() and message is None
    out, info = make_consoles(interactive)
    plain = plain or not sys.stdout.isatty()
    logged = {k: v for k, v in settings.sampling.given().items() if k != "stream_interval"}

    def start_log() -> None:
        repl.start_log(resume_path, overrides=logged, system=settings.system)

    if interactive:
        # The prompt comes up now (torch is not imported yet) and the model loads meanwhile; a
        # message sent before it is ready waits for it.
        pending = in_background(lambda: _start_chat(settings, opt, threads, banner=True, background=True))
        repl = Repl.loading(
            pending, source.name, out, plain=plain, show_stats=not no_stats, info=info, on_ready=start_log
        )
        repl.thinking_view = thinking_view
    else:
        chat = _start_chat(settings, opt, threads, banner=False, background=False)
        repl = Repl(chat.session, chat.loaded, out, plain=plain, show_stats=not no_stats, info=info)
        repl.thinking_view = thinking_view
        for note in chat.notes:
            repl.note(note)
        start_log()
        gc_ready()  # the collector, paused by `main` since the start, runs again from here on
    if message is not None:
        sys.exit(answer_once(repl, message))
    try:
        run_repl(repl, interactive)
    finally:
        if repl.pending is not None and not repl.pending.done():
            _leave_while_loading()
    if repl.load_error is not None:
        raise repl.load_error
    exit_if_failed(repl, interactive)


def _leave_while_loading() -> None:
    """Leave at once, the model still loading: a thread inside torch's import (or writing a
    cache) must not run into the interpreter's shutdown. Nothing of the chat is lost: no
    message was sent yet (a sent one waits for the model). Folders being written are removed."""
    from chatbot.models.manifest import remove_partial

    remove_partial()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130 if sys.exc_info()[0] is KeyboardInterrupt else 0)


def _start_chat(settings: Any, opt: str, threads: int | None, banner: bool, background: bool) -> Any:
    """Load the model and make the chat session (`chatbot.terminal.repl.ChatStart`), with the
    notes to show (and the one-line banner on a terminal). `background`: in a thread while the
    prompt is up: no spinner and no progress bars, warnings become notes (printed above the
    prompt, not across it), and the collector is turned back on at the end."""
    if not background:
        return _make_chat(settings, opt, threads, banner, quiet=False)
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    with warnings.catch_warnings(record=True) as caught:  # the filters in force still apply
        start = _make_chat(settings, opt, threads, banner, quiet=True)
    said = dict.fromkeys(f"warning: {' '.join(str(w.message).split())[:300]}" for w in caught)
    start.notes[:0] = list(said)
    gc_ready()  # the collector, paused by `main` since the start, runs again from here on
    return start


def _make_chat(settings: Any, opt: str, threads: int | None, banner: bool, quiet: bool) -> Any:
    set_threads(threads)
    from chatbot.conversation.session import ChatSession, sampling_from_model
    from chatbot.models.templates import check_template
    from chatbot.terminal.repl import ChatStart

    loaded = load_with_status(settings.load.model, quiet=quiet, **settings.load.options())
    check_template(loaded.tokenizer, settings.system, loaded.name)
    backend, backend_note = make_backend(loaded.model, opt)
    engine = make_engine(loaded, settings.engine, backend)
    draft_note = attach_draft(engine, settings.load, opt, quiet)
    sampling = sampling_from_model(loaded.model, **settings.sampling.given())
    sampling, no_draft = draft_sampling(engine, sampling)
    session = ChatSession(engine, settings.chat_config(sampling), loaded.template)
    notes = [backend_note, context_note(loaded, settings.engine), streaming_note(engine, settings.engine)]
    notes += [draft_note, no_draft]
    shown = [*loaded.notes, *filter(None, notes)]
    if banner:
        shown.append(banner_line(loaded, engine, opt))
    if engine.compiled:  # before the prompt, not in the first answer
        if not quiet and sys.stderr.isatty():
            with Console(stderr=True).status("compiling the decode step (once per cache size)…"):
                engine.warm_up(session.kv, sampling)
        else:
            engine.warm_up(session.kv, sampling)
    return ChatStart(session, loaded, shown)


@app.command(short_help="Serve the model over the OpenAI-compatible HTTP API.")
@setting_options("serve", after="config")
def serve(
    model: ServeModelOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key_env: ServerKeyEnvOpt = None,
    served_model_name: ServedModelNameOpt = None,
    prefix_cache: PrefixCacheOpt = True,
    cache_conversations: CacheConversationsOpt = 8,
    cache_memory: CacheMemoryOpt = "2GiB",
    cache_dir: CacheDirOpt = None,
    cache_disk: CacheDiskOpt = "4GiB",
    slot_save_path: SlotSavePathOpt = None,
    preset: ServePresetOpt = None,
    config: ConfigOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    template: TemplateOpt = "auto",
    trust_remote_code: TrustOpt = False,
    threads: ThreadsOpt = None,
    opt: OptOpt = "auto",
    max_body: MaxBodyOpt = "auto",
    log_level: LogLevelOpt = "warning",
    debug: DebugOpt = False,
    **settings: Any,
) -> None:
    """Serve the model over the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /v1/models, /health), with conversation caches kept as a prefix cache.

    A request that leaves temperature, top_p or max_tokens out gets the model's: its preset's
    sampling (--preset/--config; the default model's preset for the default model), else its
    generation_config, then the flags here."""
    global _DEBUG
    _DEBUG = debug
    from chatbot.cli.serve import Listen, body_cap, parse_size, serve_model

    key = resolve_api_key(api_key_env)
    memory = parse_size(cache_memory)
    caches = (prefix_cache, cache_conversations, memory, cache_dir, parse_size(cache_disk), slot_save_path)
    listen = Listen(host, port, key, served_model_name, *caches, body_cap(max_body), log_level)
    load = LoadConfig(model, device, dtype, template=template, trust_remote_code=trust_remote_code)
    engine = EngineConfig(**{row.name: settings[row.name] for row in layer("engine") if row.name in settings})
    overrides = {row.name: settings[row.name] for row in layer("sampling") if row.name in settings}
    serve_model(load, engine, overrides, preset, config, listen, threads, opt)


@app.command()
def sessions(limit: SessionsLimitOpt = 20, prune: PruneOpt = False) -> None:
    """List the logged chat sessions (resume one with: chatbot run --resume ID) and what
    their KV caches on disk hold."""
    from chatbot.terminal.sessions_view import print_sessions, prune_store

    console = Console(highlight=False)
    prune_store(console) if prune else print_sessions(console, limit)


app.command("eval-ppl")(eval_ppl)
app.add_typer(bench_app, name="bench")


@app.command(short_help="Print what this machine gives the chatbot, for bug reports.")
def doctor(
    ctx: typer.Context,
    model: ModelOpt = None,
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    opt: OptOpt = "auto",
    load: Annotated[
        bool, typer.Option(help="Load --model to tell its decode path (--no-load: the machine only).")
    ] = True,
    debug: DebugOpt = False,
    check_model: Annotated[
        Path | None,
        typer.Option(
            help="Scan every tensor of this .gguf file or folder for NaN and infinity, and "
            "check a GGUF file's metadata against its tensors (then nothing else)."
        ),
    ] = None,
) -> None:
    """Print what this machine gives the chatbot, for bug reports and piped runs: the CPU and
    the SIMD level the kernels use, the C compiler, OpenMP or the kernels' own thread pool,
    the kernels' cache, the GPUs, and the decode path --model takes (`decode: native ...` or
    `decode: transformers (why)`)."""
    if check_model is not None:
        from chatbot.terminal.model_check import check_model_files

        check_model_files(check_model)
        return
    from chatbot import doctor as facts
    from chatbot.terminal.tty import line_console

    out = line_console()

    def line(key: str, value: str) -> None:
        out.print(f"{key}: {value}", markup=False)

    env = facts.environment()
    line("chatbot", f"{env['chatbot']} (python {env['python']}, torch {env['torch']}, "
         f"transformers {env['transformers']})")  # fmt: skip
    line("platform", env["platform"])
    line("cpu", f"{facts.cpu_model()} · {facts.usable_cpus()} usable CPUs · {facts.machine()}")
    cc = facts.compiler()
    if cc.command is None:
        line("compiler", "none found (set CC, or install gcc): GGUF files run through transformers")
    else:
        openmp = "with OpenMP" if cc.openmp else "without OpenMP (-fopenmp fails)"
        line("compiler", f"{cc.command} ({cc.version}) {openmp}")
        from chatbot.engine.backends.native.kernels import arch_flags, extra_flags

        line("simd", f"{cc.simd} (what {' '.join([*arch_flags(), *extra_flags()])} gives the kernels here)")
    gpu = facts.gpus()
    line("gpu", ", ".join(gpu.cuda) if gpu.cuda else ("Apple MPS" if gpu.mps else "none visible to torch"))
    loaded = backend = reason = None
    if load:  # before the kernels' line: loading a GGUF file builds them
        settings = resolve_cli_settings(ctx, preset, config).run_config()
        loaded = load_with_status(settings.load.model, **settings.load.options())  # a status on a tty
        from chatbot.engine.backends.choose import backend_for

        backend, reason = backend_for(loaded.model, opt)
    folder, library = facts.kernels_cache(cc)
    built = "built" if library is not None and library.is_file() else "not built yet"
    line("kernels", f"{library if library is not None else folder} ({built})")
    line("kv cache", facts.kv_store())
    threads = facts.kernel_threads(cc)
    if threads == "own pool":
        line("threads", "own pool (pthreads, no OpenMP)")
    elif threads is not None:
        line("threads", threads)
    if loaded is None:
        return
    from chatbot.engine.backends.native.kernels import failure

    line("model", f"{loaded.name} · {loaded.describe()['dtype']} · {loaded.describe()['device']}")
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        line("decode", decoder.info().label().replace("native kernels", "native", 1))
    elif backend is not None and getattr(backend, "compiled", False):
        line("decode", backend.describe())
    else:
        why = failure() or (reason or "--opt off").removeprefix("fast decode off: ")
        line("decode", f"transformers ({why})")


config_app = typer.Typer(help="Presets and effective settings.", no_args_is_help=True)
app.add_typer(config_app, name="config")


app.command()(models)
app.command()(pull)
app.command()(rm)


@config_app.command("show")
@setting_options("config", after="trust_remote_code", moved={"greedy": "seed"})
def config_show(
    ctx: typer.Context,
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    system: SystemOpt = None,
    template: TemplateOpt = "auto",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = None,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    revision: RevisionOpt = None,
    trust_remote_code: TrustOpt = False,
    greedy: GreedyOpt = False,
    **settings: Any,
) -> None:
    """Print the settings `chatbot run` would use with these flags, as a preset file
    (each line says where its value came from; save it and pass it to --config)."""
    resolved = resolve_cli_settings(ctx, preset, config)
    resolved.run_config()  # refuse what `run` would refuse
    print(resolved.as_yaml(), end="")


def _optional_values(args: list[str]) -> list[str]:
    """`--resume` with no value (last, or before another option) means `--resume last`."""
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append("last")
    return out


def _open_closed_streams() -> None:
    """A standard stream the shell closed (`chatbot run <&-`, `>&-`) is None in Python: read
    it as an empty input, write it away, as /dev/null would."""
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, mode, encoding="utf-8"))  # noqa: SIM115


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app and turn every error into one line."""
    args = _optional_values(list(sys.argv[1:] if argv is None else argv))
    run = argv is None and args[:1] == ["run"]
    if run:
        pause_until_ready()  # its imports and load run faster without collector passes
    # `chatbot run` as the program itself (the console script, `python -m chatbot.cli`), not
    # a caller's main(...), whose process goes on after it
    program = run and sys._getframe(1).f_globals.get("__name__") == "__main__"
    if not program:
        _main(args)
        return
    try:
        _main(args)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            leave_without_teardown(exc.code or 0)
        raise
    leave_without_teardown(0)


def leave_without_teardown(code: int) -> None:
    """End the process with `code` as the interpreter would, less its teardown: the exit
    handlers run and the standard streams are flushed, but the ~600k objects of torch's and
    transformers' modules are not freed one by one (0.26-0.32 s after a one-shot answer on the
    default model). A thread that is not a daemon (the KV cache's write to disk) is waited for
    first, as the interpreter would; one still running after a minute, or a stream that cannot
    be flushed (a closed pipe), leaves the interpreter's way, which waits for the thread or
    reports the stream as it always did."""
    import atexit
    import threading
    import time

    deadline = time.monotonic() + 60.0
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        sys.exit(code)
    os._exit(code)


def _main(args: list[str]) -> None:
    from chatbot.terminal.sanitize import safe_line

    _open_closed_streams()
    command = typer.main.get_command(app)
    from chatbot.terminal.tty import line_console

    err = line_console(stderr=True)
    try:
        code = command.main(args=args, prog_name="chatbot", standalone_mode=False)
        if isinstance(code, int) and code:  # typer's click gives Ctrl-C's 130 as a return value
            sys.exit(code)
    except Exit as exc:
        sys.exit(exc.exit_code)
    except TyperException as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help())
            sys.exit(2)
        where = ctx.command_path if ctx is not None else "chatbot"
        message = " ".join(exc.format_message().split())
        err.print(safe_line(f"{where}: {message} (see: {where} --help)"), markup=False)
        sys.exit(2)
    except Abort:
        sys.exit(130)
    except ChatbotError as exc:
        if _DEBUG or os.environ.get("CHATBOT_DEBUG"):
            raise
        err.print(safe_line(f"chatbot: error: {in_user_words(exc)}"), markup=False)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if _DEBUG or os.environ.get("CHATBOT_DEBUG"):
            raise
        line = f"chatbot: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)"
        err.print(safe_line(line), markup=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
