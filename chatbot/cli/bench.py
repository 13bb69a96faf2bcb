"""`chatbot bench ...` and `chatbot eval-ppl`: measurements that print figures side by side."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from typer.exceptions import Exit

from chatbot.cli.load import load_with_status, make_backend, resolve_api_key, set_threads
from chatbot.cli.options import (
    ConversationOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelOpt,
    OptOpt,
    TextOpt,
    ThreadsOpt,
    check_opt,
)
from chatbot.errors import ConfigError

if TYPE_CHECKING:
    from chatbot.models.loader import LoadedModel

bench_app = typer.Typer(help="Benchmarks that print figures side by side.", no_args_is_help=True)

ApiKeyEnvOpt = Annotated[str | None, typer.Option(help="--server's API key's environment variable.")]


def progress_to_stderr() -> Callable[[str], None]:
    """Prints a bench's progress lines, dim, on stderr (its figures go to stdout)."""
    err = Console(stderr=True, highlight=False)
    return lambda line: err.print(line, style="dim", markup=False)


@contextmanager
def workers_progress(console: Console) -> Iterator[Callable[[str, int, int], None]]:
    """A bench's progress by worker (`progress(what starts now, finished, in all)`): on a
    terminal, a bar with the count and the time gone and left, gone when the bench ends; in
    a pipe or a file, a plain line per worker."""
    if not console.is_terminal:
        yield lambda line, done, total: console.print(line, style="dim", markup=False, highlight=False)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(bar_width=None), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("", total=None)
        yield lambda line, done, total: bar.update(task, description=line, completed=done, total=total)


def names(text: str | None) -> list[str]:
    """The names of a comma-separated option: "a, b,c" -> ["a", "b", "c"]."""
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def loaded_model(model: str | None, device: str, dtype: str, threads: int | None) -> LoadedModel:
    """The model a local bench measures, loaded with `threads` CPU threads set first."""
    set_threads(threads)
    return load_with_status(model, device, dtype)


def turns_figures(loaded: LoadedModel, turns: list[str], **options: Any) -> dict[str, Any]:
    """`run_turns_bench`'s figures (`options` are its own), printed."""
    from chatbot.measure.bench import run_turns_bench
    from chatbot.measure.report import print_turns

    result = run_turns_bench(loaded, turns, **options)
    print_turns(Console(), result)
    return result


def streaming_figures(loaded: LoadedModel, text: str, opt: str, **options: Any) -> dict[str, Any]:
    """`run_streaming_bench`'s figures through the decode path `opt` picks (the native kernels
    or transformers; `options` are the bench's own), printed."""
    from chatbot.measure.bench_streaming import run_streaming_bench
    from chatbot.measure.report import print_streaming

    backend, note = make_backend(loaded.model, opt)
    if note:
        progress_to_stderr()(note)
    result = run_streaming_bench(loaded, text, decoder=getattr(backend, "decoder", None), **options)
    print_streaming(Console(), result)
    return result


