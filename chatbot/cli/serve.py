"""`chatbot serve`: from its flags to a listening server (the command itself is in cli.py)."""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from chatbot.cli.load import (
    attach_draft,
    check_draft,
    context_note,
    draft_sampling,
    load_with_status,
    make_backend,
    make_engine,
    set_threads,
    split_draft,
    streaming_note,
)
from chatbot.config import EngineConfig, LoadConfig, SamplingConfig
from chatbot.errors import ConfigError


@dataclass(frozen=True)
class Listen:
    """Where and how the server answers: address, API key, caches kept and caps."""

    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    prefix_cache: bool
    cache_conversations: int
    cache_bytes: int
    cache_dir: Path | None  # where conversations' caches are also kept (`PrefixCachePool`)
    cache_disk: int  # that folder's cap in bytes
    slot_save_path: Path | None  # /slots' save and restore folder
    max_body: int | None  # None: from the model's context
    log_level: str


def cache_folder(path: Path, flag: str) -> Path:
    """The folder of `flag` (`--cache-dir`), made absolute and created (readable by the user
    alone) if need be.

    Raises:
        ConfigError: it is not a folder, or cannot be made.
    """
    folder = path.expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {folder} is not a folder")
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {folder} cannot be made: {exc.strerror}") from None
    return folder


def parse_size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1GB' or a plain number.

    Raises:
        ConfigError: the text is no size.
    """
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "b": 1,
        "": 1,
    }
    raw = text.strip().lower()
    number = raw.rstrip("kmgib")
    try:
        return int(float(number) * units[raw[len(number) :]])
    except (ValueError, KeyError):
        raise ConfigError(f"cannot read the size {text!r} (e.g. 2GiB, 512MiB)") from None


def body_cap(max_body: str) -> int | None:
    """--max-body as bytes (None for auto).

    Raises:
        ConfigError: no size, or too small for a request.
    """
    cap = None if max_body.strip().lower() == "auto" else parse_size(max_body)
    if cap is not None and cap < 1024:
        raise ConfigError(f"--max-body {max_body} is too small for a request (at least 1KiB)")
    return cap


def serve_model(
    load: LoadConfig,
    engine_config: EngineConfig,
    overrides: dict[str, Any],
    preset: str | None,
    config: Path | None,
    listen: Listen,
    threads: int | None,
    opt: str,
) -> None:
    """Load the model and serve it until stopped.

    Args:
        load: the model and how to load it (`model` None: the preset's, else the default).
        engine_config: the engine's settings from the flags (checked here).
        overrides: the sampling flags (temperature, max_new_tokens; None: not given).
        preset, config: --preset NAME or --config FILE (or neither).
        listen: where and how to answer.
        threads, opt: --threads and --opt.

    Raises:
        ConfigError: a bad flag or preset.
    """
    overrides["draft"], draft_model = split_draft(overrides.get("draft"))
    if draft_model is not None:
        check_draft(draft_model)
        load = dataclasses.replace(load, draft_model=draft_model)
    SamplingConfig(**{k: v for k, v in overrides.items() if v is not None}).validated()
    from chatbot.models.presets import select_preset

    chosen = select_preset(preset, config, load.model)
    if chosen is not None and not (preset or config):
        load = dataclasses.replace(load, model=None)  # --model named the preset (or no --model)
    preset_sampling: dict[str, Any] = {}
    defaults_from = "the model's generation_config"
    if chosen is not None:
        load = dataclasses.replace(load, model=load.model or chosen.config.load.model)
        preset_sampling = chosen.config.sampling.given()
        preset_sampling.pop("stream_interval", None)
        defaults_from = f"preset {chosen.name}, then the model's generation_config"
    if any(v is not None for v in overrides.values()):
        defaults_from += ", then the serve flags"
    engine_config.validated()
    if listen.cache_dir is not None:
        listen = dataclasses.replace(listen, cache_dir=cache_folder(listen.cache_dir, "--cache-dir"))
    if listen.slot_save_path is not None:
        listen = dataclasses.replace(
            listen, slot_save_path=cache_folder(listen.slot_save_path, "--slot-save-path")
        )
    # The port is taken now, before torch and the (slow) load: one in use is said at once, and
    # no other process can take it meanwhile. Connections wait in its backlog until the app runs.
    sockets = listen_sockets(listen.host, listen.port)
    try:
        set_threads(threads)
        _load_and_serve(load, engine_config, overrides, preset_sampling, defaults_from, listen, opt, sockets)
    finally:
        for sock in sockets:
            sock.close()


def _load_and_serve(
    load: LoadConfig,
    engine_config: EngineConfig,
    overrides: dict[str, Any],
    preset_sampling: dict[str, Any],
    defaults_from: str,
    listen: Listen,
    opt: str,
    sockets: list[socket.socket],
) -> None:
    from chatbot.server.app import create_app
    from chatbot.server.app import serve as run_server
    from chatbot.server.pool import PrefixCachePool, server_sampling

    loaded = load_with_status(
        load.model, load.device, load.dtype, template=load.template, trust_remote_code=load.trust_remote_code
    )
    backend, backend_note = make_backend(loaded.model, opt)
    engine = make_engine(loaded, engine_config, backend)
    draft_note = attach_draft(engine, load, opt)
    sampling, no_draft = draft_sampling(engine, server_sampling(loaded.model, preset_sampling, **overrides))
    kept = listen.cache_conversations if listen.prefix_cache else 0
    pool = PrefixCachePool(
        engine,
        engine_config,
        sampling,
        max_entries=kept,
        max_bytes=listen.cache_bytes,
        template=loaded.template,
        cache_dir=listen.cache_dir,
        disk_bytes=listen.cache_disk,
    )
    name = listen.served_model_name or loaded.name
    application = create_app(
        pool,
        name,
        api_key=listen.api_key,
        streaming_cache=engine_config.enable_streaming,
        max_body=listen.max_body,
        defaults_from=defaults_from,
        slot_folder=listen.slot_save_path,
    )
    notes = [backend_note, context_note(loaded, engine_config), streaming_note(engine, engine_config)]
    notes += [draft_note, no_draft]
    _announce(name, listen, [*loaded.notes, *filter(None, notes)], application.state.worker.describe())
    run_server(application, sockets, log_level=listen.log_level)


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets on `host` (every address it resolves to, as uvicorn would take
    them: `localhost` is 127.0.0.1 and ::1) and `port`.

    Raises:
        ConfigError: the host is unknown, or the port is taken (or not ours to take), in a
            line that says what to do.
    """
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"--host {host}: no such address ({exc.strerror}); e.g. 127.0.0.1 or 0.0.0.0"
        ) from None
    sockets: list[socket.socket] = []
    addresses = dict.fromkeys((family, kind, proto, address) for family, kind, proto, _, address in found)
    for family, kind, proto, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            if os.name == "posix":  # a port left in TIME_WAIT by a server just stopped is free
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
        except OSError as exc:
            sock.close()
            if sockets and exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                continue  # localhost's ::1 on a machine without IPv6: 127.0.0.1 serves
            for other in sockets:
                other.close()
            raise ConfigError(_bind_error(host, port, exc)) from None
        sockets.append(sock)
    return sockets


