"""The `chatbot` command: flags -> config -> session -> terminal or measurement.

This is the only place where errors become messages: a ChatbotError or a bad flag prints one
line and exits with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.exceptions import Abort, Exit, TyperException

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.engine.threads import apply_wait_policy
from chatbot.errors import ChatbotError, ConfigError

# Before torch loads libgomp (it reads its wait settings once): threads that wait at a
# barrier spin briefly, then sleep, so a busy machine is not made busier (engine/threads.py).
apply_wait_policy()

app = typer.Typer(
    name="chatbot",
    help="Chat with a local language model in the terminal.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
bench_app = typer.Typer(help="Benchmarks that print figures side by side.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

_DEBUG = False

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="A transformers folder, a .gguf file, a hub id or a preset name (default: the embedded SmolLM2-135M-Instruct)."),
]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps.")]
DtypeOpt = Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")]
ThreadsOpt = Annotated[int | None, typer.Option(help="CPU threads (default: the physical cores less those other processes keep busy).", min=1)]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the figures to this JSON file.")]
QuantizeOpt = Annotated[str | None, typer.Option(help="Quantize the weights while loading with bitsandbytes: 4bit (NF4) or 8bit (LLM.int8).")]
DeviceMapOpt = Annotated[str | None, typer.Option(help="Spread a large model over devices (accelerate): auto, balanced, sequential, or a JSON map of module -> device.")]
MaxMemoryOpt = Annotated[str | None, typer.Option(help="Per-device budget with --device-map, e.g. 0=20GiB,1=20GiB,cpu=64GiB.")]
RevisionOpt = Annotated[str | None, typer.Option(help="Hub branch, tag or commit of --model.")]
TrustOpt = Annotated[bool, typer.Option(help="Run model code shipped with the checkpoint (only for authors you trust).")]
TemplateOpt = Annotated[str | None, typer.Option(help="Chat template: auto (the tokenizer's), chatml, llama2, llama3, mistral, vicuna, colossal, plain, or a .jinja file.")]
PresetOpt = Annotated[str | None, typer.Option(help="A preset from configs/ by name (see: chatbot models); flags override it.")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="A preset file (YAML); flags override it.")]


def _check_opt(value: str) -> str:
    from chatbot.engine.fast import LEVELS

    if value not in LEVELS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(LEVELS)}")
    return value


def _decoder(model: Any, opt: str) -> tuple[Any, str | None]:
    """The fast decode step for --opt, or None and a note saying why it is off."""
    from chatbot.engine.fast import make_decoder

    decoder, reason = make_decoder(model, opt)
    on_cpu = model.get_input_embeddings().weight.device.type == "cpu"
    return decoder, reason if reason and (opt != "auto" or on_cpu) else None


def _set_threads(threads: int | None) -> None:
    import torch

    if not threads:
        # Default: the CPUs left free by other busy processes (engine/threads.py); on a
        # 2-core machine running something else, two threads decode several times slower.
        from chatbot.engine.threads import default_threads

        torch.set_num_threads(default_threads(most=torch.get_num_threads()))
        return
    cores = os.cpu_count() or 1
    if threads > cores:  # more threads than cores only make them wait for each other
        Console(stderr=True, highlight=False).print(
            f"note: --threads {threads} is more than the {cores} cores here; using {cores}", markup=False)
        threads = cores
    torch.set_num_threads(threads)


def _load(model: str | None, device: str, dtype: str, quiet: bool = False, **options: Any) -> Any:
    from chatbot.models.loader import load_model

    err = Console(stderr=True)
    if not quiet and sys.stderr.isatty():
        with err.status("loading model…"):
            return load_model(model, device=device, dtype=dtype, **options)
    return load_model(model, device=device, dtype=dtype, **options)


def _settings(ctx: typer.Context, preset: str | None, config: Path | None) -> Any:
    """Defaults < the preset (--preset/--config) < the flags given on the command line."""
    from chatbot.models.presets import resolve_settings, select_preset
    from chatbot.models.templates import check_template_choice

    chosen = select_preset(preset, config, ctx.params.get("model"))
    # typer vendors its own click: compare the sources by name
    sources = {name: getattr(ctx.get_parameter_source(name), "name", "DEFAULT") for name in ctx.params}
    given = {name for name, source in sources.items() if source not in ("DEFAULT", "DEFAULT_MAP")}
    if chosen is not None and not (preset or config):
        given.discard("model")  # --model named the preset
    settings = resolve_settings(chosen, dict(ctx.params), given)
    check_template_choice(settings["template"])
    return settings


@app.command()
def run(
    ctx: typer.Context,
    model: ModelOpt = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature; 0 is greedy.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling mass (0, 1].")] = None,
    top_k: Annotated[int | None, typer.Option(help="Sample among the k likeliest tokens; 0 turns it off.")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(help="Penalty for tokens already in the conversation; 1 turns it off.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Most tokens per answer.")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed for reproducible sampling.")] = None,
    greedy: Annotated[bool, typer.Option(help="Always pick the likeliest token (same as --temperature 0).")] = False,
    stream_interval: Annotated[int, typer.Option(help="Show text every N tokens.")] = 1,
    prefill_chunk: Annotated[int, typer.Option(help="Prefill long inputs in chunks of this many tokens.")] = 512,
    enable_streaming: Annotated[bool, typer.Option(help="Attention sinks + recent window: chat forever in bounded memory.")] = False,
    start_size: Annotated[int, typer.Option(help="Attention-sink tokens kept at the start (with --enable-streaming).")] = 4,
    recent_size: Annotated[int | None, typer.Option(help="Recent tokens kept (with --enable-streaming; default: a quarter of the context, at most 2000).")] = None,
    keep_system: Annotated[bool | None, typer.Option(help="Pin the system prompt in the streaming cache (default: on when --system is set).")] = None,
    max_context: Annotated[int | None, typer.Option(help="Most tokens the conversation may hold (default: the model's context).")] = None,
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
    opt: Annotated[str, typer.Option("--opt", help="Decode path: auto (native CPU kernels, weights kept exact), f32, int8 or int4 (smaller, lossy), off (transformers).", callback=_check_opt)] = "auto",
    plain: Annotated[bool, typer.Option(help="Print raw text instead of rendered Markdown.")] = False,
    no_stats: Annotated[bool, typer.Option("--no-stats", help="Hide the stats line after each answer.")] = False,
    resume: Annotated[str | None, typer.Option(help="Continue a logged session: its id (or the start of it), or 'last' (the default when no value is given).")] = None,
    server: Annotated[str | None, typer.Option(help="Chat with a model on an OpenAI-compatible server (vLLM, SGLang, llama-server, ollama, chatbot serve), e.g. http://127.0.0.1:8000/v1; --model names it there.")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="With --server: send the API key in this environment variable.")] = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Chat with a model. Reads one message per line when stdin is not a terminal."""
    global _DEBUG
    _DEBUG = debug
    if server is not None:
        overrides = {"temperature": 0.0 if greedy else temperature, "top_p": top_p, "top_k": top_k,
                     "repetition_penalty": repetition_penalty, "max_new_tokens": max_new_tokens, "seed": seed,
                     "stream_interval": stream_interval}
        _run_remote(ctx, server, model, api_key_env, system, overrides, enable_streaming, plain, no_stats, resume)
        return
    if api_key_env is not None:
        raise ConfigError("--api-key-env goes with --server URL")
    settings = _settings(ctx, preset, config)
    (model, system, device, dtype, temperature, top_p, top_k, repetition_penalty, max_new_tokens, seed,
     enable_streaming, start_size, recent_size, keep_system, max_context) = (settings.run_values()[k] for k in (
        "model", "system", "device", "dtype", "temperature", "top_p", "top_k", "repetition_penalty",
        "max_new_tokens", "seed", "enable_streaming", "start_size", "recent_size", "keep_system", "max_context"))
    load_options = {k: settings[k] for k in ("quantize", "device_map", "max_memory", "revision", "trust_remote_code", "template")}
    overrides = {
        "temperature": 0.0 if greedy else temperature,
        "top_p": top_p,
        "top_k": top_k,
        "repetition_penalty": repetition_penalty,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "stream_interval": stream_interval,
    }
    # Check every value before the (slow) model load.
    SamplingConfig(**{k: v for k, v in overrides.items() if v is not None}).validated()
    engine_cfg = EngineConfig(
        prefill_chunk=prefill_chunk,
        enable_streaming=enable_streaming,
        start_size=start_size,
        recent_size=recent_size,
        keep_system=keep_system,
        max_context=max_context,
    ).validated()
    _set_threads(threads)

    from chatbot.engine.generate import Engine
    from chatbot.models.templates import check_template
    from chatbot.session import ChatSession, sampling_from_model
    from chatbot.terminal.repl import Repl, make_consoles, resolve_resume
    from chatbot.terminal.repl import run as run_repl

    resume_path = resolve_resume(resume)
    loaded = _load(model, device, dtype, **load_options)
    check_template(loaded.tokenizer, system, loaded.name)
    sampling = sampling_from_model(loaded.model, **overrides)
    decoder, decoder_note = _decoder(loaded.model, opt)
    engine = Engine(loaded.model, loaded.tokenizer, max_context=max_context, decoder=decoder)
    session = ChatSession(engine, ChatConfig(system=system, sampling=sampling, engine=engine_cfg))

    interactive = sys.stdin.isatty()
    out, info = make_consoles(interactive)
    repl = Repl(session, loaded, out, plain=plain or not sys.stdout.isatty(), show_stats=not no_stats, info=info)
    for note in loaded.notes:
        repl.note(note)
    if decoder_note:
        repl.note(decoder_note)
    if interactive:
        d = loaded.describe()
        quant = f" · {d['quantization']}" if d["quantization"] != "none" else ""
        repl.note(" · ".join(f"{d[k]}" for k in ("model", "parameters", "dtype", "device")) + quant
                  + f" · context {d['context']} · template {d['template']} · loaded in {d['load time']}"
                  + f" · decode: {f'native {decoder.info().activations} ({opt})' if decoder else 'transformers'}")
    repl.start_log(resume_path, overrides={k: v for k, v in overrides.items() if v is not None and k != "stream_interval"},
                   system=system)
    run_repl(repl, interactive)


