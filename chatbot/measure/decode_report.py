"""`chatbot bench decode`'s figures as tables (`print_decode`), and its comparison with
llama.cpp in words (`versus_llama_cpp`)."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from chatbot.wording import counted

LLAMA_CPP = "llama.cpp"
LLAMA_CPP_NGRAM = f"{LLAMA_CPP}-ngram"  # llama-cpp-python's prompt lookup decoding
"""The set-up name of llama.cpp in `chatbot bench decode`."""
BASELINE = "transformers-generate"
"""The set-up whose greedy tokens the others are compared with."""


def _width(table: Any) -> int:
    """The columns `table` takes when nothing squeezes it (its widest rendered line)."""
    from io import StringIO

    from rich.console import Console
    from rich.measure import Measurement

    wide = Console(width=10_000, file=StringIO(), color_system=None)
    return Measurement.get(wide, wide.options, table).maximum


def fitted_tables(width: int, title: str, columns: list[str], rows: list[list[str]]) -> list[Any]:
    """`rows` under `columns` as Rich tables no wider than `width`: one table when it fits,
    else the columns after the first (the set-up's name, in every part) split into parts
    that fit, in order, so that no header or value is cut to an ellipsis."""
    from rich.table import Table

    def make(cols: list[int], part_title: str) -> Table:
        out = Table(title=part_title)
        for i in cols:
            out.add_column(columns[i], justify="left" if i == 0 else "right", no_wrap=True)
        for row in rows:
            out.add_row(*(row[i] for i in cols))
        return out

    parts: list[list[int]] = [[0]]
    for i in range(1, len(columns)):
        if len(parts[-1]) > 1 and _width(make([*parts[-1], i], title)) > width:
            parts.append([0])
        parts[-1].append(i)
    count = len(parts)
    # as many columns in each part as can be (7 as 4 + 3 rather than 5 + 2), where that fits
    rest = list(range(1, len(columns)))
    cut = [-(-n * len(rest) // count) for n in range(count + 1)]
    even = [[0, *rest[a:b]] for a, b in pairwise(cut)]
    if all(_width(make(cols, title)) <= width for cols in even):
        parts = even
    return [make(cols, title if count == 1 else f"{title} ({n}/{count})") for n, cols in enumerate(parts, 1)]


def same_tokens(r: dict[str, Any]) -> str:
    """The `same tok` cell: greedy tokens equal to the reference's, of those compared, with
    `*` where the difference is the set-up's own end of the answer."""
    same = r.get("same_tokens_as_baseline")
    if same is None:
        return ""
    end = "*" if r.get("parts_at_answer_end") else ""
    return f"{same}/{r['compared_tokens']}{end}" if r.get("compared_tokens") else f"{same}{end}"


def print_decode(console: Any, result: dict[str, Any]) -> None:
    """The medians as tables, one row per set-up, decode then prefill; each split into parts
    that fit the console's width (never a value cut to an ellipsis); a line for each set-up
    not measured and why; a legend of the columns."""
    s = result["settings"]
    sizes = [str(n) for n in s["prefill_sizes"]]
    title = (f"{s['model']}, {counted(result['machine']['torch_threads'], 'thread')}, "
             f"medians of {s['rounds']} interleaved rounds")  # fmt: skip
    measured = [r for r in result["results"] if "error" not in r]
    decode_rows, prefill_rows = [], []
    for r in measured:
        load_avg = f"{r['loadavg']:.2f}" if r.get("loadavg") is not None else ""
        drafts = r.get("draft_tokens")  # a -ngram set-up: the share of drafts kept
        kept = f" (draft {100 * r['draft_accepted'] / drafts:.0f}%)" if drafts else ""
        decode_rows.append([
            r["name"] + kept,
            f"{r['decode_tps']:.1f}",
            f"{r['ms_per_token_p50']:.1f}",
            f"{r['ms_per_token_p90']:.1f}",
            f"{r['peak_mem_mb']:.0f}",
            f"{r['bytes_per_weight']:.3f}" if r.get("bytes_per_weight") else "",
            same_tokens(r),
            load_avg,
        ])  # fmt: skip
        load_s = f"{r['load_s']:.1f}" if "load_s" in r else ""
        prefill = [f"{r['prefill_tps'][n]:.0f}" for n in sizes]
        prefill_rows.append([r["name"], *prefill, f"{r['ttft_s']:.3f}", load_s, load_avg])
    decode_cols = ["set-up", "tok/s", "p50\nms", "p90\nms", "peak\nMB", "B/\nweight", "same\ntok"]
    decode_cols.append("load\navg")
    prefill_cols = ["set-up", *[f"@{n}\ntok/s" for n in sizes], "TTFT\ns", "load\ns", "load\navg"]
    if measured:
        for table in fitted_tables(console.width, f"decode: {title}", decode_cols, decode_rows):
            console.print(table)
        prefill_title = "prefill at each prompt length, and time to first token"
        for table in fitted_tables(console.width, prefill_title, prefill_cols, prefill_rows):
            console.print(table)
    for r in result["results"]:
        if "error" in r:
            console.print(f"{r['name']}: not measured ({r['error']})", markup=False, highlight=False)
    if s.get("ppl_tokens"):
        console.print(quality_table(result))
    for line in versus_llama_cpp(result):
        console.print(line, markup=False)
    for r in result["results"]:
        if "compiles" in r:  # the compiled step: its compile time is not in the figures above
            failed = f"; failed, eager steps: {r['compile_failure']}" if r.get("compile_failure") else ""
            console.print(f"{r['name']}: {r['compiles']} compiles, {r.get('compile_s', 0):.1f} s compiling, "
                          f"{r['graph_breaks']} graph breaks{failed}", markup=False)  # fmt: skip
    m = result["machine"]
    load = f"; load average {m['loadavg_start'][0]} -> {m['loadavg_end'][0]}" if "loadavg_start" in m else ""
    cpu = m.get("cpu_model", m["processor"])
    prompt = s["decode_prompt_tokens"]
    legend = [
        f"{cpu}, {m['cpu_count']} CPUs, torch {m['torch']}{load}",
        "tok/s: tokens decoded per second; p50/p90 ms: per decoded token (median, 90th percentile)",
        "peak MB: the set-up's process's peak resident memory",
        "B/weight: bytes per weight of the matrices the native kernels read",
        f"same tok: greedy tokens equal to {BASELINE}'s up to the first difference / N compared",
        f"@N tok/s: prefill tokens per second, N-token prompt; TTFT s: first token, {prompt}-token prompt",
        "load s: from starting the set-up's process to its model ready (imports, reading, packing)",
        "load avg: the 1-minute load average as the set-up's runs ended (median)",
    ]
    if any(r.get("parts_at_answer_end") for r in measured):
        n = s.get("decode_tokens", "N")
        end = (f"  *: the set-up ended the answer there (end-of-text token); {BASELINE} is held to {n} "
               "tokens (min_new_tokens) and goes on past it")  # fmt: skip
        legend.insert(5, end)
    for line in legend:
        console.print(line, style="dim", markup=False, highlight=False)


def versus_llama_cpp(result: dict[str, Any], ours: str = "chatbot-auto") -> list[str]:
    """One line per figure: `ours` against llama.cpp from the same run (none when either
    is missing or failed)."""
    rows = {r["name"]: r for r in result["results"] if "error" not in r}
    a, b = rows.get(ours), rows.get(LLAMA_CPP)
    if a is None or b is None:
        return []
    size = "500" if "500" in a["prefill_tps"] else next(iter(a["prefill_tps"]))
    pairs = [
        ("decode tok/s", a["decode_tps"], b["decode_tps"], "x faster"),
        (f"prefill tok/s @{size}", a["prefill_tps"][size], b["prefill_tps"][size], "x faster"),
        ("load s", a.get("load_s"), b.get("load_s"), "x the time"),
        ("peak RSS MB", a["peak_mem_mb"], b["peak_mem_mb"], "x the memory"),
    ]
    if a.get("runtime_mb") and b.get("runtime_mb"):
        # What the model costs each side, apart from the runtime loaded before it (torch and
        # transformers against numpy and libllama): the part a smaller model shrinks.
        pairs += [
            ("RSS before the model (runtime) MB", a["runtime_mb"], b["runtime_mb"], "x the memory"),
            ("peak RSS above it MB", a["peak_mem_mb"] - a["runtime_mb"], b["peak_mem_mb"] - b["runtime_mb"],
             "x the memory"),
        ]  # fmt: skip
    load = f" (load average {a.get('loadavg', '?')} / {b.get('loadavg', '?')})"
    lines = [f"{ours} vs llama.cpp, same file, same run{load}:"]
    for label, x, y, unit in pairs:
        if x is None or y is None or not y:
            continue
        lines.append(f"  {label}: {x:,.1f} vs {y:,.1f} = {x / y:.2f}{unit}")
    return lines


def quality_table(result: dict[str, Any]) -> Any:
    """A rich table of each set-up's distributions against float32's on the same tokens
    (`chatbot.measure.quality`): perplexity, its distance from float32's with the standard
    error chance alone gives that distance on this text, mean KL divergence, top-1 agreement."""
    from rich.table import Table

    n = result["settings"]["ppl_tokens"]
    table = Table(title=f"quality over {n} tokens, against float32 (--opt off's forward pass)")
    table.add_column("set-up", no_wrap=True)
    for col in ("perplexity", "vs float32 ± se", "KL nats", "same top-1"):
        table.add_column(col, justify="right", no_wrap=True)
    scored = [r for r in result["results"] if "error" not in r and "ppl" in r]
    for r in scored:
        kl = f"{r['kl']:.5f}" if r["kl"] >= 1e-4 else f"{r['kl']:.1e}"
        gap = (
            f"{100 * (r['ppl'] / r['ref_ppl'] - 1):+.2f}% ± {100 * r.get('ppl_se', 0.0):.2f}"
            if r.get("ref_ppl")
            else "-"
        )
        table.add_row(r["name"], f"{r['ppl']:.4f}", gap, kl, f"{100 * r['top1']:.1f}%")
    return table