def _bind_error(host: str, port: int, exc: OSError) -> str:
    where = f"port {port} on {host}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{where} is already in use (another server, or a chatbot serve still running): "
            "stop it, or serve on another port with --port"
        )
    if exc.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need privileges): use --port 8000 or above"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine (127.0.0.1: this machine only; 0.0.0.0: all)"
    return f"cannot listen on {where}: {exc.strerror or exc}"


def _announce(name: str, listen: Listen, notes: list[str], concurrency: str) -> None:
    """The notes, the line saying where the server listens, and a warning for an open one."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for note in notes:
        err.print(note, style="dim", markup=False)
    host = listen.host
    shown = "localhost" if host in ("127.0.0.1", "::1") else host
    err.print(
        f"serving {name} on http://{shown}:{listen.port}/v1 "
        "(OpenAI API: /v1/chat/completions, /v1/completions, /v1/models; /health) · "
        f"{concurrency} · prefix cache {'on' if listen.prefix_cache else 'off'}"
        + (f", kept in {listen.cache_dir}" if listen.prefix_cache and listen.cache_dir else "")
        + (" · API key required" if listen.api_key else ""),
        markup=False,
    )
    if listen.api_key is None and host not in ("127.0.0.1", "::1", "localhost"):
        warning = f"warning: listening on {host} without an API key (--api-key-env VAR)"
        err.print(warning, style="yellow", markup=False)