def _api_key(var: str | None) -> str | None:
    """The API key in the environment variable `var` (None: no key)."""
    if var is None:
        return None
    key = os.environ.get(var, "").strip()
    if not key:
        raise ConfigError(f"--api-key-env {var}: the environment variable {var} is not set or empty")
    return key


def _size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1GB' or a plain number."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1, "": 1}
    raw = text.strip().lower()
    number = raw.rstrip("kmgib")
    try:
        return int(float(number) * units[raw[len(number):]])
    except (ValueError, KeyError):
        raise ConfigError(f"cannot read the size {text!r} (e.g. 2GiB, 512MiB)") from None


@app.command()
def serve(
    model: Annotated[str | None, typer.Option("--model", "-m", help="A transformers folder, a .gguf file or a hub id (default: the embedded SmolLM2-135M-Instruct).")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.", min=1, max=65535)] = 8000,
    api_key_env: Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on /v1, KEY read from this environment variable.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="The model id clients use (default: the model's name).")] = None,
    prefix_cache: Annotated[bool, typer.Option(help="Keep conversation caches between requests (a request extending one prefills only its new tokens).")] = True,
    cache_conversations: Annotated[int, typer.Option(help="Conversation caches kept, least recently used evicted.", min=1)] = 8,
    cache_memory: Annotated[str, typer.Option(help="Cap on the KV cache memory kept between requests, e.g. 2GiB.")] = "2GiB",
    temperature: Annotated[float | None, typer.Option(help="Default temperature (requests may set their own).")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Default max_tokens of a request.")] = None,
    prefill_chunk: Annotated[int, typer.Option(help="Prefill long inputs in chunks of this many tokens.")] = 512,
    enable_streaming: Annotated[bool, typer.Option(help="Each conversation on an attention-sink cache: no context limit.")] = False,
    start_size: Annotated[int, typer.Option(help="Attention-sink tokens (with --enable-streaming).")] = 4,
    recent_size: Annotated[int | None, typer.Option(help="Recent tokens kept (with --enable-streaming).")] = None,
    max_context: Annotated[int | None, typer.Option(help="Most tokens a conversation may hold (default: the model's context).")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    template: TemplateOpt = "auto",
    trust_remote_code: TrustOpt = False,
    threads: ThreadsOpt = None,
    opt: Annotated[str, typer.Option("--opt", help="Decode path, as for chatbot run.", callback=_check_opt)] = "auto",
    log_level: Annotated[str, typer.Option(help="uvicorn's log level: warning, info (one line per request), debug.")] = "warning",
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Serve the model over the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /v1/models, /health), with conversation caches kept as a prefix cache."""
    global _DEBUG
    _DEBUG = debug
    key = _api_key(api_key_env)
    memory = _size(cache_memory)
    overrides = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    SamplingConfig(**{k: v for k, v in overrides.items() if v is not None}).validated()
    engine_cfg = EngineConfig(prefill_chunk=prefill_chunk, enable_streaming=enable_streaming, start_size=start_size,
                              recent_size=recent_size, max_context=max_context).validated()
    _set_threads(threads)

    from chatbot.engine.generate import Engine
    from chatbot.server.app import create_app
    from chatbot.server.app import serve as run_server
    from chatbot.server.pool import PrefixCachePool, server_sampling

    loaded = _load(model, device, dtype, template=template, trust_remote_code=trust_remote_code)
    sampling = server_sampling(loaded.model, **overrides)
    decoder, decoder_note = _decoder(loaded.model, opt)
    engine = Engine(loaded.model, loaded.tokenizer, max_context=max_context, decoder=decoder)
    pool = PrefixCachePool(engine, engine_cfg, sampling, max_entries=cache_conversations if prefix_cache else 0,
                           max_bytes=memory)
    name = served_model_name or loaded.name
    application = create_app(pool, name, api_key=key, streaming_cache=enable_streaming)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for note in [*loaded.notes, *([decoder_note] if decoder_note else [])]:
        err.print(note, style="dim", markup=False)
    shown = "localhost" if host in ("127.0.0.1", "::1") else host
    err.print(f"serving {name} on http://{shown}:{port}/v1 (OpenAI API: /v1/chat/completions, /v1/completions, "
              "/v1/models; /health) · "
              f"one generation at a time · prefix cache {'on' if prefix_cache else 'off'}"
              + (" · API key required" if key else ""), markup=False)
    if key is None and host not in ("127.0.0.1", "::1", "localhost"):
        err.print(f"warning: listening on {host} without an API key (--api-key-env VAR)", style="yellow", markup=False)
    run_server(application, host, port, log_level=log_level)


def _run_remote(ctx: typer.Context, server: str, model: str | None, api_key_env: str | None, system: str | None,
                overrides: dict[str, Any], enable_streaming: bool, plain: bool, no_stats: bool,
                resume: str | None) -> None:
    """`chatbot run --server URL`: the REPL on a RemoteSession."""
    if enable_streaming:
        raise ConfigError("--enable-streaming does not apply with --server: the server manages its own context")
    if getattr(ctx.get_parameter_source("opt"), "name", "") == "COMMANDLINE":
        raise ConfigError("--opt does not apply with --server: the server runs the model")
    from chatbot.remote import RemoteBackend, RemoteSession, remote_sampling
    from chatbot.terminal.repl import Repl, resolve_resume
    from chatbot.terminal.repl import run as run_repl

    sampling = remote_sampling(**overrides)
    resume_path = resolve_resume(resume)
    backend = RemoteBackend(server, model, _api_key(api_key_env))
    backend.connect()
    session = RemoteSession(backend, system, sampling)
    interactive = sys.stdin.isatty()
    out = Console(soft_wrap=True, highlight=False)
    info = out if (interactive and sys.stdout.isatty()) else Console(stderr=True, highlight=False, soft_wrap=True)
    repl = Repl(session, backend, out, plain=plain or not sys.stdout.isatty(), show_stats=not no_stats, info=info)  # type: ignore[arg-type]
    for note in backend.notes:
        repl.note(note)
    if interactive:
        repl.note(f"{backend.name} on {backend.base_url} · the server's prefix cache keeps the conversation")
    repl.start_log(resume_path, system=system, overrides={k: v for k, v in overrides.items()
                                                          if v is not None and k != "stream_interval"})
    run_repl(repl, interactive)


@app.command()
def sessions(
    limit: Annotated[int, typer.Option(help="Show at most this many, newest first.", min=1)] = 20,
) -> None:
    """List the logged chat sessions (resume one with: chatbot run --resume ID)."""
    from chatbot.terminal.session_log import print_sessions

    print_sessions(Console(highlight=False), limit)


@bench_app.command("turns")
def bench_turns(
    conversation: Annotated[Path | None, typer.Option(help='A JSON file {"turns": [...]} (default: the shipped twelve-turn chat).')] = None,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per turn (greedy).", min=1)] = 64,
    repeats: Annotated[int, typer.Option(help="Plays of the conversation per side, interleaved; figures are medians.", min=1)] = 3,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    server: Annotated[str | None, typer.Option(help="Measure a server's prefix cache through HTTP instead (OpenAI API, e.g. http://127.0.0.1:8000/v1): the conversation with its cache, and again with it bypassed.")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="With --server: the API key's environment variable.")] = None,
    json_out: JsonOpt = None,
) -> None:
    """Persistent cache against re-encoding the whole history every turn."""
    from chatbot.measure.bench import load_conversation, run_turns_bench
    from chatbot.measure.report import print_turns, write_json

    turns = load_conversation(conversation)
    if server is not None:
        from chatbot.measure.bench_http import run_http_turns_bench
        from chatbot.measure.report import print_http_turns

        err = Console(stderr=True, highlight=False)
        result = run_http_turns_bench(server, turns, max_new_tokens, model, _api_key(api_key_env),
                                      progress=lambda line: err.print(f"[dim]{line}[/dim]"))
        print_http_turns(Console(), result)
        if json_out:
            write_json(json_out, result)
        return
    _set_threads(threads)
    loaded = _load(model, device, dtype)
    result = run_turns_bench(loaded, turns, max_new_tokens, repeats)
    print_turns(Console(), result)
    if json_out:
        write_json(json_out, result)


@bench_app.command("render")
def bench_render(
    tokens: Annotated[int, typer.Option(help="Pieces of the Markdown answer fed to the renderer.", min=10)] = 2000,
    rate: Annotated[float, typer.Option(help="Decode speed the renderer must keep up with, tokens/s.", min=1)] = 150.0,
    width: Annotated[int, typer.Option(help="Terminal columns.", min=20)] = 80,
    json_out: JsonOpt = None,
) -> None:
    """The live answer renderer's own cost per token (no model, no terminal emulator)."""
    from chatbot.measure.bench_render import run_render_bench
    from chatbot.measure.report import print_render, write_json

    result = run_render_bench(tokens, rate, width)
    print_render(Console(), result)
    if json_out:
        write_json(json_out, result)


@bench_app.command("load")
def bench_load(
    server: Annotated[str, typer.Option(help="The server's API root, e.g. http://127.0.0.1:8000/v1.")],
    clients: Annotated[int, typer.Option(help="Concurrent streaming clients.", min=1, max=64)] = 8,
    duration: Annotated[float, typer.Option(help="Seconds to keep sending (requests in flight are finished).", min=1, max=3600)] = 60.0,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per answer (greedy).", min=1)] = 32,
    conversation: Annotated[Path | None, typer.Option(help='A JSON file {"turns": [...]} (default: the shipped twelve-turn chat).')] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="The model id on the server (default: its first).")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="The API key's environment variable.")] = None,
    json_out: JsonOpt = None,
) -> None:
    """A bounded load test on a server: N clients chatting at once for a fixed time; answers,
    errors, time to first token p50/p99 and the server's memory (chatbot serve's /health)."""
    from chatbot.measure.bench import load_conversation
    from chatbot.measure.bench_http import run_load_bench
    from chatbot.measure.report import print_load, write_json

    turns = load_conversation(conversation)
    err = Console(stderr=True, highlight=False)
    result = run_load_bench(server, turns, clients, duration, max_new_tokens, model, _api_key(api_key_env),
                            progress=lambda line: err.print(f"[dim]{line}[/dim]"))
    print_load(Console(), result)
    if json_out:
        write_json(json_out, result)
    if result["errors"] or result["incomplete"]:
        raise Exit(1)


