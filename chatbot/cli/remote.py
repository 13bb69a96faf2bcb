"""`chatbot run --server URL`: the REPL on a model behind an OpenAI-compatible server."""

from __future__ import annotations

import sys
from typing import Any

import typer

from chatbot.cli.load import exit_if_failed, resolve_api_key
from chatbot.errors import ConfigError

# `run` options that shape the local model and its cache: a server has its own.
_LOCAL_ONLY = (
    "prefill_chunk",
    "start_size",
    "recent_size",
    "keep_system",
    "max_context",
    "device",
    "dtype",
    "quantize",
    "device_map",
    "max_memory",
    "revision",
    "trust_remote_code",
    "template",
    "preset",
    "config",
    "threads",
    "opt",
)


def run_remote(
    ctx: typer.Context,
    server: str,
    model: str | None,
    api_key_env: str | None,
    system: str | None,
    overrides: dict[str, Any],
    enable_streaming: bool,
    plain: bool,
    no_stats: bool,
    resume: str | None,
    message: str | None = None,
    thinking_view: str = "fold",
) -> None:
    """`chatbot run --server URL`: the REPL on a RemoteSession (with a one-shot `message`:
    its answer alone)."""
    if enable_streaming:
        raise ConfigError(
            "--enable-streaming does not apply with --server: the server manages its own context"
        )
    sources = {name: getattr(ctx.get_parameter_source(name), "name", "") for name in _LOCAL_ONLY}
    given = [name for name, source in sources.items() if source == "COMMANDLINE"]
    if given:  # refused rather than silently ignored
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(f"{flag} does not apply with --server: the server runs the model")
    from chatbot.conversation.log import resolve_resume
    from chatbot.conversation.remote import RemoteBackend, RemoteSession, remote_sampling
    from chatbot.terminal.oneshot import answer_once
    from chatbot.terminal.repl import Repl
    from chatbot.terminal.repl import run as run_repl
    from chatbot.terminal.tty import make_consoles

    sampling = remote_sampling(**overrides)
    resume_path = resolve_resume(resume)
    interactive = sys.stdin.isatty() and message is None
    backend = RemoteBackend(server, model, resolve_api_key(api_key_env), api_key_env=api_key_env)
    # On a pipe nothing can be answered by a server that is not there: one error line now.
    backend.connect(strict=not interactive)
    session = RemoteSession(backend, system, sampling)
    out, info = make_consoles(interactive)
    plain = plain or not sys.stdout.isatty()
    repl = Repl(session, backend, out, plain=plain, show_stats=not no_stats, info=info)
    repl.thinking_view = thinking_view
    for note in backend.notes:
        repl.note(note)
    if interactive:
        repl.note(f"{backend.name} on {backend.base_url} · the server's prefix cache keeps the conversation")
    repl.start_log(
        resume_path,
        system=system,
        overrides={
            k: v
            for k, v in overrides.items()
            if v is not None and k not in ("stream_interval", "output_format")
        },
    )
    if message is not None:
        sys.exit(answer_once(repl, message))
    run_repl(repl, interactive)
    exit_if_failed(repl, interactive)
