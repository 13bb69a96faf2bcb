"""The `chatbot` commands' options, each declared once as an `Annotated` alias (`run`, `serve`
and `config show` declare no option of their own; the settings' flags come from the table in
`chatbot.settings`). The steps from flags to a loaded model are in `chatbot.cli.load`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from chatbot.engine.backends.native.threads import apply_wait_policy
from chatbot.models.templates import choices_text
from chatbot.settings import SETTINGS, Setting

# Before torch loads libgomp (it reads its wait settings once): threads that wait at a
# barrier spin briefly, then sleep, so a busy machine is not made busier (engine/backends/native/threads.py).
apply_wait_policy()


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
ShowThinkingOpt = Annotated[
    bool,
    typer.Option(
        "--show-thinking",
        help="Keep a thinking model's thinking on screen (not folded to one line); in a pipe "
        "or a one-shot run, write it to stderr (stdout has the answer alone).",
    ),
]
HideThinkingOpt = Annotated[
    bool,
    typer.Option("--hide-thinking", help="Show only one line for a thinking model's thinking, not the text."),
]
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
SessionsLimitOpt = Annotated[
    int, typer.Option("--limit", help="Show at most this many, newest first.", min=1)
]
PruneOpt = Annotated[
    bool,
    typer.Option(
        "--prune", help="Remove every chat's KV cache on disk (the logs stay; --resume then re-encodes)."
    ),
]
CacheConversationsOpt = Annotated[
    int, typer.Option(help="Conversation caches kept, least recently used evicted.", min=1)
]
CacheDirOpt = Annotated[
    Path | None,
    typer.Option(
        help="Also keep each conversation's KV cache in this folder (after each answer): a "
        "restarted server goes on with a conversation it had, prefilling only what is new."
    ),
]
SlotSavePathOpt = Annotated[
    Path | None,
    typer.Option(
        help="Where POST /slots/ID?action=save|restore writes and reads conversations' KV caches "
        "(llama-server's slot save and restore)."
    ),
]
CacheDiskOpt = Annotated[str, typer.Option(help="Cap on --cache-dir's files, e.g. 4GiB (oldest first).")]
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