@bench_app.command("turns")
def bench_turns(
    conversation: ConversationOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per turn (greedy).", min=1)] = 64,
    repeats: Annotated[
        int, typer.Option(help="Plays of the conversation per side, interleaved; figures are medians.", min=1)
    ] = 3,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    server: Annotated[
        str | None,
        typer.Option(
            help="Measure a server's prefix cache through HTTP instead (OpenAI API, e.g. "
            "http://127.0.0.1:8000/v1): the conversation with its cache, and again with it bypassed."
        ),
    ] = None,
    api_key_env: ApiKeyEnvOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Persistent cache against re-encoding the whole history every turn."""
    from chatbot.measure.bench import load_conversation
    from chatbot.measure.report import write_json

    turns = load_conversation(conversation)
    if server is None:
        loaded = loaded_model(model, device, dtype, threads)
        result = turns_figures(loaded, turns, max_new_tokens=max_new_tokens, repeats=repeats)
    else:
        from chatbot.measure.bench_http import run_http_turns_bench
        from chatbot.measure.report import print_http_turns

        key = resolve_api_key(api_key_env)
        result = run_http_turns_bench(server, turns, max_new_tokens, model, key, progress_to_stderr())
        print_http_turns(Console(), result)
    write_json(json_out, result)


# `bench load`'s options
LoadServerOpt = Annotated[
    str | None, typer.Option(help="The server's API root, e.g. http://127.0.0.1:8000/v1.")
]
ClientsOpt = Annotated[
    str | None,
    typer.Option(
        help="Concurrent streaming clients, or counts measured in turn, e.g. 1,4: each a run of "
        "--duration, side by side with the tok/s ratio to 1 client (default: 8)."
    ),
]
DurationOpt = Annotated[
    float | None,
    typer.Option(
        help="Seconds each run keeps sending (requests in flight are finished; default: 60, "
        "30 a run when comparing).",
        min=1,
        max=3600,
    ),
]
LoadTokensOpt = Annotated[
    int | None, typer.Option(help="New tokens per answer (greedy; default: 32, 64 when comparing).", min=1)
]
LoadRoundsOpt = Annotated[
    int,
    typer.Option(
        help="When comparing: the client counts this many times in turn (1, 4, 1, 4, ...), each "
        "count's runs pooled; a change in the machine's load falls on all alike.",
        min=1,
    ),
]


@bench_app.command("load", short_help="A bounded load test on a server: N clients chatting at once.")
def bench_load(
    server: LoadServerOpt = None,
    clients: ClientsOpt = None,
    duration: DurationOpt = None,
    max_new_tokens: LoadTokensOpt = None,
    rounds: LoadRoundsOpt = 1,
    conversation: ConversationOpt = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="The model id on --server (default: its first)."),
    ] = None,
    api_key_env: ApiKeyEnvOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """A bounded load test on a server: N clients chatting at once for a fixed time; answers,
    errors, time to first token and the server's memory (chatbot serve's /health).

    With several client counts (--clients 1,4) or --rounds, each count is a run against the
    server, each request one short prompt, and the runs are printed side by side: aggregate
    tok/s, its ratio to 1 client, time to first token p50/p90 (scripts/bench-servers, in a
    clone, makes the same table of chatbot serve and llama.cpp's server started there)."""
    from chatbot.measure.bench import load_conversation
    from chatbot.measure.report import parse_counts, write_json

    if server is None:
        raise ConfigError(
            "give --server URL: the API root of a running server, e.g. http://127.0.0.1:8000/v1"
        )
    counts = parse_counts(clients or "8", "--clients", "1,4", most=64)
    turns = load_conversation(conversation)
    key = resolve_api_key(api_key_env)
    if len(counts) == 1 and rounds == 1:
        from chatbot.measure.bench_http import run_load_bench
        from chatbot.measure.report import print_load

        tokens, seconds = max_new_tokens or 32, duration or 60.0
        result = run_load_bench(server, turns, counts[0], seconds, tokens, model, key, progress_to_stderr())
        print_load(Console(), result)
        runs = [result]
    else:
        from chatbot.measure.bench_load import print_load_comparison, run_load_comparison

        plan = (duration or 30.0, max_new_tokens or 64, model, key, progress_to_stderr(), rounds)
        result = run_load_comparison(server, turns, counts, *plan)
        print_load_comparison(Console(), result)
        runs = result["runs"]
    write_json(json_out, result)
    if any(r["errors"] or r["incomplete"] for r in runs):
        raise Exit(1)


@bench_app.command("resume", short_help="--resume from a chat's disk cache against re-encoding its history.")
def bench_resume(
    history_tokens: Annotated[
        int, typer.Option(help="The chat restored holds at least this many tokens.", min=16)
    ] = 4000,
    repeats: Annotated[int, typer.Option(help="Restores of each kind, taken in turns; medians.", min=1)] = 3,
    enable_streaming: Annotated[
        bool, typer.Option(help="Attention sinks + recent window (--recent-size), as chatbot run has it.")
    ] = False,
    recent_size: Annotated[
        int | None, typer.Option(help="The recent window with --enable-streaming.", min=1)
    ] = None,
    opt: OptOpt = "auto",
    text: TextOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """A chat resumed from its KV cache on disk against re-encoding its history: the time to
    the next answer's first token, and the file's size."""
    from chatbot.config import EngineConfig
    from chatbot.measure.bench_resume import run_resume_bench
    from chatbot.measure.bench_streaming import default_text_path
    from chatbot.measure.report import print_resume, read_text, write_json

    body = read_text(text or default_text_path())
    loaded = loaded_model(model, device, dtype, threads)
    backend, note = make_backend(loaded.model, opt)
    if note:
        progress_to_stderr()(note)
    engine = EngineConfig(enable_streaming=enable_streaming, recent_size=recent_size)
    with workers_progress(Console(stderr=True)) as say:
        result = run_resume_bench(
            loaded, body, backend, history_tokens, repeats, engine, lambda line: say(line, 0, 0)
        )
    print_resume(Console(), result)
    write_json(json_out, result)


@bench_app.command("streaming")
def bench_streaming(
    text: TextOpt = None,
    recent_size: Annotated[
        list[int] | None, typer.Option(help="Recent window sizes to measure (repeatable).")
    ] = None,
    start_size: Annotated[int, typer.Option(help="Attention sinks.", min=0)] = 4,
    decode_tokens: Annotated[int, typer.Option(help="Greedy tokens decoded at each mark.", min=2)] = 32,
    opt: Annotated[
        str,
        typer.Option(
            "--opt",
            help="Decode path of the sink cache, as for chatbot run "
            "(recomputation always uses transformers).",
            callback=check_opt,
        ),
    ] = "auto",
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Decode speed and cache bytes at 1x, 4x, 16x the window, against recomputation."""
    from chatbot.measure.bench_streaming import default_text_path
    from chatbot.measure.report import read_text, write_json

    body = read_text(text or default_text_path())
    loaded = loaded_model(model, device, dtype, threads)
    sizes = tuple(recent_size or (256, 1024))
    options = {"recent_sizes": sizes, "start_size": start_size, "decode_tokens": decode_tokens}
    write_json(json_out, streaming_figures(loaded, body, opt, **options))


def eval_ppl(
    text: TextOpt = None,
    tokens: Annotated[int, typer.Option(help="Tokens to score, one per step.", min=2)] = 4000,
    start_size: Annotated[int, typer.Option(help="Attention sinks.", min=0)] = 4,
    recent_size: Annotated[int, typer.Option(help="Recent window.", min=1)] = 252,
    setups: Annotated[
        str, typer.Option(help="Comma-separated: dense,window,sinks,recompute.")
    ] = "dense,window,sinks,recompute",
    plot: Annotated[
        Path | None,
        typer.Option(
            help="PNG of running log-perplexity (default: beside --json, or eval_ppl.png; needs matplotlib)."
        ),
    ] = None,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Perplexity of dense attention, window, window + sinks and recomputation, side by side."""
    from rich.progress import Progress

    from chatbot.measure.bench_streaming import default_text_path
    from chatbot.measure.eval_ppl import format_table, plotting_missing, run_eval_ppl, write_plot
    from chatbot.measure.report import read_text, write_json

    body = read_text(text or default_text_path())
    chosen = tuple(names(setups))
    # Known before the (minutes-long) run: a plot asked for by name needs what draws it; the
    # default one is left out, said in a line after the table.
    missing = plotting_missing()
    if missing is not None and plot is not None:
        raise ConfigError(f"--plot: {missing}")
    loaded = loaded_model(model, device, dtype, threads)
    with Progress(console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(setup: str, done: int, total: int) -> None:
            if setup not in tasks:
                tasks[setup] = bar.add_task(setup, total=total)
            bar.update(tasks[setup], completed=done)

        result = run_eval_ppl(
            loaded.model, loaded.tokenizer, body, tokens, start_size, recent_size, chosen, progress
        )
    print(format_table(result))
    write_json(json_out, {k: {m: v for m, v in r.items() if m != "nll"} for k, r in result.items()})
    if missing is not None:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"no plot: {missing}", markup=False)
        return
    png = plot or (json_out.with_suffix(".png") if json_out else Path("eval_ppl.png"))
    title = f"{loaded.name}: {tokens} tokens, {start_size} sinks + {recent_size} recent"
    write_plot(result, png, title=title)
    print(f"plot: {png}")


DraftFileOpt = Annotated[
    str | None, typer.Option(help="The draft model of the -draft set-ups (a GGUF, a folder or a hub id).")
]
AlsoOpt = Annotated[
    str | None,
    typer.Option(
        help="Also run these benches on the same model, into the same JSON: turns (persistent cache "
        "vs re-encoding), streaming (sink cache vs recomputation; reads --text or the packaged "
        "Python FAQ text)."
    ),
]


@bench_app.command(
    "decode", short_help="Decode and prefill speed, time to first token and peak memory, side by side."
)
def bench_decode(
    setups: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated set-ups (default: transformers-generate, "
            "chatbot-off/f32/auto/fast/int8/int4, and llama.cpp when llama-cpp-python is installed; "
            "chatbot-compile runs the compiled step; a -json suffix, as chatbot-auto-json, decodes "
            "under a JSON-object grammar, as response_format asks; a -ngram suffix, as chatbot-auto-ngram, "
            "decodes with --draft ngram, a -draft suffix with the draft model of --draft; llama.cpp-ngram: "
            "llama-cpp-python's own prompt lookup)."
        ),
    ] = None,
    rounds: Annotated[
        int, typer.Option(help="Runs per set-up, interleaved; figures are medians.", min=1)
    ] = 3,
    decode_tokens: Annotated[
        int, typer.Option(help="Greedy tokens decoded after a 50-token prompt.", min=2)
    ] = 128,
    text: Annotated[
        Path | None,
        typer.Option(help="Text the prompts are cut from (default: the shipped conversation, repeated)."),
    ] = None,
    ppl_tokens: Annotated[
        int,
        typer.Option(
            help="Also measure perplexity over this many tokens of the text, through each decode path "
            "(0: skip).",
            min=0,
        ),
    ] = 0,
    gguf: Annotated[
        Path | None, typer.Option(help="GGUF file for llama.cpp (default: the default model's).")
    ] = None,
    prefill: Annotated[
        str, typer.Option(help="Comma-separated prompt lengths prefill is timed at.")
    ] = "50,500,2000",
    task: Annotated[
        str,
        typer.Option(
            help="What our set-ups decode: text (a 50-token cut of the text, continued), repeat or edit (a "
            "chat message asking to repeat or to proofread ~300 words of prose from "
            "chatbot/data/long_text.txt: grounded in its input) or write (free writing)."
        ),
    ] = "text",
    draft: DraftFileOpt = None,
    also: AlsoOpt = None,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = None,
) -> None:
    """Decode and prefill speed, time to first token and peak memory: transformers generate(),
    our engine at each --opt level, and llama.cpp, side by side (one process per set-up)."""
    from chatbot.measure.bench_decode import run_decode_bench
    from chatbot.measure.bench_timing import TASKS
    from chatbot.measure.decode_report import print_decode
    from chatbot.measure.report import parse_counts, read_text, write_json

    chosen = names(setups) or None
    if task not in TASKS:
        raise ConfigError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    extra = names(also)
    unknown = sorted(set(extra) - {"turns", "streaming"})
    if unknown:
        raise ConfigError(f"--also: unknown bench {', '.join(unknown)}; choose from turns, streaming")
    if "streaming" in extra:
        from chatbot.measure.bench_streaming import default_text_path

        long_text = read_text(text or default_text_path())
    prefill_sizes = tuple(parse_counts(prefill, "--prefill", "50,500,2000", what="prompt lengths"))
    progress = progress_to_stderr()
    with workers_progress(Console(stderr=True, highlight=False)) as workers:
        result = run_decode_bench(
            chosen,
            model=model,
            threads=threads,
            rounds=rounds,
            decode_tokens=decode_tokens,
            text=text,
            ppl_tokens=ppl_tokens,
            gguf=gguf,
            prefill_sizes=prefill_sizes,
            progress=workers,
            task=task,
            draft_model=draft,
        )
    print_decode(Console(), result)
    if extra:
        from chatbot.measure.bench import load_conversation

        loaded = loaded_model(model, "cpu", "auto", threads)
        if "turns" in extra:
            progress("multi-turn bench")
            result["turns"] = turns_figures(loaded, load_conversation(None))
        if "streaming" in extra:
            progress("streaming bench")
            result["streaming"] = streaming_figures(loaded, long_text, "auto")
    write_json(json_out, result)