@bench_app.command("streaming")
def bench_streaming(
    text: Annotated[Path | None, typer.Option(help="A long plain-text file (default: the Python FAQ text shipped in the package).")] = None,
    recent_size: Annotated[list[int] | None, typer.Option(help="Recent window sizes to measure (repeatable).")] = None,
    start_size: Annotated[int, typer.Option(help="Attention sinks.", min=0)] = 4,
    decode_tokens: Annotated[int, typer.Option(help="Greedy tokens decoded at each mark.", min=2)] = 32,
    opt: Annotated[str, typer.Option("--opt", help="Decode path of the sink cache, as for chatbot run (recomputation always uses transformers).", callback=_check_opt)] = "auto",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Decode speed and cache bytes at 1x, 4x, 16x the window, against recomputation."""
    from chatbot.measure.bench_streaming import default_text_path, run_streaming_bench
    from chatbot.measure.report import print_streaming, read_text, write_json

    body = read_text(text or default_text_path())
    _set_threads(threads)
    loaded = _load(model, device, dtype)
    sizes = tuple(recent_size or (256, 1024))
    decoder, note = _decoder(loaded.model, opt)
    if note:
        Console(stderr=True, highlight=False).print(f"[dim]{note}[/dim]")
    result = run_streaming_bench(loaded, body, sizes, start_size, decode_tokens=decode_tokens, decoder=decoder)
    print_streaming(Console(), result)
    if json_out:
        write_json(json_out, result)


@app.command("eval-ppl")
def eval_ppl(
    text: Annotated[Path | None, typer.Option(help="A long plain-text file (default: the Python FAQ text shipped in the package).")] = None,
    tokens: Annotated[int, typer.Option(help="Tokens to score, one per step.", min=2)] = 4000,
    start_size: Annotated[int, typer.Option(help="Attention sinks.", min=0)] = 4,
    recent_size: Annotated[int, typer.Option(help="Recent window.", min=1)] = 252,
    setups: Annotated[str, typer.Option(help="Comma-separated: dense,window,sinks,recompute.")] = "dense,window,sinks,recompute",
    plot: Annotated[Path | None, typer.Option(help="PNG of running log-perplexity (default: beside --json, or eval_ppl.png).")] = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Perplexity of dense attention, window, window + sinks and recomputation, side by side."""
    from rich.progress import Progress

    from chatbot.measure.bench_streaming import default_text_path
    from chatbot.measure.eval_ppl import format_table, run_eval_ppl, write_plot
    from chatbot.measure.report import read_text, write_json

    body = read_text(text or default_text_path())
    chosen = tuple(s.strip() for s in setups.split(",") if s.strip())
    _set_threads(threads)
    loaded = _load(model, device, dtype)
    with Progress(console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(setup: str, done: int, total: int) -> None:
            if setup not in tasks:
                tasks[setup] = bar.add_task(setup, total=total)
            bar.update(tasks[setup], completed=done)

        result = run_eval_ppl(loaded.model, loaded.tokenizer, body, tokens, start_size, recent_size, chosen, progress)
    print(format_table(result))
    png = plot or (json_out.with_suffix(".png") if json_out else Path("eval_ppl.png"))
    write_plot(result, png, title=f"{loaded.name}: {tokens} tokens, {start_size} sinks + {recent_size} recent")
    print(f"plot: {png}")
    if json_out:
        slim = {k: {m: v for m, v in r.items() if m != "nll"} for k, r in result.items()}
        write_json(json_out, slim)


@bench_app.command("decode")
def bench_decode(
    setups: Annotated[str | None, typer.Option(help="Comma-separated set-ups (default: transformers-generate, chatbot-off/f32/auto/int8/int4, and llama.cpp when llama-cpp-python is installed).")] = None,
    rounds: Annotated[int, typer.Option(help="Runs per set-up, interleaved; figures are medians.", min=1)] = 3,
    decode_tokens: Annotated[int, typer.Option(help="Greedy tokens decoded after a 50-token prompt.", min=2)] = 128,
    text: Annotated[Path | None, typer.Option(help="Text the prompts are cut from (default: the shipped conversation, repeated).")] = None,
    ppl_tokens: Annotated[int, typer.Option(help="Also measure perplexity over this many tokens of the text, through each decode path (0: skip).", min=0)] = 0,
    gguf: Annotated[Path | None, typer.Option(help="GGUF file for llama.cpp (default: the default model's).")] = None,
    prefill: Annotated[str, typer.Option(help="Comma-separated prompt lengths prefill is timed at.")] = "50,500,2000",
    png: Annotated[Path | None, typer.Option(help="Also draw the figures into this PNG (needs matplotlib).")] = None,
    also: Annotated[str | None, typer.Option(help="Also run these benches on the same model, into the same JSON: turns (persistent cache vs re-encoding), streaming (sink cache vs recomputation; reads --text or the packaged Python FAQ text).")] = None,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Decode and prefill speed, time to first token and peak memory: transformers generate(),
    our engine at each --opt level, and llama.cpp, side by side (one process per set-up)."""
    from chatbot.measure.bench_decode import plot_decode, print_decode, run_decode_bench
    from chatbot.measure.report import read_text, write_json

    chosen = [s.strip() for s in setups.split(",") if s.strip()] if setups else None
    extra = [s.strip() for s in (also or "").split(",") if s.strip()]
    unknown = sorted(set(extra) - {"turns", "streaming"})
    if unknown:
        raise ConfigError(f"--also: unknown bench {', '.join(unknown)}; choose from turns, streaming")
    if "streaming" in extra:
        from chatbot.measure.bench_streaming import default_text_path

        long_text = read_text(text or default_text_path())
    try:
        prefill_sizes = tuple(int(n) for n in prefill.split(",") if n.strip())
    except ValueError:
        raise ConfigError(f"--prefill: expected prompt lengths like 50,500,2000, not {prefill!r}") from None
    if not prefill_sizes or min(prefill_sizes) < 1:
        raise ConfigError(f"--prefill: expected positive prompt lengths like 50,500,2000, not {prefill!r}")
    err = Console(stderr=True, highlight=False)
    result = run_decode_bench(
        chosen, model=model, threads=threads, rounds=rounds, decode_tokens=decode_tokens, text=text,
        ppl_tokens=ppl_tokens, gguf=gguf, prefill_sizes=prefill_sizes,
        progress=lambda line: err.print(f"[dim]{line}[/dim]"),
    )
    out = Console()
    print_decode(out, result)
    if extra:
        from chatbot.measure.bench import load_conversation, run_turns_bench
        from chatbot.measure.bench_streaming import run_streaming_bench
        from chatbot.measure.report import print_streaming, print_turns

        _set_threads(threads)
        loaded = _load(model, "cpu", "auto")
        if "turns" in extra:
            err.print("[dim]multi-turn bench[/dim]")
            result["turns"] = run_turns_bench(loaded, load_conversation(None))
            print_turns(out, result["turns"])
        if "streaming" in extra:
            err.print("[dim]streaming bench[/dim]")
            result["streaming"] = run_streaming_bench(loaded, long_text, decoder=_decoder(loaded.model, "auto")[0])
            print_streaming(out, result["streaming"])
    if json_out:
        write_json(json_out, result)
    if png:
        plot_decode(result, png)


config_app = typer.Typer(help="Presets and effective settings.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@app.command()
def models(
    folders: Annotated[list[Path] | None, typer.Argument(help="Also look in these folders for model folders and .gguf files.")] = None,
) -> None:
    """List presets and the models found in the local caches (name, size, source)."""
    from chatbot.models.catalog import human_size, local_models
    from chatbot.models.presets import list_presets

    out = Console(highlight=False, soft_wrap=True)
    presets = list_presets()
    out.print("presets (chatbot run --preset NAME):", markup=False)
    width = max((len(p.name) for p in presets), default=0)
    for p in presets:
        source = p.values.get("model") or "default model"
        out.print(f"  {p.name:<{width}}  {source}  {p.description}".rstrip(), markup=False)
    found = local_models(folders)
    out.print("models on this machine (chatbot run --model NAME):", markup=False)
    if not found:
        out.print("  none found", markup=False)
    width = max((len(m.name) for m in found), default=0)
    for m in found:
        out.print(f"  {m.name:<{width}}  {human_size(m.size_bytes):>9}  {m.source}  {m.path}", markup=False)


@config_app.command("show")
def config_show(
    ctx: typer.Context,
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    template: TemplateOpt = "auto",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = None,
    device_map: DeviceMapOpt = None,
    max_memory: MaxMemoryOpt = None,
    revision: RevisionOpt = None,
    trust_remote_code: TrustOpt = False,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature; 0 is greedy.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling mass (0, 1].")] = None,
    top_k: Annotated[int | None, typer.Option(help="Sample among the k likeliest tokens; 0 turns it off.")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(help="Penalty for repeated tokens; 1 turns it off.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Most tokens per answer.")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    enable_streaming: Annotated[bool, typer.Option(help="Attention sinks + recent window.")] = False,
    start_size: Annotated[int, typer.Option(help="Attention-sink tokens.")] = 4,
    recent_size: Annotated[int | None, typer.Option(help="Recent tokens kept.")] = None,
    keep_system: Annotated[bool | None, typer.Option(help="Pin the system prompt in the streaming cache.")] = None,
    max_context: Annotated[int | None, typer.Option(help="Most tokens the conversation may hold.")] = None,
) -> None:
    """Print the settings `chatbot run` would use with these flags, as a preset file
    (each line says where its value came from; save it and pass it to --config)."""
    from chatbot.config import SamplingConfig

    settings = _settings(ctx, preset, config)
    SamplingConfig(**{k: v for k, v in settings.sampling_overrides().items() if v is not None}).validated()
    settings.engine_config()
    print(settings.as_yaml(), end="")


def _optional_values(args: list[str]) -> list[str]:
    """`--resume` with no value (last, or before another option) means `--resume last`."""
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append("last")
    return out


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app and turn every error into one line."""
    from chatbot.terminal.sanitize import safe_line

    command = typer.main.get_command(app)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    args = _optional_values(list(sys.argv[1:] if argv is None else argv))
    try:
        command.main(args=args, prog_name="chatbot", standalone_mode=False)
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
        err.print(safe_line(f"chatbot: error: {exc}"), markup=False)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if _DEBUG or os.environ.get("CHATBOT_DEBUG"):
            raise
        err.print(safe_line(f"chatbot: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)"),
                  markup=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
